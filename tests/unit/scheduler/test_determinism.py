"""The same events give the same decisions in every process. Python randomises the order of a set of strings per
process (PYTHONHASHSEED); the policy once iterated such sets (running jobs per GPU type, preemption victims), so
ties between equal victims broke differently from run to run: `bench/scheduler_latency.py` ended with 344 or 347
jobs running depending on the process. Each policy replays the same random fleet workload in two processes with
different hash seeds, and the decisions must be identical.

Run: .venv/bin/python -m pytest tests/unit/scheduler/test_determinism.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import hashlib, random, sys
from trainforge.infra.scheduler import ClusterState, JobRequest, JobState, Scheduler, SchedulerConfig
from trainforge.infra.simulator.kueue import KueueModel
from trainforge.infra.simulator.las import LasModel
from trainforge.plan.cluster import load_cluster

policy = sys.argv[1]
state = ClusterState.from_spec(load_cluster("examples/clusters/fleet-10k.yaml"))
model = {"kueue": KueueModel, "las": LasModel}.get(policy, Scheduler)
s = model(state, config=SchedulerConfig(policy=policy if policy in ("ours", "fifo", "fifo-backfill") else "fifo"))
rng = random.Random(7)
types = ["a100-40gb", "a100-80gb", "h100", "h200"]
digest = hashlib.sha256()
now = 0.0
for i in range(700):
    n = rng.choice([1, 1, 2, 4, 8, 8, 8, 16, 32, 64, 128, 256, 512])
    s.submit(JobRequest(job_id=f"j{i}", team=f"team-{rng.randrange(6)}", priority=rng.choice(
        ["high", "normal", "normal", "low", "preemptible"]), gpu_type=rng.choice(types), num_gpus=n,
        tp=min(8, n) if n >= 8 else 1, min_gpus=n // 2 if n >= 64 and rng.random() < 0.1 else None,
        max_runtime_s=rng.choice([3600.0, 7200.0]), checkpoint_interval_s=1800.0), now)  # ties on purpose
    if i >= 400:  # the fleet is full by now: completions and stops make room, and passes preempt
        now += 60.0
        busy = [j for j in s.jobs.values() if j.state is not JobState.PENDING]
        victim = busy[rng.randrange(len(busy))]
        if victim.state is JobState.PREEMPTING:
            s.stopped(victim.job_id, now)
        else:
            s.finish(victim.job_id, now)
    if i % 10 == 0 or i >= 400:
        for d in s.schedule(now):
            digest.update(repr(d).encode())
print(digest.hexdigest(), len(s.running()), s.stats["preemptions"])
"""


@pytest.mark.parametrize("policy", ["ours", "fifo-backfill", "kueue", "las"])
def test_two_processes_with_different_hash_seeds_decide_the_same(policy):
    # the two processes run at once (they share nothing): the test takes one replay's time, not two
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, policy], cwd=ROOT,
                              env={**os.environ, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-2000:]
            outs.append(out.split())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert outs[0] == outs[1], f"{policy}: decisions differ between hash seeds ({outs[0][1:]} vs {outs[1][1:]})"
    assert int(outs[0][1]) > 0
