"""The node agent (infra/backends/node_agent.py) on this host: whatever ends a segment, nothing of the node's
outlives it. Stand-ins for torchrun and the sidecar are small Python processes that record their pid and block, so
each case checks that real processes are gone, within the stated bounds.

Run: .venv/bin/python -m pytest tests/integration/test_node_agent.py
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

from trainforge.infra.backends.hosts import (
    HostsGang,
    HostUnreachable,
    RemoteNode,
    agent_command,
    runner_command,
)
from trainforge.infra.backends.node_agent import ORPHAN_GRACE_S, SIDECAR_STOP_S, NodeProgram

pytestmark = [pytest.mark.slow, pytest.mark.timing]  # starts Python processes; bounds how soon they are gone

# A stand-in for torchrun: writes its pid and its child's (a "worker", in a session of its own as torchrun 2.13
# starts them, so a signal to the agent's process group does not reach it), then sleeps; exits with $CODE after
# $AFTER s, and ignores SIGTERM when $STUBBORN is set (a torchrun that does not stop its workers in time).
AGENT = """
import os, signal, subprocess, sys, time
work = sys.argv[1]
if os.environ.get("STUBBORN"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(os.path.join(work, "pids"), "w").write(f"{os.getpid()} {child.pid}")
after = float(os.environ.get("AFTER", "600"))
time.sleep(after)
child.kill()
sys.exit(int(os.environ.get("CODE", "0")))
"""
SIDECAR = """
import os, signal, sys, time
open(os.path.join(sys.argv[1], "sidecar-pid"), "w").write(str(os.getpid()))
signal.signal(signal.SIGTERM, lambda *a: (open(os.path.join(sys.argv[1], "sidecar-closed"), "w").close(), sys.exit(0)))
time.sleep(600)
"""


def program(work: Path, node_dir: Path | None = None, **env: str) -> NodeProgram:
    return NodeProgram(node="n1", work_dir=str(work), torchrun=[sys.executable, "-c", AGENT, str(work)],
                       sidecar=[sys.executable, "-c", SIDECAR, str(work)], env=dict(env), config='{"x": 1}',
                       workers=2, node_dir=str(node_dir) if node_dir else None,
                       sweep_after_s=3600.0 if node_dir else None)


def start(work: Path, node_dir: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(agent_command(sys.executable), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(program(work, node_dir, **env).to_line().encode())
    proc.stdin.flush()
    started = json.loads(proc.stdout.readline())
    assert started["started"]["node"] == "n1" and started_all(work)
    return proc


def pids(work: Path) -> list[int]:
    return [*map(int, (work / "pids").read_text().split()), int((work / "sidecar-pid").read_text())]


def started_all(work: Path, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (work / "pids").is_file() and (work / "sidecar-pid").is_file():
            return True
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose (its parent has not reaped it yet)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def gone_within(work: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids(work)):
            return True
        time.sleep(0.05)
    return False


def test_the_agent_reports_its_exit_and_closes_the_sidecar(tmp_path):
    proc = start(tmp_path, AFTER="0.5", CODE="3")
    assert proc.stdout is not None and proc.stdin is not None
    last = json.loads(proc.stdout.readline())  # stdin stays open: the agent ends because its torchrun did
    assert last == {"exit": 3}
    proc.stdin.close()
    assert proc.wait(timeout=10) == 3
    # the stand-in killed its worker itself; the sidecar got its SIGTERM (closing batch) and nothing is left
    assert (tmp_path / "sidecar-closed").is_file() and gone_within(tmp_path, 5)


def test_workers_in_their_own_session_do_not_outlive_a_torchrun_killed_past_its_grace(tmp_path):
    """torchrun ignores the SIGTERM (STUBBORN) and is SIGKILLed after the grace: its worker, in a session of its own,
    re-parents to the agent (the node's subreaper), which kills it before reporting."""
    proc = start(tmp_path, STUBBORN="1")
    assert proc.stdin is not None
    proc.stdin.write(b"stop 0.5\n")
    proc.stdin.flush()
    out, _ = proc.communicate(timeout=30)
    assert json.loads(out.decode().splitlines()[-1]) == {"exit": -signal.SIGKILL}
    assert gone_within(tmp_path, 1)
    assert json.loads((tmp_path / "worker-config.json").read_text()) == {"x": 1}


def test_the_agent_holds_its_node_folder_while_it_runs_and_sweeps_abandoned_ones(tmp_path):
    """The job's end removes a node's folder only once no agent of the job runs there; an agent starting on a host
    removes that node's folders of other jobs nobody used for sweep_after_s (the end a host never saw)."""
    from trainforge.infra.backends.node_folders import JOB_MARK, remove_node

    work_dir = tmp_path / "node-work"
    abandoned, recent = work_dir / "old-job" / "n1", work_dir / "recent-job" / "n1"
    for folder in (abandoned, recent):
        (folder / "inputs").mkdir(parents=True)
        (folder.parent / JOB_MARK).touch()  # made by an agent's `hold`
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))
    segment = work_dir / "job" / "segment-0" / "n1"
    segment.mkdir(parents=True)
    proc = start(segment, node_dir=work_dir / "job" / "n1")
    assert proc.stdin is not None
    assert not abandoned.exists() and (recent / "inputs").is_dir()
    assert remove_node(work_dir, "job", "n1") == "in use"
    assert (work_dir / "job" / "n1").is_dir() and segment.is_dir()
    proc.stdin.write(b"stop 1\n")
    proc.stdin.flush()
    proc.communicate(timeout=30)
    assert remove_node(work_dir, "job", "n1") == "removed"
    assert not (work_dir / "job").exists()


def test_a_stop_line_ends_the_workers_then_the_sidecar(tmp_path):
    proc = start(tmp_path)
    assert proc.stdin is not None
    proc.stdin.write(b"stop 1\n")
    proc.stdin.flush()
    out, _ = proc.communicate(timeout=30)
    assert json.loads(out.decode().splitlines()[-1])["exit"] < 0  # the stand-in died of the SIGTERM
    assert (tmp_path / "sidecar-closed").is_file() and gone_within(tmp_path, 5)


def test_a_control_plane_killed_with_sigkill_leaves_nothing_on_the_node(tmp_path):
    """The launching process dies (SIGKILL): the node's stdin closes, and its agent, workers and sidecar end within
    ORPHAN_GRACE_S + SIDECAR_STOP_S."""
    launcher = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from trainforge.infra.backends.node_agent import NodeProgram
p = subprocess.Popen({agent_command(sys.executable)!r}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
p.stdin.write(NodeProgram.from_line({program(tmp_path).to_line()!r}).to_line().encode()); p.stdin.flush()
time.sleep(600)
"""])
    assert started_all(tmp_path)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=5)
    t0 = time.monotonic()
    assert gone_within(tmp_path, ORPHAN_GRACE_S + SIDECAR_STOP_S + 2)
    assert time.monotonic() - t0 < ORPHAN_GRACE_S + 2  # the stand-ins die of SIGTERM at once: no grace used up


def test_a_host_that_cannot_start_its_agent_stops_the_others_and_is_named(tmp_path):
    ok = RemoteNode("good", "10.0.0.1", agent_command(sys.executable), program(tmp_path / "good"),
                    tmp_path / "runner-good.log")
    bad = RemoteNode("bad", "10.0.0.2", runner_command("sh -c 'sleep 3; {command}' {host}", "bad",
                                                       ["/nonexistent/python", "-m", "x"]),
                     program(tmp_path / "bad"), tmp_path / "runner-bad.log")
    (tmp_path / "good").mkdir()
    gang = HostsGang([ok, bad], start_timeout_s=20)  # the bad host's runner fails after 3 s: the good one is up
    t0 = time.monotonic()
    with pytest.raises(HostUnreachable) as err:
        gang.start()
    assert err.value.host == "bad" and "host bad (10.0.0.2)" in str(err.value)
    assert "/nonexistent/python" in str(err.value)  # what its runner printed
    assert time.monotonic() - t0 < 20
    # the good host's agent was held (inputs fetched, `ready`), never told to go: it started nothing, and ended
    assert ok.ready.is_set() and not (tmp_path / "good" / "pids").exists()
    assert ok.poll() is not None


# ------------------------------------------------------------------------------- inputs first, then all at once

# A stand-in for torchrun that records its words and whether the node's inputs were there when it started.
RECORDER = """
import json, os, sys, time
work, node_dir = sys.argv[1], sys.argv[2]
fetched = os.path.isdir(os.path.join(node_dir, "inputs", "code"))
open(os.path.join(work, "argv.json"), "w").write(json.dumps({"argv": sys.argv, "fetched": fetched}))
time.sleep(600)
"""


def inputs_program(tmp_path: Path, node: str, config: str, first: bool) -> NodeProgram:
    work = tmp_path / node / "segment-0"
    return NodeProgram(node=node, work_dir=str(work),
                       torchrun=[sys.executable, "-c", RECORDER, str(work), str(tmp_path / node),
                                 "--rdzv-endpoint=10.0.0.1:0"],
                       config=config, workers=1, pick_port=first)


def published_config(tmp_path: Path):
    from tests.segment_configs import segment_config
    from tests.unit.test_inputs import code_folder
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.demo import tiny_dataset
    from trainforge.tasks.inputs import publish_inputs

    flow = tmp_path / "flow"
    ds = tiny_dataset(EmbeddedCatalog(flow / "catalog"), "ds-in", num_samples=20, sample_len=9, seed=5)
    (flow / "init.safetensors").write_bytes(os.urandom(1024))
    return publish_inputs(segment_config(storage_url=(tmp_path / "store").as_uri(), code_dir=str(code_folder(flow)),
                                         init_weights=str(flow / "init.safetensors"), run_dir=str(flow / "run"),
                                         dataset={"ref": "catalog://ds-in@main", "name": "ds-in",
                                                  "version": ds.version, "path": str(ds.path)}))


def two_node_gang(tmp_path: Path, config) -> HostsGang:
    """Nodes n0 and n1 on this host, each with its own folder and its copy of the published config."""
    nodes = [RemoteNode(name, f"10.0.0.{i + 1}", agent_command(sys.executable),
                        inputs_program(tmp_path, name, config.for_node(str(tmp_path / name)).dump_json(), i == 0),
                        tmp_path / f"runner-{name}.log") for i, name in enumerate(["n0", "n1"])]
    return HostsGang(nodes, start_timeout_s=30, inputs_timeout_s=60)


def test_every_node_fetches_its_inputs_before_any_torchrun_starts_and_joins_the_first_nodes_port(tmp_path):
    config = published_config(tmp_path)
    gang = two_node_gang(tmp_path, config)
    nodes = gang.nodes
    try:
        gang.start()
        assert all(node.fetching_since is not None and node.ready.is_set() for node in nodes)
        seen = []
        for name in ("n0", "n1"):
            path = tmp_path / name / "segment-0" / "argv.json"
            deadline = time.monotonic() + 20
            while not path.is_file() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen.append(json.loads(path.read_text()))
    finally:
        gang.terminate(grace_s=1.0)
    assert [s["fetched"] for s in seen] == [True, True]  # torchrun started on each node after its fetch
    port = nodes[0].port
    assert port and all(s["argv"][-1] == f"--rdzv-endpoint=10.0.0.1:{port}" for s in seen)
    assert all(node.poll() is not None for node in nodes)


def test_an_input_missing_from_the_store_stops_every_node_before_torchrun_and_blames_no_host(tmp_path):
    from trainforge.infra.backends.hosts import InputsUnavailable
    from trainforge.infra.storage import open_store

    config = published_config(tmp_path)
    assert config.inputs is not None and config.inputs.init_weights is not None
    open_store(config.storage_url).delete(f"{config.storage_prefix}/{config.inputs.init_weights}")
    gang = two_node_gang(tmp_path, config)
    nodes = gang.nodes
    with pytest.raises(InputsUnavailable, match=r"its inputs could not be fetched: .*inputs/init/"):
        gang.start()
    assert not list(tmp_path.glob("n*/segment-0/argv.json"))  # no torchrun anywhere
    assert all(node.poll() is not None for node in nodes)


def test_a_cancel_while_the_nodes_start_stops_them_all_before_torchrun(tmp_path):
    from trainforge.infra.backends.hosts import StartCancelled

    config = published_config(tmp_path)
    gang = two_node_gang(tmp_path, config)
    nodes = gang.nodes
    fetching: list[float] = []

    def cancelled() -> bool:  # the job is cancelled once a node is fetching
        if not fetching and any(node.fetching_since for node in nodes):
            fetching.append(time.monotonic())
        return bool(fetching)

    with pytest.raises(StartCancelled):
        gang.start(should_stop=cancelled)
    assert time.monotonic() - fetching[0] < 5.0  # stopped at once: a fetching or held agent exits on the stop
    assert not list(tmp_path.glob("n*/segment-0/argv.json"))  # no torchrun anywhere
    assert all(node.poll() is not None for node in nodes)
