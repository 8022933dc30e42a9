"""A `hosts` job's folders on each machine: held while a node agent runs, removed when the job ends, swept by age.

On a host, the launcher's `work_dir` holds one folder per job: `{work_dir}/{job}/{node}` (the inputs fetched from the
store, checkpoint staging, the run folder: kept across the job's segments, so a retried segment on the same host does
not fetch them again) and `{work_dir}/{job}/segment-{n}/{node}` (a segment's worker config and logs; the logs are in
the store too once the segment ended). Without this module they stayed forever: a dataset copy per job per host.

- A node agent holds its node folder (`hold`: a shared `flock` on the folder itself) for as long as it runs.
- When the job ends, the flow runs `python -m trainforge.infra.backends.node_folders remove` on every host the job
  ran on (through the cluster's runner): it takes the lock exclusively, so a folder an agent still holds (a host
  partitioned away, its agent stopped) is left alone, and renames the folder away before removing it, so an agent
  starting meanwhile makes a fresh one (`hold` checks that what it locked is still the folder at that path).
- Every agent, when it starts, sweeps its host's folders of other jobs that no agent holds and nobody used for
  `max_age_s` (a job whose end was never seen there: the flow killed, the host unreachable when the job ended).

On a real machine a node name is its host: each host only ever touches its own node's folders, so hosts sharing one
disk (the test rig) do not either.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

SWEEP_FLOOR_H = 6.0
"""The sweep never removes a folder used less than this long ago, whatever the launcher keeps a finished job's for:
a job between two segments (waiting to be placed again) keeps its inputs on the hosts it may come back to."""
HOLD_TIMEOUT_S = 30.0
JOB_MARK = ".trainforge-job"
"""In every job folder `hold` made: the sweep passes over anything else in the work folder (a user's, a home)."""
"""How long `hold` waits for a remover that has the folder (it renames it away, then lets go: milliseconds)."""


class FolderBusy(RuntimeError):
    pass


def _open_dir(path: Path) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


def hold(node_dir: Path, timeout_s: float = HOLD_TIMEOUT_S) -> int:
    """The node's folder, made if missing and locked shared for the caller's lifetime (the descriptor returned: the
    lock goes with it, whatever ends the process). Its time of last use is now (the sweep's age counts from it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        node_dir.mkdir(parents=True, exist_ok=True)
        fd = _open_dir(node_dir)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise FolderBusy(f"{node_dir} stayed locked by a remover for {timeout_s:.0f} s") from None
                time.sleep(0.05)
        try:
            same = os.stat(node_dir).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.utime(node_dir)
            (node_dir.parent / JOB_MARK).touch()  # the sweep removes nothing but what this module made
            return fd
        os.close(fd)  # a remover renamed it away while this waited: make and lock the new one


def _take(path: Path) -> Path | None:
    """`path` renamed to a hidden name beside it once no agent holds it (None when one does, or it is gone)."""
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(f"{path} is in use by a running node agent") from None
        if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
            return None
        gone = path.with_name(f".removing-{path.name}-{uuid.uuid4().hex[:8]}")
        os.rename(path, gone)
        return gone
    finally:
        os.close(fd)


def remove_node(work_dir: Path, job_id: str, node: str) -> str:
    """A job's folders of one node: `removed`, `absent`, or `in use` (an agent holds it: left alone)."""
    job = work_dir / job_id
    try:
        taken = _take(job / node)
    except FolderBusy:
        return "in use"
    segments = sorted(job.glob(f"segment-*/{node}")) if job.is_dir() else []
    for folder in segments:  # its agents have ended: no agent of the job runs on this node any more
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the segment's folder, once every node's is gone
    if taken is not None:
        shutil.rmtree(taken, ignore_errors=True)
    with contextlib.suppress(OSError):
        if [p.name for p in job.iterdir()] == [JOB_MARK]:  # the job's folder, once every node's is gone
            (job / JOB_MARK).unlink()
            job.rmdir()
    return "removed" if taken is not None or segments else "absent"


def sweep(work_dir: Path, node: str, keep_job: str, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove this node's folders of other jobs that no agent holds and that were last used over `max_age_s` ago;
    the jobs whose folders were removed. A folder that cannot be read or removed is skipped, never raised."""
    now = time.time() if now is None else now
    removed = []
    try:
        jobs = sorted(p for p in work_dir.iterdir()
                      if p.name != keep_job and not p.name.startswith(".") and (p / JOB_MARK).is_file())
    except OSError:
        return []
    for job in jobs:
        folder = job / node
        try:
            used = folder.stat().st_mtime
        except OSError:
            continue
        if now - used < max_age_s:
            continue
        try:
            if remove_node(work_dir, job.name, node) == "removed":
                removed.append(job.name)
        except OSError:
            continue
    return removed


def _safe_name(value: str, what: str) -> str:
    if not value or value in (".", "..") or "/" in value or value.startswith("."):
        raise ValueError(f"{what} {value!r} is not a plain folder name")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainforge.infra.backends.node_folders",
                                description="Remove a finished job's folders of one node on this host.")
    p.add_argument("command", choices=["remove"])
    p.add_argument("--work-dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--node", required=True)
    args = p.parse_args(argv)
    try:
        outcome = remove_node(Path(args.work_dir), _safe_name(args.job, "job"), _safe_name(args.node, "node"))
    except (OSError, ValueError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps({"outcome": outcome}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
