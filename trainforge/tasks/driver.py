"""The one segment-retry loop: segments until the job finishes, each outcome decided by the pure SegmentController.

The train-job flow (flows/train_job.py) and the chaos drills (tasks/chaos.py: `trainforge chaos`, tests/chaos/,
bench/) both drive their segments through `SegmentDriver.drive`; what differs is injected:

- `run(driver)`: one segment. The chaos harness calls `run_segment` directly; the flow submits the `train-segment`
  Prefect task with `retries` = the retry budget left and `retry_condition_fn=driver.retry_condition`, so a failed
  segment is retried as a Prefect task retry (visible in the UI) exactly when the controller says so.
- the `Gang`: how to provision, release and re-provision (the live scheduler in both, or nothing for a chaos job
  on a fixed local gang).

Every attempt starts with `driver.before_attempt()` (inside the Prefect task in the flow), which acts on a retried
failure's decision (re-provision without the lost nodes, or nothing for a retry on the same gang). Clean ends
(boundary, preemption, resize) are acted on in the loop, outside the segment, as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from trainforge._optional import MissingConditionalImportError
from trainforge.contract.controller import Action, Decision, Ended, History, Outcome, SegmentController
from trainforge.registry.jobs import JobRecord, JobStore
from trainforge.tasks.provision import RecoveryTimeout
from trainforge.tasks.segment import SegmentCancelled, SegmentFailed, SegmentResult, health_policy
from trainforge.tasks.supervisor import incident_hosts


class TooManySegments(AssertionError):
    """A drill's `max_segments` guard: the job did not finish (an AssertionError, as the drills always raised)."""


class Gang(Protocol):
    def provision(self, reason: str) -> dict[str, Any] | None:
        """Request the gang (idempotent while it is held: the current, possibly resized, allocation)."""

    def release(self, outcome: str = "ended") -> None:
        """Give the gang back: `stopped` after a preemption (it waits again in its place), else `ended`."""

    def reprovision(self, lost: tuple[str, ...]) -> dict[str, Any] | None:
        """Mark `lost` nodes unhealthy, release the gang and request a new one."""


class NoGang:
    """A fixed local gang (a chaos job of one node, not placed by the scheduler): nothing to provision."""

    def provision(self, reason: str) -> None:
        return None

    def release(self, outcome: str = "ended") -> None:
        return None

    def reprovision(self, lost: tuple[str, ...]) -> None:
        return None


def outcome_of(result: SegmentResult) -> Outcome:
    ended = {"preempted": Ended.PREEMPTED, "resize": Ended.RESIZED}.get(result.reason or "", Ended.COMPLETED)
    return Outcome(ended, result.last_step)


def failure_outcome(record: JobRecord, exc: BaseException) -> Outcome:
    """A failed attempt as the controller sees it; the nodes it lost whole come from `record`'s incidents (a fresh
    copy of the job record: the flow's own copy is updated by its event pump meanwhile)."""
    if isinstance(exc, SegmentCancelled | KeyboardInterrupt) or not isinstance(exc, Exception):
        return Outcome(Ended.CANCELLED, message=str(exc))
    if isinstance(exc, RecoveryTimeout):  # the re-provisioning already waited its bound for a gang
        return Outcome.failed("capacity", message=str(exc)[:500])
    # Anything but a SegmentFailed (a provisioning error, a launch that broke) counts as infrastructure, as the
    # flow's retry condition always treated it; except a missing optional package (no torch for the local ranks):
    # the user's install, which no retry can fix.
    kind = exc.kind if isinstance(exc, SegmentFailed) else \
        "user" if isinstance(exc, MissingConditionalImportError) else "infra"
    rank = exc.rank if isinstance(exc, SegmentFailed) else None
    segments = record.data.get("segments") or [{}]
    attempt = segments[-1].get("attempt")
    lost = tuple(sorted({h for i in record.data.get("incidents", []) if i.get("attempt") == attempt
                         for h in incident_hosts(i)}))
    return Outcome.failed(kind, rank, lost, str(exc)[:500])


class SegmentDriver:
    def __init__(self, record: JobRecord, *, total_steps: int, max_retries: int,
                 run: Callable[[SegmentDriver], SegmentResult], gang: Gang, log: logging.Logger | Any,
                 env: Mapping[str, str] | None = None, max_segments: int | None = None,
                 allocation: dict[str, Any] | None = None):
        policy = health_policy(record, dict(os.environ) | dict(env or {}))  # the rollback budget the workers use
        self.record, self.run, self.gang, self.log = record, run, gang, log
        self.controller = SegmentController(History(total_steps=total_steps, max_retries=max_retries,
                                                    max_rollbacks=policy.max_rollbacks, max_segments=max_segments))
        self.allocation = allocation
        self.results: list[SegmentResult] = []
        self.failures: list[BaseException] = []
        """Every failed attempt's exception, in order (the drills' measurements read them)."""
        self._pending: Decision | None = None

    @property
    def retries_left(self) -> int:
        return self.controller.history.retries_left

    def drive(self) -> list[SegmentResult]:
        """Segments until the controller says finish; raises the failure (or TooManySegments) on give-up."""
        if self.allocation is None:
            self.allocation = self.gang.provision("provisioned")
        while True:
            try:
                result = self.run(self)
            except BaseException as exc:
                decision = self.on_failure(exc)
                if decision.action is not Action.GIVE_UP:
                    continue  # the next attempt's before_attempt acts on it
                if decision.reason != "cancelled":
                    self.log.error("giving up: %s", decision.reason)
                if decision.reason.startswith("job did not finish"):
                    raise TooManySegments(decision.reason) from exc
                raise
            self.results.append(result)
            outcome = outcome_of(result)
            decision = self.controller.decide(outcome)
            self.controller = self.controller.record(outcome, decision)
            if decision.action is Action.FINISH:
                return self.results
            if decision.action is Action.GIVE_UP:
                raise TooManySegments(decision.reason)
            self.log.info("segment ended at step %s (%s); starting the next one", result.last_step, result.reason)
            if decision.action is Action.PREEMPTED:  # emergency checkpoint committed: give the GPUs back, queue again
                self.gang.release("stopped")
            self.allocation = self.gang.provision(decision.reason)

    def before_attempt(self) -> dict[str, Any] | None:
        """Called as each attempt starts: acts on the decision that retries the last failed attempt. Returns the
        allocation this attempt runs on (None: a fixed local gang)."""
        self.controller = self.controller.started()
        decision, self._pending = self._pending, None
        if decision is not None and decision.action is Action.REPROVISION:
            self.allocation = self.gang.reprovision(decision.exclude_nodes)
        return self.allocation

    def on_failure(self, exc: BaseException) -> Decision:
        """The controller's decision on a failed attempt; a retry is booked (and acted on by the next attempt).
        Asking again about the same failure after a give-up gives the same give-up (nothing is booked)."""
        if not any(f is exc for f in self.failures):  # the flow asks twice about a failure Prefect gave up on
            self.failures.append(exc)
        fresh = JobStore(self.record.folder.parent).get(self.record.job_id)
        outcome = failure_outcome(fresh, exc)
        self.controller = self.controller.with_facts(rollbacks=len(fresh.data.get("divergence", [])))
        decision = self.controller.decide(outcome)
        if decision.retries:
            self.controller = self.controller.record(outcome, decision)
            self._pending = decision
            self.log.warning("segment failed (%s): %s", outcome.kind, decision.reason)
        return decision

    def retry_condition(self, task: Any, task_run: Any, state: Any) -> bool:
        """Prefect's `retry_condition_fn` for the train-segment task: retry when the controller says so."""
        try:
            state.result(raise_on_failure=True)
        except BaseException as exc:
            return self.on_failure(exc).retries
        return self.on_failure(RuntimeError(f"segment failed: {state.message}")).retries
