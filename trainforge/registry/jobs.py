"""Job records on the embedded backend: one folder per job under $TRAINFORGE_HOME/jobs/{job_id}/.

  job.json        spec, state, flow run, MLflow run, dataset version, layout, checkpoints, model version
  events.jsonl    what the workers reported (metrics, checkpoints, segment boundaries)
  logs/           torchrun's per-rank stdout/stderr, per segment attempt
  failures/       per-rank failure reports
The record is rewritten atomically; the flow is its only writer.

What users type for a job (every command that takes JOB, the SDK's get_job, `submit --resume`) is resolved in one
place, `JobStore.get`: an exact job id wins; else a job name (the spec's `name`) means that name's newest job;
anything else (a prefix of ids or names, a typo) is an error naming the candidates, or saying no job has it.
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


# What new_job_id appends to the name: the UTC submission time and a random suffix.
_ID_SUFFIX = r"-\d{8}-\d{6}-[0-9a-f]{4}"
# Candidates an unresolved argument lists at most (the newest ones).
MAX_CANDIDATES = 10


def new_job_id(name: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(2)}"


def is_job_id(text: str, name: str) -> bool:
    """Whether `text` is an id `new_job_id(name)` makes."""
    return re.fullmatch(re.escape(name) + _ID_SUFFIX, text) is not None


class JobLookupError(LookupError):
    """What the user typed for a job names none, or more than one; the message says what to type instead."""


class JobNotFoundError(JobLookupError):
    """No job id and no job name is the argument (nor does any id or name start with it)."""

    def __init__(self, query: str, message: str):
        super().__init__(message)
        self.query = query


class AmbiguousJobError(JobLookupError):
    """The argument is neither a job id nor a job name, but ids or names start with it: `candidates`, newest
    last."""

    def __init__(self, query: str, candidates: list[JobRecord], message: str):
        super().__init__(message)
        self.query = query
        self.candidates = candidates


@dataclass
class JobRecord:
    folder: Path
    data: dict[str, Any]

    @property
    def job_id(self) -> str:
        return self.data["job_id"]

    @property
    def name(self) -> str:
        """The spec's `name` the job was submitted under (a record without one: its id less the suffix
        new_job_id adds)."""
        name = self.data.get("name")
        if isinstance(name, str) and name:
            return name
        m = re.fullmatch(r"(.+)" + _ID_SUFFIX, self.job_id)
        return m.group(1) if m else self.job_id

    @property
    def created_at(self) -> float:
        """When the job was created (seconds since the epoch; 0 when the record lacks it)."""
        value = self.data.get("created_at")
        return float(value) if isinstance(value, int | float) else 0.0

    @property
    def state(self) -> str:
        return str(self.data.get("state") or "pending")

    def describe(self) -> str:
        """One line for a list of candidates: id, name, created (UTC), state."""
        created = datetime.fromtimestamp(self.created_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{self.job_id}  (name {self.name}, created {created}, {self.state})"

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

    def get(self, job: str) -> JobRecord:
        """The job `job` names; the one place a job argument is resolved (every command's JOB, the SDK, the flows):
          1. an exact job id wins;
          2. else a job name (the spec's `name`, exactly) means that name's newest job (by its record's created_at);
          3. else, when ids or names start with it, AmbiguousJobError lists those jobs (newest last) and says to
             pass a full id; otherwise JobNotFoundError says no job has it and how to list jobs.
        Both are JobLookupErrors (LookupError), as is a record that cannot be read; the message is meant for the
        user as it is."""
        if not job or not job.strip():
            raise JobNotFoundError(job, "no job given: pass a job id or a job name (`trainforge status` lists "
                                   "jobs)")
        record = self._by_id(job)
        if record is not None:
            return record
        records = self.list()
        named = self.find(job, records)
        if named:
            return named[-1]
        candidates = [r for r in records if r.job_id.startswith(job) or r.name.startswith(job)]
        if candidates:
            raise AmbiguousJobError(job, candidates, _ambiguous_message(job, candidates))
        recent = ", ".join(r.job_id for r in records[-5:]) or "none yet"
        raise JobNotFoundError(job, f"no job {job!r}: no job id or job name is {job!r} (recent jobs: {recent}); "
                               "`trainforge status` lists jobs")

    def _by_id(self, job_id: str) -> JobRecord | None:
        """The record whose id is exactly `job_id`, None when there is none (or `job_id` cannot be a folder
        name)."""
        if job_id in (".", "..") or "/" in job_id or os.sep in job_id or "\0" in job_id:
            return None
        folder = self.root / job_id
        path = folder / "job.json"
        if not path.is_file():
            return None
        try:
            return JobRecord(folder, json.loads(path.read_text()))
        except ValueError as exc:
            raise JobLookupError(f"job {job_id}: its record {path} cannot be read ({exc})") from None

    def find(self, name: str, records: list[JobRecord] | None = None) -> list[JobRecord]:
        """The jobs submitted under the job name `name` (exactly), oldest first."""
        return [r for r in (self.list() if records is None else records) if r.name == name]

    def list(self) -> list[JobRecord]:
        """Every readable job record, oldest first (by created_at, then id)."""
        out = []
        for path in self.root.glob("*/job.json"):
            try:
                out.append(JobRecord(path.parent, json.loads(path.read_text())))
            except ValueError:
                continue
        return sorted(out, key=lambda r: (r.created_at, r.job_id))


def _ambiguous_message(query: str, candidates: list[JobRecord]) -> str:
    shown = candidates[-MAX_CANDIDATES:]
    lines = [f"{query!r} is neither a job id nor a job name; {len(candidates)} job(s) start with it"
             + (f" (the newest {len(shown)} here)" if len(shown) < len(candidates) else "") + ":"]
    lines += [f"  {r.describe()}" for r in shown]
    names = sorted({r.name for r in candidates})
    lines.append(f"pick one: pass its full job id, e.g. {shown[-1].job_id}, or a job name exactly for that name's "
                 f"newest job ({', '.join(names)})")
    return "\n".join(lines)
