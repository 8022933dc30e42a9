"""Pure parts of fault detection, fast: the health policy, the divergence detector (NaN, robust z-score spikes),
naming the hung rank from faulthandler dumps, and the per-segment sample skip list of a divergence rollback.

Run: .venv/bin/python -m pytest tests/chaos/test_policy.py -q   (under a second)
"""

from __future__ import annotations

import math

import pytest

from trainforge.datasets.sampler import SampleOrder
from trainforge.tasks.supervisor import main_thread_frames, name_culprit
from trainforge.trainer.faults import parse_faults
from trainforge.trainer.health import DivergenceDetector, HealthPolicy, collective_timeout_for, robust_z


def test_policy_validates_and_reads_env_overrides():
    with pytest.raises(ValueError, match="divergence_action"):
        HealthPolicy(divergence_action="ignore")
    with pytest.raises(ValueError, match="unknown health policy fields"):
        HealthPolicy.from_dict({"heartbeat_timout_s": 3})
    p = HealthPolicy().with_env({"TRAINFORGE_HEALTH": '{"hang_timeout_s": 4}'})
    assert p.hang_timeout(0.1) == 4
    assert HealthPolicy().hang_timeout(0.1) == 15.0 and HealthPolicy().hang_timeout(3.0) == 30.0


def test_collective_timeout_comes_from_the_step_time_never_30_minutes():
    assert collective_timeout_for(0.1) == 30.0
    assert collective_timeout_for(5.0) == 100.0
    assert collective_timeout_for(1000.0) == 600.0
    assert collective_timeout_for(None) == 120.0


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_loss_or_grad_is_divergence(value):
    assert "loss is" in DivergenceDetector().observe(value)
    assert "gradient norm" in DivergenceDetector().observe(2.0, value)


def test_spike_needs_a_robust_outlier_and_a_real_jump():
    d = DivergenceDetector(window=32, min_window=16, z_threshold=10, min_rel=0.5)
    noisy = [3.0 + 0.05 * ((i * 7) % 5 - 2) for i in range(20)]
    assert all(d.observe(x) is None for x in noisy)
    assert d.observe(3.4) is None  # noise-level wobble: not a spike
    assert "loss spike" in d.observe(9.0)
    assert 9.0 not in d.history  # spikes stay out of the reference window
    assert robust_z(3.0, [3.0] * 10) == 0.0


DUMP = '''Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f00 (most recent call first):
  File "/work/main/trainforge/trainer/faults.py", line 105 in _fire
  File "/work/main/trainforge/trainer/faults.py", line 93 in maybe_fire
  File "/work/main/trainforge/trainer/loop.py", line 161 in train
  File "/work/main/trainforge/trainer/worker.py", line 130 in main
  File "<frozen runpy>", line 88 in _run_code
'''
WAITING = '''Current thread 0x00007f00 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 829 in _engine_run_backward
  File "/work/main/trainforge/trainer/parallel/parallelize.py", line 95 in forward_backward
  File "/work/main/trainforge/trainer/worker.py", line 130 in main
  File "<frozen runpy>", line 88 in _run_code
'''


def test_the_rank_not_waiting_in_a_collective_is_named_with_its_line():
    stacks = {0: main_thread_frames(WAITING), 1: main_thread_frames(DUMP)}
    assert stacks[1][0] == "/work/main/trainforge/trainer/faults.py:105 in _fire"
    beats = {0: {"steps_done": 6}, 1: {"steps_done": 6}}
    assert name_culprit(stacks, beats) == (1, "/work/main/trainforge/trainer/faults.py:105 in _fire")
    # every rank inside torch (a collective deadlock): the rank furthest behind
    both = {0: stacks[0], 1: stacks[0]}
    assert name_culprit(both, {0: {"steps_done": 7}, 1: {"steps_done": 6}})[0] == 1


def test_skip_list_changes_only_the_stream_after_the_skipped_batch():
    order = SampleOrder(1000, 0.02, "v1", 7)
    bad = order.global_indices(12 * 8, 8)
    skipped = order.with_skip(bad)
    assert skipped.global_indices(0, 12 * 8) == order.global_indices(0, 12 * 8)  # the replay before is exact
    assert not set(skipped.global_indices(12 * 8, 8)) & set(bad)


def test_fault_spec_parses_every_kind():
    faults = parse_faults("kill:rank=1:step=3:always=1,slow:rank=0:step=2:ms=300,nan:step=4")
    assert [(f.kind, f.rank, f.step, f.always, f.ms) for f in faults] == [
        ("kill", 1, 3, True, 0), ("slow", 0, 2, False, 300), ("nan", 0, 4, False, 0)]
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("explode:step=1")


def test_start_up_and_the_first_step_are_judged_on_the_start_up_budget(tmp_path):
    """A starting rank's beat thread stops while `import torch` holds the GIL, and the first step carries the
    start-up work (data loader, first connections): neither is a lost or hung rank. Once a step is done, the
    heartbeat and hang windows apply. Driven through a real local channel (tests/local_channel.py); a lost rank
    that is still alive is killed with the `kill_rank` command to its node."""
    import time

    from tests.local_channel import LocalChannel
    from trainforge.contract.events import Heartbeat
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.supervisor import RankBeat

    record = JobStore(tmp_path / "jobs").create("warm-up", name="w", team="t", spec={}, source="x")
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record, policy=HealthPolicy(heartbeat_timeout_s=3.0, hang_timeout_s=4.0))

        def beats(age_s: float, **fields) -> dict[int, RankBeat]:
            return {r: RankBeat(Heartbeat(rank=r, pid=1000 + r, **{"restart": 0, "steps_done": 0, **fields}),
                                "node-0", None, age_s) for r in (0, 1)}

        now = time.time()
        sup._check_liveness(beats(10.0, phase="starting"), now)
        first = beats(0.0, phase="training", step=0)
        sup._check_progress(first, now)
        sup._check_progress(first, now + 60)  # 60 s in the first step: under the 300 s start-up budget
        sup._check_liveness(beats(10.0, phase="training", step=0), now + 10)  # the first step's lazy imports
        sup._check_liveness(beats(10.0, phase="closing", step=0, steps_done=5), now + 10)
        assert not sup.incidents
        sup._check_liveness(beats(10.0, phase="training", step=1, steps_done=1), now + 10)  # a lost rank
        assert [(i.kind, i.rank) for i in sup.incidents] == [("rank_lost", 0), ("rank_lost", 1)]
        deadline = time.monotonic() + 10
        while len(channel.sent()) < 2:
            assert time.monotonic() < deadline, channel.sent()
            time.sleep(0.05)
        assert sorted((c.kind, c.args.get("rank")) for c in channel.sent()) == [("kill_rank", 0), ("kill_rank", 1)]
    finally:
        channel.close()
