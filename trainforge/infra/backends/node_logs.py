"""A node's logs of one segment, from its own disk to the flow through the object store.

The workers' logs (torchrun's per-rank stdout/stderr), the agent's and the sidecar's stay in the node's folder on
its own machine. When the segment ends the node agent puts their tails under the job's prefix
(`logs/segment-{attempt}/{node}/...`, a folder the job's identity may write), before it reports its exit; the flow
then fetches them into the segment's log folder in the layout the one-host multi-node gang writes (`node-{i}/`,
`agent.log` for the first node, `agent-node-{i}.log` for the others), so a failure's log tail, `trainforge logs`
and the registry's log artifacts read them as they read a local gang's. A node lost whole uploads nothing: what its
machine kept is there, and the failure says so ("(no log)").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from trainforge.infra.storage import ObjectStore

log = logging.getLogger(__name__)

MAX_LOG_BYTES = 1 << 20
"""The most of one log file sent up: its end (a failure's traceback is the last thing it wrote)."""
MAX_LOG_FILES = 1024
"""The most files fetched of one node's segment (a rank's two logs per restart, plus the agent's and sidecar's)."""
MAX_NODE_LOG_BYTES = 32 << 20
"""The most bytes fetched of one node's segment."""
FETCH_TIMEOUT_S = 30.0
"""How long the flow spends fetching a segment's node logs, all nodes together (a store out of reach)."""
UPLOAD_TIMEOUT_S = 15.0
"""How long a node agent spends uploading before it reports its exit anyway (a store out of reach)."""


def node_log_files(work: Path) -> list[Path]:
    """The agent's and sidecar's logs and torchrun's per-rank logs of one node's segment folder."""
    own = [work / name for name in ("agent.log", "sidecar.log") if (work / name).is_file()]
    return own + sorted(p for p in (work / "logs").rglob("*.log") if p.is_file())


def _tail_bytes(path: Path, limit: int = MAX_LOG_BYTES) -> bytes:
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - limit))
        return f.read()


def upload_node_logs(store: ObjectStore, key: str, work: Path) -> int:
    """Every log of `work` under `key` (paths relative to `work`); returns how many went up."""
    sent = 0
    for path in node_log_files(work):
        try:
            store.put_bytes(f"{key}/{path.relative_to(work)}", _tail_bytes(path))
            sent += 1
        except OSError as exc:
            log.warning("node log %s not uploaded: %s", path, exc)
    return sent


def upload_bounded(store_url: str, key: str, work: Path, timeout_s: float = UPLOAD_TIMEOUT_S) -> bool:
    """`upload_node_logs` in a daemon thread, waited for at most `timeout_s`; False when it did not finish (the
    agent reports its exit anyway: the logs stay on the node)."""
    from trainforge.infra.storage import open_store

    def run() -> None:
        try:
            upload_node_logs(open_store(store_url), key, work)
        except Exception as exc:  # the node's exit matters more than its logs
            log.warning("node logs not uploaded to %s: %s", key, exc)

    worker = threading.Thread(target=run, name="node-logs", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()


def fetch_node_logs(store: ObjectStore, key: str, index: int, log_dir: Path, deadline: float | None = None) -> int:
    """Node `index`'s uploaded logs into `log_dir` in the one-host multi-node layout; returns how many.

    The keys are the job's (its identity may write under `logs/`), so what comes back is bounded and confined: at
    most MAX_LOG_FILES files of MAX_LOG_BYTES each and MAX_NODE_LOG_BYTES in all, each written inside `log_dir` or
    skipped (an absolute, '..' or empty segment), never through a link in a local store, and nothing after
    `deadline` (time.monotonic). A store error ends the fetch (raised): the next node's would fail the same."""
    from trainforge.infra.storage import LocalObjectStore
    from trainforge.infra.storage.base import check_key

    root = Path(os.path.abspath(log_dir))
    got = total = 0
    for full in store.list(f"{key}/")[:MAX_LOG_FILES]:
        if deadline is not None and time.monotonic() > deadline:
            log.warning("node %d's logs: stopped at the deadline after %d files", index, got)
            break
        rel = full[len(key) + 1:]
        try:
            check_key(rel)
        except ValueError:
            continue  # a key no node agent writes
        if rel == "agent.log":
            dest = log_dir / ("agent.log" if index == 0 else f"agent-node-{index}.log")
        elif rel.startswith("logs/"):
            dest = log_dir / f"node-{index}" / rel.removeprefix("logs/")
        else:
            dest = log_dir / f"node-{index}" / rel
        if not Path(os.path.abspath(dest)).is_relative_to(root):
            continue
        if isinstance(store, LocalObjectStore):  # a shared filesystem: the job could plant a link to any file
            path = store.local_path(full)
            if path.is_symlink() or not path.is_file() or not path.resolve().is_relative_to(store.root.resolve()):
                continue
        data = store.get_bytes(full, byte_range=(0, MAX_LOG_BYTES))  # the agent sent a tail: its first MiB is all
        if total + len(data) > MAX_NODE_LOG_BYTES:
            log.warning("node %d's logs: stopped at %d bytes after %d files", index, total, got)
            break
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        total += len(data)
        got += 1
    return got
