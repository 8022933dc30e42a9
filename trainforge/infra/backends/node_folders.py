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
import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import time
import uuid
from pathlib import Path

SWEEP_FLOOR_H = 6.0
"""The sweep never removes a folder used less than this long ago, whatever the launcher keeps a finished job's for:
a job between two segments (waiting to be placed again) keeps its inputs on the hosts it may come back to."""
HOLD_TIMEOUT_S = 30.0
"""How long `hold` waits for a remover that has the folder (it renames it away, then lets go: milliseconds)."""
JOB_MARK = ".trainforge-job"
"""In every job folder `hold` made: the sweep passes over anything else in the work folder (a user's, a home)."""
REMOVING = ".removing-"
"""A node's folder being removed is first renamed `.removing-<node>-<random>` beside where it was."""


class FolderBusy(RuntimeError):
    pass


def _open_dir(path: Path) -> int:
    """The folder itself, never through a link (ELOOP/ENOTDIR: not a folder this module made)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)


def _ours(path: Path) -> bool:
    """A real folder (not a link to one) of this user's: only such are ever removed (a link planted in a shared
    work folder must not point the removal elsewhere)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def hold(node_dir: Path, timeout_s: float = HOLD_TIMEOUT_S) -> int:
    """The node's folder, made if missing and locked shared for the caller's lifetime (the descriptor returned: the
    lock goes with it, whatever ends the process). Its time of last use is now (the sweep's age counts from it;
    `release` sets it again when the agent ends)."""
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
            same = os.lstat(node_dir).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.utime(fd)
            (node_dir.parent / JOB_MARK).touch()  # the sweep removes nothing but what this module made
            return fd
        os.close(fd)  # a remover renamed it away while this waited: make and lock the new one


def release(fd: int) -> None:
    """The agent is done: the folder was used until now (a segment of many hours is not "unused" when it ends)."""
    with contextlib.suppress(OSError):
        os.utime(fd)
        os.close(fd)


def _hidden(path: Path, node: str) -> Path:
    return path.with_name(f"{REMOVING}{node}-{uuid.uuid4().hex[:8]}")


def _take(job: Path, node: str) -> list[Path]:
    """Under the node folder's exclusive lock (FolderBusy when an agent holds it), the node's folders of the job
    renamed to hidden names: its own and each segment's. From then on an agent starting makes fresh ones, and
    whatever happens to the removal, the next removal or sweep finds the hidden ones (`_leftovers`)."""
    node_dir = job / node
    with contextlib.suppress(FileExistsError):
        os.mkdir(node_dir)  # locked even when missing: no agent may start a segment folder while they go
    fd = _open_dir(node_dir)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(f"{node_dir} is in use by a running node agent") from None
        try:
            if os.lstat(node_dir).st_ino != os.fstat(fd).st_ino:
                return []  # another removal renamed it meanwhile (and an agent may hold a fresh one): theirs
        except FileNotFoundError:
            return []
        taken = []
        for segment in _segments(job):
            if _ours(segment / node):
                gone = _hidden(segment / node, node)
                os.rename(segment / node, gone)
                taken.append(gone)
        gone = _hidden(node_dir, node)
        os.rename(node_dir, gone)
        return [gone, *taken]
    finally:
        os.close(fd)


def _segments(job: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(job)
                      if e.name.startswith("segment-") and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _leftovers(job: Path, node: str) -> list[Path]:
    """This node's folders a removal renamed and did not finish removing (it was killed, a file resisted)."""
    prefix = f"{REMOVING}{node}-"
    out = []
    for folder in (job, *_segments(job)):
        with contextlib.suppress(OSError):
            out += [Path(e.path) for e in os.scandir(folder)
                    if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    return out


def remove_node(work_dir: Path, job_id: str, node: str) -> str:
    """A job's folders of one node: `removed`, `absent`, `in use` (an agent holds them: left alone) or
    `partly removed` (something in them resisted: the next removal or sweep tries again)."""
    job = work_dir / job_id
    if not _ours(job):
        return "absent"
    existed = os.path.lexists(job / node)
    try:
        taken = _take(job, node)
    except FolderBusy:
        return "in use"
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file where the node's folder should be
            return "absent"
        raise
    removing = taken + [p for p in _leftovers(job, node) if p not in taken]
    for folder in removing:
        shutil.rmtree(folder, ignore_errors=True)
    for segment in _segments(job):
        with contextlib.suppress(OSError):
            segment.rmdir()  # a segment's folder, once every node's is gone
    with contextlib.suppress(OSError):
        if [p.name for p in job.iterdir()] == [JOB_MARK]:  # the job's folder, once every node's is gone
            (job / JOB_MARK).unlink()
            job.rmdir()
    if any(os.path.lexists(p) for p in removing):
        return "partly removed"
    # the node's own folder is among those taken even when it was missing (made, to be locked)
    return "removed" if existed or len(removing) > 1 else "absent"


def sweep(work_dir: Path, node: str, keep_job: str, max_age_s: float, now: float | None = None) -> list[str]:
    """Remove this node's folders of other jobs that no agent holds and that were last used over `max_age_s` ago
    (and what an earlier removal left half done); the jobs whose folders were removed. Only job folders this module
    made (their mark), real folders of this user's; one that cannot be read or removed is skipped, never raised."""
    now = time.time() if now is None else now
    removed = []
    try:
        jobs = sorted(Path(e.path) for e in os.scandir(work_dir)
                      if e.name != keep_job and not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    for job in jobs:
        if not _ours(job) or not (job / JOB_MARK).is_file():
            continue
        try:
            used: float | None = os.lstat(job / node).st_mtime
        except FileNotFoundError:
            if not _leftovers(job, node):
                continue
            used = None  # only a half-done removal's leftovers: finish it
        except OSError:
            continue
        if used is not None and now - used < max_age_s:
            continue
        try:
            if remove_node(work_dir, job.name, node) in ("removed", "partly removed"):
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
