"""Job records on the embedded backend: one folder per job under $TRAINFORGE_HOME/jobs/{job_id}/.

  job.json        spec, state, flow run, MLflow run, dataset version, layout, checkpoints, model version
  events.jsonl    what the workers reported (metrics, checkpoints, segment boundaries)
  logs/           torchrun's per-rank stdout/stderr, per segment attempt
  failures/       per-rank failure reports
The record is rewritten atomically; the flow is its only writer.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainforge.home import home

STATES = ("pending", "running", "completed", "failed", "cancelled")


def new_job_id(name: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def is_job_id(text: str, name: str) -> bool:
    """Whether `text` is an id `new_job_id(name)` makes."""
    return re.fullmatch(re.escape(name) + r"-\d{8}-\d{6}-[0-9a-f]{4}", text) is not None


@dataclass
class JobRecord:
    folder: Path
    data: dict[str, Any]

    @property
    def job_id(self) -> str:
        return self.data["job_id"]

    @property
    def events_path(self) -> Path:
        return self.folder / "events.jsonl"

    def update(self, **fields: Any) -> None:
        """Read-modify-write under a file lock: the flow and its tasks each hold a copy of the record, and a
        stale copy must never overwrite fields another one wrote."""
        with open(self.folder / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self.reload()
                self.data.update(fields)
                self.data["updated_at"] = time.time()
                self.save()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def reload(self) -> None:
        path = self.folder / "job.json"
        if path.is_file():
            self.data = json.loads(path.read_text())

    def save(self) -> None:
        tmp = self.folder / ".job.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.folder / "job.json")


class JobStore:
    def __init__(self, root: Path | None = None):
        self.root = root or home() / "jobs"
        self.root.mkdir(parents=True, exist_ok=True)

    def create(self, job_id: str, **fields: Any) -> JobRecord:
        folder = self.root / job_id
        folder.mkdir(parents=True, exist_ok=False)
        record = JobRecord(folder, {"job_id": job_id, "state": "pending", "created_at": time.time(), **fields})
        record.save()
        return record

    def get(self, job_id: str) -> JobRecord:
        folder = self.root / job_id
        path = folder / "job.json"
        if not path.is_file():
            matches = self.find(job_id)
            if len(matches) == 1:
                return matches[0]
            known = ", ".join(r.job_id for r in self.list()[-5:]) or "none"
            hint = f"{len(matches)} jobs match {job_id!r}" if matches else f"no job {job_id!r}"
            raise LookupError(f"{hint} (recent: {known}); use `trainforge status` to list jobs")
        return JobRecord(folder, json.loads(path.read_text()))

    def find(self, name: str) -> list[JobRecord]:
        """Jobs whose id starts with `name` (a job name finds all its submissions)."""
        return [r for r in self.list() if r.job_id == name or r.job_id.startswith(name + "-")]

    def list(self) -> list[JobRecord]:
        out = []
        for path in self.root.glob("*/job.json"):
            try:
                out.append(JobRecord(path.parent, json.loads(path.read_text())))
            except ValueError:
                continue
        return sorted(out, key=lambda r: r.data.get("created_at", 0))
