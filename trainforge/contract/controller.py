"""The control side's segment policy: (outcome of the segment that just ended, history) -> what to do next.

Pure: no I/O, no Prefect, no torch. The train-job flow and the chaos drills (`trainforge chaos`, tests/chaos/) drive
segments through the same driver (`trainforge/tasks/driver.py`), which asks this controller after every segment, so
the drills test the production policy and not a copy of it.

The policy, as the flow ran it before the controller existed (and where the chaos harness's copy differed, which
one is kept and why):

- completed at step >= total_steps: `finish`.
- ended before total_steps at a segment boundary (`segment_max_steps`, or no reason): `continue` on the current gang
  (the scheduler may have grown an elastic job meanwhile: the driver asks it again, idempotently).
- preempted (emergency checkpoint committed): `preempted`: give the GPUs back and queue again.
- resized by the scheduler: `resize`: take the new size.
- failed, kind `user` (a bug in the user's code, or divergence past `max_rollbacks`, which the segment reports as
  `user`): `give_up` at once, whatever the budget.
- failed, kind `infra`: `reprovision` (a fresh gang without the nodes the attempt lost) while the retry budget
  lasts, else `give_up`.
- failed, kind `divergence`: `retry` on the same gang from the last good checkpoint while both the retry budget and
  the rollback budget last (`reprovision` if the attempt also lost a node). (Before, the flow re-provisioned after a divergence too; a rollback is numerical, the
  hardware is fine, so releasing the gang only risked losing its slots to another job.)
- failed, kind `capacity` (the re-provisioning waited `recovery_wait_s` for a gang without the lost hosts and
  got none): `give_up`, naming what it waited for.
- cancelled: `give_up` (reason `cancelled`; the caller re-raises the cancellation).
- `max_segments` (drills only, a guard against a job that never finishes): `give_up` past it.

The retry budget (`fault_tolerance.max_segment_retries`) counts the failed attempts since the last segment that
ended cleanly (completed, boundary, preempted, resized). That is the flow's behaviour (each segment was one Prefect
task with `retries=max_segment_retries`); the chaos harness counted failures over the whole job instead. The flow's
is kept: it is production's, and a long job cut into many segments should not die of three unrelated faults weeks
apart. A resumed job starts a fresh history, as before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace


class Ended(enum.Enum):
    """How a segment ended (the outcome's kind)."""

    COMPLETED = "completed"
    """The gang exited cleanly; `last_step` says how far it got (a segment boundary if short of total_steps)."""
    PREEMPTED = "preempted"
    """A termination notice: the emergency checkpoint was committed."""
    RESIZED = "resized"
    """The scheduler grew or shrank the elastic gang: emergency checkpoint, then the new size."""
    FAILED = "failed"
    CANCELLED = "cancelled"


FAILURE_KINDS = ("user", "infra", "divergence", "capacity")


@dataclass(frozen=True, slots=True)
class Outcome:
    """The segment that just ended, as the controller needs it."""

    ended: Ended
    last_step: int | None = None
    """The step the segment ended at (its `segment_end` event); None when it ended without one."""
    kind: str | None = None
    """FAILED only: `user`, `infra` or `divergence` (tasks/segment.py SegmentFailed.kind), or `capacity`: the
    recovery found no gang within its wait (`fault_tolerance.recovery_wait_s`)."""
    rank: int | None = None
    lost_nodes: tuple[str, ...] = ()
    """FAILED only: the nodes the attempt lost whole (the re-provisioned gang avoids them)."""
    workers: int | None = None
    """RESIZED only: the size the scheduler moved the gang to, when known."""
    message: str = ""

    def __post_init__(self) -> None:
        if self.ended is Ended.FAILED and self.kind not in FAILURE_KINDS:
            raise ValueError(f"a failed segment's kind must be one of {', '.join(FAILURE_KINDS)} (got {self.kind!r})")
        if self.ended is not Ended.FAILED and (self.kind is not None or self.lost_nodes):
            raise ValueError(f"only a failed segment has a failure kind / lost nodes (ended {self.ended.value})")

    @staticmethod
    def completed(step: int | None) -> Outcome:
        return Outcome(Ended.COMPLETED, step)

    @staticmethod
    def failed(kind: str, rank: int | None = None, lost_nodes: tuple[str, ...] = (), message: str = "") -> Outcome:
        return Outcome(Ended.FAILED, kind=kind, rank=rank, lost_nodes=tuple(sorted(lost_nodes)), message=message)


@dataclass(frozen=True, slots=True)
class History:
    """What the job has been through in this run of the driver."""

    total_steps: int
    max_retries: int
    """`fault_tolerance.max_segment_retries`."""
    max_rollbacks: int
    """The health policy's divergence rollback budget (trainer/health.py `max_rollbacks`)."""
    attempts: int = 0
    """Segments launched so far (every attempt: completed, failed, preempted...)."""
    retries_used: int = 0
    """Failed attempts retried since the last segment that ended cleanly."""
    rollbacks: int = 0
    """Divergence rollbacks of the job so far (the job record's `divergence` list, this one included)."""
    last_committed: int | None = None
    """The newest committed checkpoint's step (where a retry resumes)."""
    max_segments: int | None = None
    """A guard for drills: give up after this many segments. None in production."""

    @property
    def retries_left(self) -> int:
        return max(0, self.max_retries - self.retries_used)


class Action(enum.Enum):
    RETRY = "retry"
    """Same gang, resume from the last committed checkpoint."""
    REPROVISION = "reprovision"
    """Release the gang, mark the lost nodes unhealthy, request a new gang; resume from the last committed."""
    RESIZE = "resize"
    """Take the scheduler's new size (no release: the scheduler already moved the allocation)."""
    PREEMPTED = "preempted"
    """Release the GPUs and queue for them again."""
    CONTINUE = "continue"
    """A segment boundary: the next segment on the current gang (asked for again: it may have grown)."""
    FINISH = "finish"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    """Why, in words: the provisioning reason in the job record, or the give-up reason for the report."""
    exclude_nodes: tuple[str, ...] = ()
    """REPROVISION: nodes the new gang must not use."""
    resume_from: int | None = None

    @property
    def retries(self) -> bool:
        """A failed attempt that is run again (counts against the retry budget)."""
        return self.action in (Action.RETRY, Action.REPROVISION)


@dataclass(frozen=True)
class SegmentController:
    """The pure policy (see the module docstring); `decide` never mutates, `record` advances the history."""

    history: History
    decisions: tuple[Decision, ...] = field(default=())

    def decide(self, outcome: Outcome) -> Decision:
        h = self.history
        resume = h.last_committed
        if outcome.ended is Ended.CANCELLED:
            return Decision(Action.GIVE_UP, "cancelled")
        if outcome.ended is Ended.FAILED:
            if outcome.kind == "user":
                return Decision(Action.GIVE_UP, f"user error (rank {outcome.rank}): not retried")
            if outcome.kind == "capacity":  # it already waited its bound: another retry would only wait again
                return Decision(Action.GIVE_UP, f"no gang to recover on: {outcome.message}")
            if outcome.kind == "divergence" and h.rollbacks > h.max_rollbacks:
                return Decision(Action.GIVE_UP, f"training diverged {h.rollbacks} times (max_rollbacks "
                                                f"{h.max_rollbacks})")
            if h.retries_used >= h.max_retries:
                return Decision(Action.GIVE_UP, f"retry budget spent: {h.retries_used} of max_segment_retries "
                                                f"{h.max_retries} used, last failure {outcome.kind} (rank "
                                                f"{outcome.rank})")
            if h.max_segments is not None and h.attempts >= h.max_segments:
                return Decision(Action.GIVE_UP, f"job did not finish in {h.max_segments} segments")
            retry = h.retries_used + 1
            if outcome.kind == "divergence" and not outcome.lost_nodes:
                return Decision(Action.RETRY, f"divergence rollback {h.rollbacks} of {h.max_rollbacks}: retry "
                                              f"{retry} of {h.max_retries} on the same gang", resume_from=resume)
            lost = f" (lost {', '.join(outcome.lost_nodes)})" if outcome.lost_nodes else ""
            return Decision(Action.REPROVISION, f"re-provisioned after segment {h.attempts - 1} failed{lost}",
                            exclude_nodes=outcome.lost_nodes, resume_from=resume)
        if outcome.last_step is not None and outcome.last_step >= h.total_steps:
            return Decision(Action.FINISH, f"completed at step {outcome.last_step}")
        if h.max_segments is not None and h.attempts >= h.max_segments:
            return Decision(Action.GIVE_UP, f"job did not finish in {h.max_segments} segments")
        if outcome.ended is Ended.PREEMPTED:
            return Decision(Action.PREEMPTED, "re-provisioned after a preemption", resume_from=outcome.last_step)
        if outcome.ended is Ended.RESIZED:
            return Decision(Action.RESIZE, "the scheduler resized the allocation", resume_from=outcome.last_step)
        return Decision(Action.CONTINUE, "segment boundary", resume_from=outcome.last_step)

    def record(self, outcome: Outcome, decision: Decision) -> SegmentController:
        """The controller after `decision` was acted on: a retried failure uses one retry; a clean end refills the
        budget (the flow's per-segment budget, see the module docstring)."""
        h = self.history
        clean = outcome.ended in (Ended.COMPLETED, Ended.PREEMPTED, Ended.RESIZED)
        committed = h.last_committed
        if clean and outcome.last_step is not None:
            committed = outcome.last_step if committed is None else max(committed, outcome.last_step)
        h = replace(h, retries_used=0 if clean else h.retries_used + (1 if decision.retries else 0),
                    last_committed=committed)
        return replace(self, history=h, decisions=(*self.decisions, decision))

    def started(self) -> SegmentController:
        """One more segment launched."""
        return replace(self, history=replace(self.history, attempts=self.history.attempts + 1))

    def with_facts(self, *, rollbacks: int | None = None, last_committed: int | None = None) -> SegmentController:
        """Facts the driver reads from the job record (divergence rollbacks, newest committed checkpoint)."""
        h = self.history
        return replace(self, history=replace(
            h, rollbacks=h.rollbacks if rollbacks is None else rollbacks,
            last_committed=h.last_committed if last_committed is None else last_committed))
