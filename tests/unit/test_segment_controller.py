"""The SegmentController's policy, one row per (outcome, history), plus the whole small product of outcomes x
histories checked against the policy's rules; the driver loop (tasks/driver.py) with scripted segments, as the
flow and the chaos drills use it. Pure and fast (no processes, no Prefect server).

Run: .venv/bin/python -m pytest tests/unit/test_segment_controller.py -q   (under a second)
"""

from __future__ import annotations

import itertools
import logging

import pytest

from trainforge.contract.controller import Action, Ended, History, Outcome, SegmentController

TOTAL = 24


def history(*, used: int = 0, budget: int = 3, rollbacks: int = 0, max_rollbacks: int = 3, attempts: int = 1,
            max_segments: int | None = None, committed: int | None = 16) -> History:
    return History(total_steps=TOTAL, max_retries=budget, max_rollbacks=max_rollbacks, attempts=attempts,
                   retries_used=used, rollbacks=rollbacks, last_committed=committed, max_segments=max_segments)


infra = Outcome.failed("infra", rank=1)
node_lost = Outcome.failed("infra", rank=2, lost_nodes=("node-1", "node-0"))
user = Outcome.failed("user", rank=0)
diverged = Outcome.failed("divergence", rank=0)
no_gang = Outcome.failed("capacity", message="found no gang within fault_tolerance.recovery_wait_s after network cut")

ROWS = [
    # (outcome, history, action, reason contains)
    (Outcome.completed(24), history(), Action.FINISH, "completed at step 24"),
    (Outcome.completed(25), history(), Action.FINISH, "completed"),  # past total (a resumed, longer run)
    (Outcome.completed(12), history(), Action.CONTINUE, "segment boundary"),
    (Outcome.completed(None), history(), Action.CONTINUE, "segment boundary"),  # no segment_end event
    (Outcome(Ended.PREEMPTED, 13), history(), Action.PREEMPTED, "preemption"),
    (Outcome(Ended.PREEMPTED, 24), history(), Action.FINISH, "completed"),  # the notice came at the last step
    (Outcome(Ended.RESIZED, 10, workers=4), history(), Action.RESIZE, "resized"),
    (Outcome(Ended.RESIZED, 24), history(), Action.FINISH, "completed"),
    (infra, history(used=0), Action.REPROVISION, "re-provisioned"),
    (infra, history(used=2), Action.REPROVISION, "re-provisioned"),  # the last retry of the budget
    (infra, history(used=3), Action.GIVE_UP, "retry budget spent"),
    (infra, history(budget=0), Action.GIVE_UP, "retry budget spent"),
    (node_lost, history(), Action.REPROVISION, "lost node-0, node-1"),
    (node_lost, history(used=3), Action.GIVE_UP, "retry budget spent"),
    (diverged, history(rollbacks=1), Action.RETRY, "divergence rollback 1 of 3"),
    (diverged, history(rollbacks=3), Action.RETRY, "rollback 3 of 3"),  # the budget includes this one
    (diverged, history(rollbacks=4), Action.GIVE_UP, "diverged 4 times"),
    (diverged, history(rollbacks=1, used=3), Action.GIVE_UP, "retry budget spent"),  # rollbacks count as retries
    (user, history(), Action.GIVE_UP, "user error (rank 0)"),
    (user, history(budget=100), Action.GIVE_UP, "not retried"),
    # the recovery already waited its bound for a gang: given up at once, naming what it waited for
    (no_gang, history(), Action.GIVE_UP, "no gang to recover on: found no gang within"),
    (no_gang, history(budget=100), Action.GIVE_UP, "network cut"),
    (Outcome(Ended.CANCELLED), history(), Action.GIVE_UP, "cancelled"),
    (Outcome(Ended.CANCELLED), history(used=3), Action.GIVE_UP, "cancelled"),
    # the drills' guard against a job that never finishes
    (Outcome.completed(12), history(attempts=8, max_segments=8), Action.GIVE_UP, "did not finish in 8"),
    (Outcome.completed(24), history(attempts=8, max_segments=8), Action.FINISH, "completed"),
    (infra, history(attempts=8, max_segments=8), Action.GIVE_UP, "did not finish in 8"),
    (infra, history(attempts=8, max_segments=8, used=3), Action.GIVE_UP, "retry budget spent"),
]


@pytest.mark.parametrize(("outcome", "hist", "action", "reason"), ROWS)
def test_decision_table(outcome: Outcome, hist: History, action: Action, reason: str):
    decision = SegmentController(hist).decide(outcome)
    assert decision.action is action
    assert reason in decision.reason


def test_reprovision_excludes_the_lost_nodes_and_resumes_from_the_last_commit():
    decision = SegmentController(history(committed=16)).decide(node_lost)
    assert decision.exclude_nodes == ("node-0", "node-1")
    assert decision.resume_from == 16
    assert SegmentController(history()).decide(infra).exclude_nodes == ()


OUTCOMES = [Outcome.completed(s) for s in (None, 0, 12, 23, 24, 30)] + \
    [Outcome(e, s) for e in (Ended.PREEMPTED, Ended.RESIZED) for s in (None, 13, 24)] + \
    [Outcome.failed(k, 1, lost) for k in ("user", "infra", "divergence", "capacity") for lost in ((), ("n1",))] + \
    [Outcome(Ended.CANCELLED)]
HISTORIES = [history(used=u, budget=b, rollbacks=r, attempts=a, max_segments=m)
             for u, b, r, a, m in itertools.product((0, 1, 2), (0, 2), (0, 3, 4), (1, 8), (None, 8)) if u <= b]


@pytest.mark.parametrize("outcome", OUTCOMES, ids=lambda o: f"{o.ended.value}-{o.last_step}-{o.kind}-{o.lost_nodes}")
def test_the_whole_product_follows_the_rules(outcome: Outcome):
    for h in HISTORIES:
        d = SegmentController(h).decide(outcome)
        failed, clean = outcome.ended is Ended.FAILED, outcome.ended in (Ended.COMPLETED, Ended.PREEMPTED,
                                                                          Ended.RESIZED)
        done = clean and outcome.last_step is not None and outcome.last_step >= TOTAL
        guard = h.max_segments is not None and h.attempts >= h.max_segments
        # finish exactly when a clean end reached total_steps
        assert (d.action is Action.FINISH) == done, (outcome, h, d)
        # a retry only for a retryable failure within every budget, never past them
        retryable = failed and outcome.kind not in ("user", "capacity") and h.retries_used < h.max_retries and not guard and not (
            outcome.kind == "divergence" and h.rollbacks > h.max_rollbacks)
        assert d.retries == retryable, (outcome, h, d)
        if d.retries:
            same_gang = outcome.kind == "divergence" and not outcome.lost_nodes
            assert d.action is (Action.RETRY if same_gang else Action.REPROVISION)
            assert d.exclude_nodes == outcome.lost_nodes
        if outcome.ended is Ended.CANCELLED or (failed and outcome.kind in ("user", "capacity")):
            assert d.action is Action.GIVE_UP
        if clean and not done:
            expected = Action.GIVE_UP if guard else {Ended.COMPLETED: Action.CONTINUE, Ended.PREEMPTED:
                                                     Action.PREEMPTED, Ended.RESIZED: Action.RESIZE}[outcome.ended]
            assert d.action is expected, (outcome, h, d)
        assert d.reason  # every decision says why (a give-up's reason goes to the report)
        assert SegmentController(h).decide(outcome) == d  # decide is pure: asking twice gives the same answer


def test_budget_counts_failures_since_the_last_clean_end():
    """The flow's semantics: each segment's task had max_segment_retries retries; a clean end refills."""
    c = SegmentController(history(used=0, budget=2))
    for _ in range(2):
        c = c.record(infra, c.decide(infra))
    assert c.history.retries_used == 2 and c.decide(infra).action is Action.GIVE_UP
    boundary = Outcome.completed(12)
    c = c.record(boundary, c.decide(boundary))
    assert c.history.retries_used == 0 and c.history.last_committed == 16
    assert c.decide(infra).action is Action.REPROVISION
    # a give-up books nothing: asking again about the same failure gives the same give-up
    spent = SegmentController(history(used=2, budget=2))
    assert spent.record(infra, spent.decide(infra)).history.retries_used == 2


def test_outcomes_reject_impossible_combinations():
    with pytest.raises(ValueError, match="kind must be one of user, infra, divergence"):
        Outcome.failed("oops")
    with pytest.raises(ValueError, match="only a failed segment"):
        Outcome(Ended.COMPLETED, 3, kind="infra")


# ------------------------------------------------------------------------------------------ the driver loop


class _Gang:
    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def provision(self, reason: str) -> dict:
        self.calls.append(("provision", reason))
        return {"workers": 2}

    def release(self, outcome: str = "ended") -> None:
        self.calls.append(("release", outcome))

    def reprovision(self, lost: tuple[str, ...]) -> dict:
        self.calls.append(("reprovision", lost))
        return {"workers": 2}


def _driver(tmp_path, script, max_retries=2, max_segments=None):
    """A SegmentDriver over a real (temporary) job record whose segments are scripted."""
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.driver import SegmentDriver
    from trainforge.tasks.segment import SegmentResult

    store = JobStore(tmp_path / "jobs")
    record = store.create("job-1", name="job", team="t", spec={}, source="-")
    steps = iter(script)

    def run(driver):
        driver.before_attempt()
        item = next(steps)
        segments = record.data.get("segments", [])
        record.update(segments=[*segments, {"attempt": len(segments), "state": "running"}])
        if isinstance(item, BaseException):
            raise item
        return SegmentResult(len(segments), 0, 0.1, item[0], item[1])

    gang = _Gang()
    return SegmentDriver(record, total_steps=TOTAL, max_retries=max_retries, run=run, gang=gang,
                         log=logging.getLogger("test"), max_segments=max_segments), gang


def test_driver_loop_acts_on_each_decision(tmp_path):
    from trainforge.tasks.segment import SegmentFailed

    driver, gang = _driver(tmp_path, [(8, None), (13, "preempted"), SegmentFailed("rank 1 lost", "infra", 1),
                                      (18, "resize"), SegmentFailed("nan", "divergence", 0), (24, None)])
    results = driver.drive()
    assert [r.last_step for r in results] == [8, 13, 18, 24]
    assert gang.calls == [("provision", "provisioned"), ("provision", "segment boundary"), ("release", "stopped"),
                          ("provision", "re-provisioned after a preemption"), ("reprovision", ()),
                          ("provision", "the scheduler resized the allocation")]  # divergence: same gang
    assert [type(f).__name__ for f in driver.failures] == ["SegmentFailed", "SegmentFailed"]


def test_driver_gives_up_with_the_failure_itself(tmp_path):
    from trainforge.tasks.driver import TooManySegments
    from trainforge.tasks.segment import SegmentCancelled, SegmentFailed

    always = [SegmentFailed("rank 1 lost", "infra", 1)] * 3
    driver, gang = _driver(tmp_path, always, max_retries=2)
    with pytest.raises(SegmentFailed, match="rank 1 lost"):
        driver.drive()
    assert [c[0] for c in gang.calls] == ["provision", "reprovision", "reprovision"]
    driver, _ = _driver(tmp_path / "u", [SegmentFailed("user bug", "user", 0)], max_retries=5)
    with pytest.raises(SegmentFailed, match="user bug"):
        driver.drive()
    driver, _ = _driver(tmp_path / "c", [SegmentCancelled("stop")])
    with pytest.raises(SegmentCancelled):
        driver.drive()
    driver, _ = _driver(tmp_path / "m", [(4, None), (8, None)], max_segments=2)
    with pytest.raises(TooManySegments, match="did not finish in 2 segments"):
        driver.drive()
    # anything else than a SegmentFailed counts as infrastructure (retried), as the flow's condition did
    driver, gang = _driver(tmp_path / "x", [RuntimeError("scheduler timeout"), (24, None)])
    assert [r.last_step for r in driver.drive()] == [24]


def test_prefect_retry_condition_asks_the_same_controller(tmp_path):
    """The flow's train-segment retries: Prefect calls retry_condition; a give-up is asked again by the loop."""
    from trainforge.tasks.segment import SegmentFailed

    class State:
        def __init__(self, exc):
            self.exc, self.message = exc, str(exc)

        def result(self, raise_on_failure: bool = True):
            raise self.exc

    driver, gang = _driver(tmp_path, [], max_retries=1)
    driver.allocation = {"workers": 2}
    infra_failure = SegmentFailed("lost", "infra", 1)
    driver.record.update(segments=[{"attempt": 0, "state": "failed"}])
    assert driver.retry_condition(None, None, State(infra_failure)) is True
    assert driver.retries_left == 0
    driver.before_attempt()  # the retried attempt re-provisions first
    assert gang.calls == [("reprovision", ())]
    again = SegmentFailed("lost again", "infra", 1)
    assert driver.retry_condition(None, None, State(again)) is False
    assert driver.on_failure(again).action is Action.GIVE_UP  # the loop's question: the same answer
    assert driver.failures == [infra_failure, again]
    assert driver.retry_condition(None, None, State(SegmentFailed("bug", "user", 0))) is False


# ---------------------------------------------------------------------------- evaluation of committed checkpoints


def _simulate(order: list[tuple[str, int]], limit: int, keep_all: bool):
    """Drive the scheduler through a sequence of ('commit' | 'ready' | 'finish', step) events; return the steps
    started (in order), the skipped ones and the most running at once."""
    from trainforge.contract.evaluation import EvaluationScheduler

    sched = EvaluationScheduler(limit=limit, keep_all=keep_all)
    started, skipped, peak = [], [], 0
    for what, step in order:
        {"commit": sched.committed, "ready": sched.ready, "finish": sched.finished}[what](step)
        plan = sched.take()
        started += plan.start
        skipped += plan.skip
        peak = max(peak, len(sched.running))
    while not sched.idle:  # the drain: every running evaluation finishes
        for step in sorted(sched.running):
            sched.finished(step)
        plan = sched.take()
        started += plan.start
        skipped += plan.skip
    return started, skipped, peak


def test_a_resume_burst_starts_one_evaluation_at_a_time_newest_first():
    burst = [("ready", s) for s in range(8, 8 * 15, 8)]  # 14 committed checkpoints read in one poll
    started, skipped, peak = _simulate(burst, limit=1, keep_all=True)
    assert peak == 1
    assert started[0] == 8  # the first was alone when it became ready
    assert started[1:] == sorted(started[1:], reverse=True)  # then newest first
    assert sorted(started) == list(range(8, 120, 8)) and not skipped  # keep_best: every one is evaluated
    started, skipped, peak = _simulate(burst, limit=1, keep_all=False)
    assert started == [8, 112] and sorted(skipped) == list(range(16, 112, 8)) and peak == 1


@pytest.mark.parametrize("limit", [1, 2, 3])
@pytest.mark.parametrize("keep_all", [False, True])
def test_every_interleaving_of_three_checkpoints(limit: int, keep_all: bool):
    """Exhaustive over the orders in which three checkpoints are committed, made ready and finish evaluating."""
    steps_ = (8, 16, 24)

    def interleavings(chains):  # causal orders: each checkpoint is committed, then ready, then finishes
        if not any(chains):
            yield []
        for i, chain in enumerate(chains):
            if chain:
                rest = [*chains[:i], chain[1:], *chains[i + 1:]]
                yield from ([chain[0], *tail] for tail in interleavings(rest))

    orders = list(interleavings([[(w, s) for w in ("commit", "ready", "finish")] for s in steps_]))
    assert len(orders) == 1680  # 9! / (3! ** 3)
    for order in orders:
        started, skipped, peak = _simulate(order, limit, keep_all)
        assert peak <= limit
        assert len(started) == len(set(started)) and not set(started) & set(skipped)
        assert set(started) | set(skipped) == set(steps_)  # each evaluated or skipped, exactly once
        assert 24 in started  # the newest is never superseded: promotion without keep_best takes it
        if keep_all:
            assert not skipped
        for s in skipped:  # skipped only when something newer was committed before it got a slot
            assert s < 24


def test_awaiting_protects_pending_evaluations_from_retention_only_with_keep_best():
    from trainforge.contract.evaluation import EvaluationScheduler

    ranked = EvaluationScheduler(limit=1, keep_all=True)
    for s in (8, 16, 24):
        ranked.ready(s)
    assert ranked.take().start == (24,)
    assert ranked.awaiting == {8, 16, 24}
    ranked.drop(8)  # retention deleted it anyway (or it was corrupt): never started
    ranked.finished(24)
    assert ranked.take().start == (16,) and ranked.awaiting == {16}
    recency = EvaluationScheduler(limit=1, keep_all=False)
    recency.ready(8)
    recency.take()
    recency.ready(16)
    assert recency.awaiting == {8}  # only the running one
    stopping = EvaluationScheduler(limit=1, keep_all=True)
    for s in (8, 16):
        stopping.ready(s)
    assert stopping.take().start == (16,)
    assert stopping.stop().skip == (8,) and stopping.take().start == ()  # a cancelled job starts no more


def test_concurrency_setting():
    from trainforge.contract.evaluation import EvaluationScheduler, concurrency_from

    assert concurrency_from({}) == 1
    assert concurrency_from({"TRAINFORGE_EVAL_CONCURRENCY": "3"}) == 3
    with pytest.raises(ValueError, match="TRAINFORGE_EVAL_CONCURRENCY='0' is not a positive integer"):
        concurrency_from({"TRAINFORGE_EVAL_CONCURRENCY": "0"})
    with pytest.raises(ValueError, match="is not a positive integer"):
        concurrency_from({"TRAINFORGE_EVAL_CONCURRENCY": "many"})
    with pytest.raises(ValueError, match="must be >= 1"):
        EvaluationScheduler(limit=0)
