"""A node's logs reach the flow through the object store (infra/backends/node_logs.py): what the agent uploads at
the end of a segment lands in the segment's log folder in the one-host multi-node layout, where a failure's tail
finds a rank's stderr by its global rank."""

from __future__ import annotations

from pathlib import Path

from trainforge.infra.backends.node_logs import fetch_node_logs, upload_bounded, upload_node_logs
from trainforge.infra.storage import LocalObjectStore
from trainforge.tasks.segment import _killed_rank, _log_tail, _rank_log


def node_folder(root: Path, node: int, per_node: int = 2) -> Path:
    """A node's segment folder as the agent leaves it: its own logs and torchrun's per-rank ones."""
    work = root / f"n{node}"
    for local in range(per_node):
        rank_dir = work / "logs" / "job-0-abc" / "attempt_0" / str(local)
        rank_dir.mkdir(parents=True)
        (rank_dir / "stderr.log").write_text(f"node {node} local {local}\nTraceback: boom {node * per_node + local}\n")
        (rank_dir / "stdout.log").write_text("step 1\n")
    (work / "agent.log").write_text(f"agent of node {node}\n" + ("  rank: 3 (local_rank: 1)\n  exitcode: -9\n"
                                                                  if node == 1 else ""))
    (work / "sidecar.log").write_text("")
    (work / "worker-config.json").write_text("{}")  # not a log: stays on the node
    return work


def test_a_nodes_logs_come_back_where_a_failure_reads_a_ranks_tail(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    log_dir = tmp_path / "flow" / "logs" / "segment-0"
    for node in range(2):
        key = f"teams/t/jobs/j/logs/segment-0/host-{node}"
        assert upload_node_logs(store, key, node_folder(tmp_path / "nodes", node)) == 6
        assert fetch_node_logs(store, key, node, log_dir) == 6
    assert not list(log_dir.rglob("worker-config.json"))
    for rank in range(4):
        assert f"boom {rank}" in _log_tail(log_dir, rank)
    assert _rank_log(log_dir, 3) == log_dir / "node-1" / "job-0-abc" / "attempt_0" / "1" / "stderr.log"
    assert (log_dir / "agent.log").read_text() == "agent of node 0\n"
    assert (log_dir / "agent-node-1.log").read_text().startswith("agent of node 1")
    # node 0's agent saw no death: the summary is node 1's (its torchrun names the global rank)
    assert _killed_rank(log_dir) == (3, "exitcode: -9")


def test_only_the_end_of_a_huge_log_goes_up(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    work = tmp_path / "n0"
    (work / "logs").mkdir(parents=True)
    (work / "agent.log").write_bytes(b"x" * (2 << 20) + b"the end\n")
    upload_node_logs(store, "k", work)
    sent = store.get_bytes("k/agent.log")
    assert len(sent) == 1 << 20 and sent.endswith(b"the end\n")


def test_a_store_out_of_reach_costs_the_agent_a_bounded_wait(tmp_path: Path) -> None:
    work = node_folder(tmp_path, 0)
    assert upload_bounded((tmp_path / "store").as_uri(), "k", work, timeout_s=10.0)
    assert (tmp_path / "store" / "k" / "agent.log").is_file()
    # an unusable store (its root is a file): logged, not raised; the agent reports its exit either way
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert upload_bounded(blocker.as_uri(), "k", work, timeout_s=5.0)
    assert blocker.read_text() == ""


def test_a_node_whose_logs_did_not_come_back_leaves_a_gap_not_a_shift(tmp_path: Path) -> None:
    """3 nodes x 2 ranks, node 1 lost whole (nothing uploaded): rank 2's log is missing, not node 2's rank 4."""
    store = LocalObjectStore(tmp_path / "store")
    log_dir = tmp_path / "flow" / "logs" / "segment-0"
    for node in (0, 2):
        key = f"k/host-{node}"
        upload_node_logs(store, key, node_folder(tmp_path / "nodes", node))
        fetch_node_logs(store, key, node, log_dir)
    assert _rank_log(log_dir, 2) is None and _rank_log(log_dir, 3) is None
    assert "boom 4" in _log_tail(log_dir, 4) and "boom 5" in _log_tail(log_dir, 5)


def test_what_comes_back_is_bounded_and_never_read_through_a_link(tmp_path: Path) -> None:
    """The job's identity may write under logs/: a huge object comes back as its first MiB, and on a shared
    filesystem a link it planted to another file of the flow's host is not followed."""
    store = LocalObjectStore(tmp_path / "store")
    secret = tmp_path / "flow-secret"
    secret.write_text("another team's token")
    store.put_bytes("k/n0/logs/big.log", b"y" * (3 << 20))
    link = store.local_path("k/n0/logs/stolen.log")
    link.symlink_to(secret)
    log_dir = tmp_path / "flow" / "logs"
    assert fetch_node_logs(store, "k/n0", 0, log_dir) == 1
    assert (log_dir / "node-0" / "big.log").stat().st_size == 1 << 20
    assert not (log_dir / "node-0" / "stolen.log").exists()


def test_a_fetch_past_its_deadline_stops(tmp_path: Path) -> None:
    import time

    store = LocalObjectStore(tmp_path / "store")
    upload_node_logs(store, "k", node_folder(tmp_path / "nodes", 0))
    assert fetch_node_logs(store, "k", 0, tmp_path / "logs", deadline=time.monotonic() - 1) == 0
