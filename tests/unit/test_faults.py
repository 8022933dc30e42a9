"""Fault-injection parsing and the object-store outage window (the chaos suite's instrument must be exact)."""

from __future__ import annotations

import pytest

from trainforge.infra.storage.local import LocalObjectStore
from trainforge.trainer import faults
from trainforge.trainer.faults import Fault, FaultInjector, StoreOutage, parse_faults


def test_parse_faults_reads_every_parameter():
    assert parse_faults("kill:rank=1:step=25, storeout:rank=0:step=7:until=12,slow:step=3:ms=40,"
                        "raise:step=9:durable=1") == [
        Fault("kill", 1, 25), Fault("storeout", 0, 7, until=12), Fault("slow", 0, 3, ms=40),
        Fault("raise", 0, 9, durable=True)]


def test_a_durable_fault_waits_for_the_checkpoints_in_flight_then_fires_once(tmp_path):
    calls: list[str] = []
    injector = FaultInjector(parse_faults("raise:rank=0:step=3:durable=1"), str(tmp_path / "run"), rank=0)
    injector.maybe_fire(2, settle=lambda: calls.append("settle"))
    assert calls == []  # not the fault's step: no wait
    with pytest.raises(faults.InjectedFault):
        injector.maybe_fire(3, settle=lambda: calls.append("settle"))
    assert calls == ["settle"]
    injector.maybe_fire(3, settle=lambda: calls.append("settle"))  # fired once: the retried run neither waits
    assert calls == ["settle"]


@pytest.mark.parametrize("text", ["boom:step=1", "storeout:rank=0:step=7"])
def test_parse_faults_rejects_unknown_kinds_and_windowless_outages(text):
    with pytest.raises(ValueError):
        parse_faults(text)


def test_parse_faults_reads_a_park_and_refuses_one_without_its_bound():
    assert parse_faults("park:rank=0:step=8:durable=1:s=60") == [Fault("park", 0, 8, s=60.0, durable=True)]
    for unbounded in ("park:rank=0:step=8", "park:rank=0:step=8:s=0"):
        with pytest.raises(ValueError, match="park needs a bound"):
            parse_faults(unbounded)


class _Clock:
    """The faults module's clock for the park: a sleep advances it by what it asks for (no real waiting)."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def time(self) -> float:  # the fault's marker records when it fired
        return self.t


def test_a_durable_park_waits_for_the_commit_then_holds_the_rank_until_its_stop_signal(tmp_path, monkeypatch):
    from trainforge.trainer import health

    clock = _Clock()
    monkeypatch.setattr(faults, "time", clock)
    calls: list[str] = []

    class Monitor:  # the worker's HealthMonitor: its SIGTERM handler sets stop_requested (here at t = 2.5 s)
        @property
        def stop_requested(self) -> bool:
            return clock.t >= 2.5

    monkeypatch.setattr(health, "_CURRENT", Monitor())
    injector = FaultInjector(parse_faults("park:rank=0:step=8:durable=1:s=60"), str(tmp_path / "run"), rank=0)
    injector.maybe_fire(7, settle=lambda: calls.append("settle"))
    assert calls == [] and clock.t == 0  # not the park's step: no wait, no park
    injector.maybe_fire(8, settle=lambda: calls.append(f"settle at {clock.t:g}"))
    assert calls == ["settle at 0"]  # parked only once the step's checkpoint is committed
    assert 2.5 <= clock.t < 2.6  # ... and went on with the step as soon as the stop signal came, not at its bound
    injector.maybe_fire(8, settle=lambda: calls.append("settle"))  # fired once: the retried run neither parks
    assert calls == ["settle at 0"] and clock.t < 2.6


def test_a_park_that_no_stop_signal_ends_fails_loudly_at_its_bound(tmp_path, monkeypatch):
    from trainforge.trainer import health

    clock = _Clock()
    monkeypatch.setattr(faults, "time", clock)
    monkeypatch.setattr(health, "_CURRENT", None)  # no monitor (NullMonitor): no stop signal ever comes
    injector = FaultInjector(parse_faults("park:rank=1:step=3:s=5"), str(tmp_path / "run"), rank=1)
    with pytest.raises(faults.InjectedFault, match="parked for 5s and no stop signal came"):
        injector.maybe_fire(3)
    assert 5 <= clock.t < 5.1
    assert FaultInjector(parse_faults("park:rank=1:step=3:s=5"), str(tmp_path / "run"), rank=0).faults == []


def test_outage_opens_at_the_first_write_and_closes_at_the_until_step(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    injector = FaultInjector(parse_faults("storeout:rank=0:step=2:until=5"), str(tmp_path / "run"), rank=0)
    try:
        injector.maybe_fire(1)
        store.put_bytes("a", b"1")  # before the fault: writes work
        injector.maybe_fire(2)
        with pytest.raises(StoreOutage):
            store.put_bytes("b", b"2")
        assert store.get_bytes("a") == b"1"  # reads work during the outage
        injector.maybe_fire(3)
        with pytest.raises(StoreOutage):
            store.put_bytes("b", b"2")
        injector.maybe_fire(5)
        store.put_bytes("b", b"2")
        assert store.get_bytes("b") == b"2"
    finally:
        faults.end_store_outage()


def test_step_hooks_come_only_from_the_environment_and_nan_waits_for_the_checkpoint_copy(tmp_path, monkeypatch):
    import torch

    from trainforge.trainer.faults import ENV_VAR, FaultHook, step_hooks_from_env

    monkeypatch.delenv(ENV_VAR, raising=False)
    assert step_hooks_from_env(str(tmp_path), rank=0) == []  # production: the loop runs no fault code
    monkeypatch.setenv(ENV_VAR, "nan:rank=0:step=2")
    assert step_hooks_from_env(str(tmp_path), rank=1) == []  # another rank's fault
    (hook,) = step_hooks_from_env(str(tmp_path), rank=0)
    assert isinstance(hook, FaultHook)
    calls: list[str] = []

    class Engine:
        model = torch.nn.Linear(2, 2)

        def wait_for_staging(self) -> None:  # the write below happens outside the optimizer step
            calls.append("wait" if not torch.isnan(self.model.weight).any() else "late")

    engine = Engine()
    hook.before_step(1, engine)
    assert calls == [] and not torch.isnan(engine.model.weight).any()
    hook.before_step(2, engine)
    assert calls == ["wait"] and torch.isnan(engine.model.weight).all()


def test_slow_pct_makes_this_ranks_compute_slower_from_its_step(tmp_path, monkeypatch):
    from trainforge.trainer import faults
    from trainforge.trainer.faults import FaultHook

    assert parse_faults("slow:rank=1:step=4:pct=30") == [Fault("slow", 1, 4, pct=30.0)]

    class Clock:
        """The faults module's clock: compute advances it by fixed amounts, a sleep by what it asks for (the
        ratio is exact, not at the mercy of a loaded host's scheduler)."""

        t = 0.0

        def perf_counter(self):
            return self.t

        def sleep(self, s):
            self.t += s

        def time(self):  # the fault's marker records when it fired
            return self.t

    clock = Clock()
    monkeypatch.setattr(faults, "time", clock)
    monkeypatch.delenv("TRAINFORGE_SEGMENT_ATTEMPT", raising=False)

    class Engine:
        model = None

        def forward_backward(self, inputs, targets):
            clock.t += 0.05
            return 1.0

        def step(self, lr):
            clock.t += 0.02
            return 0.5

    engine = Engine()
    hook = FaultHook(FaultInjector(parse_faults("slow:rank=1:step=4:pct=30"), str(tmp_path), rank=1))

    def timed_step(step):
        hook.before_step(step, engine)
        t0 = clock.t
        assert engine.forward_backward([], []) == 1.0 and engine.step(0.1) == 0.5
        return clock.t - t0

    assert [timed_step(s) for s in range(4)] == pytest.approx([0.07] * 4)
    assert [timed_step(s) for s in range(4, 8)] == pytest.approx([0.091] * 4)  # wrapped once, not once per step
    # slow in every step of this attempt; its marker says which attempt (a retried segment runs at full speed)
    assert (tmp_path / "faults" / "slow-rank1-step4").read_text().split()[0] == "0"
    other = Engine()
    FaultHook(FaultInjector(parse_faults("slow:rank=1:step=0:pct=30"), str(tmp_path), rank=0)).before_step(5, other)
    assert "forward_backward" not in vars(other)  # another rank's fault


def test_a_slow_rank_is_slow_only_in_the_attempt_it_first_slowed_in_unless_always(tmp_path, monkeypatch):
    """A straggler's slowness stays with the device: the retried (re-provisioned) segment runs at full speed, as a
    replaced node would; `always=1` keeps it slow in every attempt."""
    from trainforge.trainer.faults import FaultInjector, fired_at

    once, always = parse_faults("slow:rank=0:step=2:ms=1,slow:rank=0:step=3:ms=1:always=1")
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "0")
    first = FaultInjector([once, always], str(tmp_path), 0)
    assert first.slow_on(once) and first.slow_on(always)
    assert once.marker in fired_at(tmp_path)  # the chaos measurements read when it fired
    assert FaultInjector([once], str(tmp_path), 0).slow_on(once)  # a restart inside the same attempt: still slow
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "1")
    second = FaultInjector([once, always], str(tmp_path), 0)
    assert not second.slow_on(once) and second.slow_on(always)
