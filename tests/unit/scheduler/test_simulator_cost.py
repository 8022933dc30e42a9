"""Cost in the scheduler simulator's report: allocated GPU-seconds are booked per team, GPU type and market; they add
up to the simulator's own busy integral (with preemptions, failures and spot reclaims in the mix); dollars follow
the price table, spot nodes at the spot price; a GPU type without a price is reported, never guessed.

Run: .venv/bin/python -m pytest tests/unit/scheduler/test_simulator_cost.py -q
"""

from __future__ import annotations

import pytest

from trainforge.infra.cost import DEFAULT_PRICES
from trainforge.infra.scheduler.state import NodeInfo
from trainforge.infra.simulator import SimConfig, Simulation, Trace, TraceJob
from trainforge.infra.simulator.report import cost_summary

PRICES = {"h100": {"on_demand": 4.0, "spot": 1.0}}
H100 = DEFAULT_PRICES["h100"]  # the simulator prices with the configured table (no $TRAINFORGE_PRICES in tests)


def nodes(spot_nodes: int = 0, h100: int = 2, other: int = 0) -> list[NodeInfo]:
    out = [NodeInfo(f"h-{i}", "h100", 8, "r0", spot=i < spot_nodes) for i in range(h100)]
    return out + [NodeInfo(f"x-{i}", "mi300x", 8, "r1") for i in range(other)]


def job(i: int, gpus: int, hours: float, team: str = "a", gpu: str = "h100", at: float = 0.0,
        priority: str = "normal") -> TraceJob:
    return TraceJob(job_id=f"j{i}", submit_s=at, team=team, priority=priority, gpu_type=gpu, num_gpus=gpus,
                    duration_s=hours * 3600)


def test_one_job_is_billed_its_gpu_hours():
    sim = Simulation(nodes(), Trace([job(0, 8, 2.0)], "t"), SimConfig())
    report = sim.run()
    assert dict(sim.gpu_seconds) == {("a", "h100", "on_demand"): pytest.approx(8 * 2 * 3600)}
    assert report["cost"]["allocated_gpu_h"] == pytest.approx(16.0)
    assert report["cost"]["by_gpu_type"]["h100"]["usd"] == pytest.approx(16 * H100["on_demand"])
    assert report["cost"]["usd_per_useful_gpu_h"] == pytest.approx(H100["on_demand"])


def test_bookings_add_up_to_the_busy_integral_under_preemption_failures_and_spot():
    trace = Trace([job(i, 8 if i % 3 else 16, 1.0 + (i % 4), team=f"t{i % 3}", at=600.0 * i,
                       priority="preemptible" if i % 5 == 0 else "high" if i % 7 == 0 else "normal")
                   for i in range(30)], "t")
    config = SimConfig(node_mtbf_hours=20.0, repair_s=1800.0, spot_every_s=4 * 3600, spot_fraction=0.5, seed=3)
    sim = Simulation(nodes(spot_nodes=2, h100=4), trace, config)
    report = sim.run()
    assert report["completed"] == 30
    assert report["node_failures"] + report["spot_reclaims"] > 0 and report["preemptions"] + report["requeues"] > 0
    assert sum(sim.gpu_seconds.values()) == pytest.approx(sim.busy_integral, rel=1e-9)
    assert {m for _, _, m in sim.gpu_seconds} == {"spot", "on_demand"}
    cost = report["cost"]
    expected = sum(s / 3600 * H100[m] for (_, _, m), s in sim.gpu_seconds.items())
    assert cost["usd"] == pytest.approx(expected, abs=0.02)
    assert sum(cost["by_team"].values()) == pytest.approx(cost["usd"], abs=0.05)
    assert cost["by_gpu_type"]["h100"]["spot_gpu_h"] > 0


def test_prices_by_market_and_unpriced_types():
    secs = {("a", "h100", "on_demand"): 3600.0 * 10, ("a", "h100", "spot"): 3600.0 * 10,
            ("b", "mi300x", "on_demand"): 3600.0 * 5}
    cost = cost_summary(secs, useful_gpu_s=3600.0 * 20, lost_gpu_s=3600.0 * 2, prices=PRICES)
    assert cost["usd"] == pytest.approx(50.0)  # 10 h x $4 + 10 h x $1; mi300x has no price
    assert cost["by_team"] == {"a": 50.0}
    assert cost["unpriced_gpu_h"] == {"mi300x": 5.0}
    assert cost["allocated_gpu_h"] == 25.0
    assert cost["usd_per_useful_gpu_h"] == pytest.approx(2.5)
    assert cost["lost_usd"] == pytest.approx(2 * 50.0 / 20)  # at the mean priced $/GPU-h


def test_report_renders_cost_and_names_unpriced_types():
    import io

    from rich.console import Console

    from trainforge.infra.simulator.report import render

    sim = Simulation(nodes(h100=1, other=1), Trace([job(0, 8, 1.0), job(1, 8, 1.0, gpu="mi300x")], "t"), SimConfig())
    report = sim.run()
    out = io.StringIO()
    render([report], Console(file=out, width=200))
    text = out.getvalue()
    usd = 8 * H100["on_demand"]  # the h100 job; the mi300x job's 8 GPU-h have no price
    assert "cost $ (per useful GPU-h)" in text and f"{usd:,.0f} (${usd / 16:.2f})" in text
    assert "no price for GPU type(s) mi300x" in text
