"""Finding a failed rank's torchrun log, single-node and one-agent-per-node layouts.

Run: .venv/bin/python -m pytest tests/unit/test_segment_logs.py
"""

from trainforge.tasks.segment import _rank_log


def _log(path, text):
    path.mkdir(parents=True)
    (path / "stderr.log").write_text(text)


def test_single_node_layout_is_by_global_rank(tmp_path):
    for rank in range(2):
        _log(tmp_path / "none_abc" / "attempt_0" / str(rank), f"rank {rank}")
    _log(tmp_path / "none_abc" / "attempt_1" / "1", "rank 1 after restart")
    assert _rank_log(tmp_path, 0).read_text() == "rank 0"
    assert _rank_log(tmp_path, 1).read_text() == "rank 1 after restart"  # the newest attempt


def test_one_agent_per_node_maps_global_rank_to_node_and_local_rank(tmp_path):
    for node in range(2):
        for local in range(2):
            _log(tmp_path / f"node-{node}" / "run_x" / "attempt_0" / str(local), f"node {node} local {local}")
    assert [_rank_log(tmp_path, r).read_text() for r in range(4)] == [
        "node 0 local 0", "node 0 local 1", "node 1 local 0", "node 1 local 1"]
    assert _rank_log(tmp_path, 7) is None
