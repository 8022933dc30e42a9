"""The `hosts` gang's view of a cut (infra/backends/hosts.py `HostsGang.cut`): its agents' reach reports make a cut
only once the channel heard every host after the first failed probe; a host silent in the channel too is a lost
host, the supervisor's, not a cut."""

from __future__ import annotations

import time
from pathlib import Path

from trainforge.infra.backends.hosts import HostsGang, RemoteNode
from trainforge.infra.backends.node_agent import NodeProgram


def _gang(tmp_path: Path, names: list[str]) -> HostsGang:
    return HostsGang([RemoteNode(n, f"10.0.0.{i + 1}", ["true"], NodeProgram(node=n, work_dir=str(tmp_path),
                                                                            torchrun=["true"]), tmp_path / n)
                      for i, n in enumerate(names)])


def test_reach_reports_make_a_cut_once_the_channel_heard_every_host_after_them(tmp_path):
    gang = _gang(tmp_path, ["a", "b", "c"])
    assert gang.cut(lambda host: time.monotonic()) is None  # no report: no cut
    a, b, c = gang.nodes
    c._reached({"unreachable": ["a", "b"], "failing_s": {"a": 2.0, "b": 2.1}})
    a._reached({"unreachable": ["c"], "failing_s": {"c": 2.0}})
    first = min(c.failing_since.values())
    # every host heard after the first failed probe: the cut, its smaller side excluded
    cut = gang.cut(lambda host: first + 0.5)
    assert cut is not None and cut.exclude == ("c",) and cut.keep == ("a", "b")
    # c silent in the channel since before the probes failed (a partitioned or stopped host): not a cut
    assert gang.cut(lambda host: first - 1.0 if host == "c" else first + 0.5) is None
    assert gang.cut(lambda host: None if host == "c" else first + 0.5) is None
    # the cut healed: the agents report empty sets
    c._reached({"unreachable": [], "failing_s": {}})
    a._reached({"unreachable": [], "failing_s": {}})
    assert gang.cut(lambda host: time.monotonic()) is None and c.failing_since == {}


def test_a_peer_still_failing_keeps_its_first_failure_time(tmp_path):
    gang = _gang(tmp_path, ["a", "b"])
    a = gang.nodes[0]
    a._reached({"unreachable": ["b"], "failing_s": {"b": 3.0}})
    since = a.failing_since["b"]
    time.sleep(0.05)
    a._reached({"unreachable": ["b"], "failing_s": {"b": 3.05}})
    assert a.failing_since["b"] == since
