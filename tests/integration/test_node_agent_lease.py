"""The lease is the node agent's stopping rule too: a node whose control plane stops renewing its lease is stopped by
its own agent once the lease lapses, while the runner's connection (the agent's stdin) stays open, as it does for a
control plane that is frozen or cut off from the store. A real node agent, a real sidecar (its publisher's lease:
2 s, never renewed: no control plane writes to this channel) and a stand-in for torchrun that never ends; with a
positive control: the same node with a long lease keeps running.

Run: .venv/bin/python -m pytest tests/integration/test_node_agent_lease.py -q
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainforge.infra.backends.node_agent import NodeProgram

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def start_node(tmp_path: Path, lease_ttl_s: float) -> tuple[subprocess.Popen[str], Path]:
    work = tmp_path / "node"
    pidfile = tmp_path / "torchrun.pid"
    # stands in for torchrun: records its pid and runs until it is stopped
    torchrun = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                "time.sleep(120)"]
    sidecar = [sys.executable, "-m", "trainforge.infra.backends.sidecar", "--store", str(tmp_path / "store"),
               "--root", "teams/t/jobs/lease/channel/segment-0", "--node", "n0", "--socket",
               f"@tf-lease-test-{os.getpid()}", "--flush-interval", "0.2", "--lease-ttl", str(lease_ttl_s)]
    program = NodeProgram(node="n0", work_dir=str(work), torchrun=torchrun, sidecar=sidecar)
    agent = subprocess.Popen([sys.executable, "-m", "trainforge.infra.backends.node_agent"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert agent.stdin is not None
    agent.stdin.write(program.to_line())
    agent.stdin.flush()  # and kept open: the runner's connection never drops
    return agent, pidfile


def started(agent: subprocess.Popen[str]) -> dict:
    assert agent.stdout is not None
    return json.loads(agent.stdout.readline())


def wait_exit(agent: subprocess.Popen[str], timeout_s: float) -> tuple[str, str]:
    """Wait for the agent to end with its stdin still open (communicate() would close it: an end of stdin is a
    stop of its own), then read what it said."""
    deadline = time.monotonic() + timeout_s
    while agent.poll() is None:
        assert time.monotonic() < deadline, f"the agent still runs after {timeout_s:g} s"
        time.sleep(0.1)
    assert agent.stdout is not None and agent.stderr is not None
    return agent.stdout.read(), agent.stderr.read()


def finish(agent: subprocess.Popen[str]) -> None:
    if agent.poll() is None:
        os.killpg(agent.pid, signal.SIGKILL)
    agent.communicate(timeout=30)


def test_a_node_whose_lease_lapses_is_stopped_by_its_agent_with_the_runner_still_connected(tmp_path):
    agent, pidfile = start_node(tmp_path, lease_ttl_s=2.0)
    try:
        assert "started" in started(agent)
        t0 = time.monotonic()
        out, err = wait_exit(agent, 60.0)
        took = time.monotonic() - t0
    finally:
        finish(agent)
    assert "the gang's lease lapsed" in err, err[-3000:]
    assert json.loads(out.splitlines()[-1])["exit"] != 0
    assert took < 2.0 + 15.0  # the lease, then the stop's grace (node_agent.ORPHAN_GRACE_S) and the sidecar's
    torchrun_pid = int(pidfile.read_text())
    assert not Path(f"/proc/{torchrun_pid}").exists()  # torchrun's stand-in was stopped with the node


def test_a_node_whose_lease_holds_keeps_running(tmp_path):
    agent, pidfile = start_node(tmp_path, lease_ttl_s=60.0)
    try:
        assert "started" in started(agent)
        time.sleep(6.0)  # three times the other test's lease
        assert agent.poll() is None
        assert Path(f"/proc/{int(pidfile.read_text())}").exists()
        assert agent.stdin is not None
        agent.stdin.write("stop 1\n")  # and a stop still stops it
        agent.stdin.flush()
        out, err = agent.communicate(timeout=30)
    finally:
        finish(agent)
    assert "lease lapsed" not in err
    assert "exit" in json.loads(out.splitlines()[-1])
