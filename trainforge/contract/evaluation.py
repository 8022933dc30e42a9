"""Which committed checkpoints to evaluate, and when: bounded concurrency, newest first. Pure (no I/O).

Every committed checkpoint gets its commit bookkeeping (verification, catalog entry, lineage) at once; only the
held-out evaluation, an offline process per checkpoint, is scheduled here: at most `limit` at a time per job
(default 1: on a resume a burst of checkpoint events used to start one process per checkpoint at once, 14 of them on
2 cores), the newest ready checkpoint first.

A checkpoint superseded while it waits (a newer one was committed) is skipped, unless retention or promotion needs
its metric: with `checkpoint.keep_best` retention keeps the best by that metric and promotion takes the best
(tasks/checkpoints.py `best_step`), so any kept checkpoint may be the one, and every checkpoint is evaluated
(`keep_all`); while it waits it is protected from retention (`awaiting`), so it is not deleted for lacking the
metric that would have kept it. Without keep_best, retention keeps by recency (`keep_last`, `keep_every`) and
promotion takes the newest, which is never superseded: the older ones' evaluations would only be numbers in MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_CONCURRENCY = 1
CONCURRENCY_ENV = "TRAINFORGE_EVAL_CONCURRENCY"
"""The control plane host's setting (not the job's: the evaluation processes run on the flow's host)."""


def concurrency_from(environ: Mapping[str, str]) -> int:
    """$TRAINFORGE_EVAL_CONCURRENCY, default 1; a value that is not a positive integer is an error naming it."""
    raw = environ.get(CONCURRENCY_ENV, "").strip()
    if not raw:
        return DEFAULT_CONCURRENCY
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CONCURRENCY_ENV}={raw!r} is not a positive integer: set it to the number of checkpoint "
                         f"evaluations a job may run at once (default {DEFAULT_CONCURRENCY})")
    return value


@dataclass(frozen=True, slots=True)
class Plan:
    start: tuple[int, ...] = ()
    """Evaluate these now (newest first)."""
    skip: tuple[int, ...] = ()
    """Superseded while waiting and not needed: book them without an evaluation."""


@dataclass
class EvaluationScheduler:
    limit: int = DEFAULT_CONCURRENCY
    keep_all: bool = False
    """Retention / promotion rank by an evaluated metric (keep_best): evaluate every checkpoint, skip none."""
    newest: int | None = None
    """The newest checkpoint the workers committed (its bookkeeping may still run)."""
    waiting: set[int] = field(default_factory=set)
    running: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"evaluation concurrency must be >= 1 (got {self.limit})")

    def committed(self, step: int) -> None:
        """The workers committed `step` (a `checkpoint` event): it supersedes every older one."""
        self.newest = step if self.newest is None else max(self.newest, step)

    def ready(self, step: int) -> None:
        """`step`'s commit bookkeeping succeeded: it may be evaluated."""
        self.committed(step)
        self.waiting.add(step)

    def finished(self, step: int) -> None:
        self.running.discard(step)

    def drop(self, step: int) -> None:
        """`step` is gone (retention deleted it, or it is corrupt): never evaluate it."""
        self.waiting.discard(step)
        self.running.discard(step)

    @property
    def awaiting(self) -> set[int]:
        """Steps retention must keep for now: their evaluation is pending and their metric may keep them."""
        return (self.waiting | self.running) if self.keep_all else set(self.running)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def stop(self) -> Plan:
        """The job ended early (failed, cancelled): evaluations not started are skipped, none start."""
        skip = tuple(sorted(self.waiting, reverse=True))
        self.waiting.clear()
        return Plan((), skip)

    def take(self) -> Plan:
        """What to start and what to skip now; the started ones move to `running`."""
        skip: list[int] = []
        if not self.keep_all and self.newest is not None:
            skip = sorted((s for s in self.waiting if s < self.newest), reverse=True)
            self.waiting.difference_update(skip)
        free = self.limit - len(self.running)
        start = sorted(self.waiting, reverse=True)[: max(0, free)]
        self.waiting.difference_update(start)
        self.running.update(start)
        return Plan(tuple(start), tuple(skip))
