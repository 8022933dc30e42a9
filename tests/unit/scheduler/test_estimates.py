"""Runtime estimates without an oracle (`infra/scheduler/estimates.py`): the user's max_runtime is a limit never
exceeded, history narrows it, the most similar jobs with enough runs decide, and the simulator learns as jobs end.

Run: .venv/bin/python -m pytest tests/unit/scheduler/test_estimates.py -q
"""

from __future__ import annotations

import pytest

from trainforge.infra.scheduler.estimates import RuntimeHistory
from trainforge.infra.scheduler.state import NodeInfo
from trainforge.infra.simulator import SimConfig, Simulation, Trace, TraceJob


def test_nothing_known_gives_the_default_or_the_users_limit():
    h = RuntimeHistory(default_s=7200)
    assert h.estimate(team="a", user="u", num_gpus=8) == 7200
    assert h.estimate(team="a", user="u", num_gpus=8, max_runtime_s=3600) == 3600


def test_the_most_similar_jobs_with_enough_runs_decide_and_the_limit_caps_them():
    h = RuntimeHistory(min_samples=3, quantile=0.9)
    for r in (100, 200, 300):
        h.observe(team="a", user="u", num_gpus=8, runtime_s=r)
    for r in (5000, 6000, 7000):
        h.observe(team="a", user="v", num_gpus=1, runtime_s=r)
    assert h.estimate(team="a", user="u", num_gpus=8) == 300  # u's 8-GPU jobs
    assert h.estimate(team="a", user="u", num_gpus=4) == 300  # u's jobs of any size (only two sizes known)
    assert h.estimate(team="a", user="w", num_gpus=1) == 7000  # the team's 1-GPU jobs (v's)
    assert h.estimate(team="b", user="x", num_gpus=64) == 7000  # everyone's
    assert h.estimate(team="a", user="u", num_gpus=8, max_runtime_s=250) == 250
    with pytest.raises(ValueError, match="unknown estimates"):
        SimConfig(estimates="psychic")


def test_the_simulator_learns_runtimes_as_jobs_end_and_never_sees_the_future():
    jobs = [TraceJob(job_id=f"j{i}", submit_s=i * 1000.0, team="a", user="u", priority="normal", gpu_type="h100",
                     num_gpus=8, duration_s=600.0) for i in range(5)]
    sim = Simulation([NodeInfo("n0", "h100", 8, "r0")], Trace(jobs, "t"), SimConfig(estimates="history"))
    seen: list[float] = []
    submit = sim.sched.submit
    sim.sched.submit = lambda req, now: (seen.append(req.max_runtime_s), submit(req, now))[1]
    sim.run()
    assert seen == [4 * 3600.0, 4 * 3600.0, 4 * 3600.0, 600.0, 600.0]  # the default until 3 runs have ended
    assert any("learned" in n for n in sim.trace.notes)
    oracle = Simulation([NodeInfo("n0", "h100", 8, "r0")], Trace(jobs, "t"), SimConfig(estimates="oracle"))
    assert any("ORACLE" in n for n in oracle.trace.notes)
