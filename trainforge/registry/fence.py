"""The job's fence: one object, `{job}/checkpoints/fence.json`, that says which segment attempt may commit checkpoints, enforced
by the store's conditional overwrite (If-Match on the fence's ETag), not by a check read before a plain write.

- The control plane advances it whenever it starts a new attempt (`advance_attempt`, a compare-and-swap).
- A gang's rank 0 commits a checkpoint by adding the step to the fence with If-Match on the ETag it read, and only
  then writes the manifest (`commit`). An older attempt's rank 0, paused or cut off after its read, gets the
  store's 412 when the control plane advanced the fence meanwhile: it writes no manifest.
- An older attempt could have passed the fence just before the advance and still be about to write its manifest.
  So the advance revokes every step the fence accepted whose manifest is not in the store yet: a manifest that
  lands there later is never visible to a resume or a listing (registry/manifest.py filters by `visible`).
The fence also carries a controller epoch, for control planes that take a job over (the next issue's).
Pure I/O on the ObjectStore interface (its conditional overwrite: infra/storage/base.py ConditionalObjectStore).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from trainforge.infra.storage.base import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStore,
)

logger = logging.getLogger(__name__)

FENCE = "fence.json"
FORMAT = "trainforge-fence/1"
TRIES = 50  # compare-and-swap rounds before giving up (each loses only to another writer's success)


class StaleAttemptError(RuntimeError):
    """This attempt is not the fence's: its commit is refused. `status` is the store's HTTP status when the store
    itself refused the write (412), None when the fence read already named a newer attempt."""

    def __init__(self, message: str, *, attempt: int, fenced_at: int | None, status: int | None = None):
        super().__init__(message)
        self.attempt, self.fenced_at, self.status = attempt, fenced_at, status


@dataclass(frozen=True)
class Fence:
    attempt: int
    controller: int = 0
    commits: dict[int, int] = field(default_factory=dict)
    """step -> the attempt whose commit of it the fence accepted"""
    revoked: frozenset[int] = frozenset()
    """steps an older attempt was accepted for but had not written the manifest of when a newer attempt began"""
    etag: str = ""

    def body(self) -> bytes:
        return json.dumps({"format": FORMAT, "attempt": self.attempt, "controller": self.controller,
                           "commits": {str(s): a for s, a in sorted(self.commits.items())},
                           "revoked": sorted(self.revoked)}, indent=1).encode()

    @classmethod
    def parse(cls, data: bytes, etag: str) -> Fence:
        raw: dict[str, Any] = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ValueError(f"not a trainforge fence (format {raw.get('format')!r})")
        return cls(int(raw["attempt"]), int(raw.get("controller", 0)),
                   {int(s): int(a) for s, a in raw.get("commits", {}).items()},
                   frozenset(int(s) for s in raw.get("revoked", ())), etag)

    def visible(self, step: int, manifest_attempt: int | None = None) -> bool:
        """Whether a manifest at `step` counts as committed: not revoked, and (when the manifest names its attempt
        and the fence accepted the step) written by the attempt the fence accepted."""
        if step in self.revoked:
            return False
        accepted = self.commits.get(step)
        return accepted is None or manifest_attempt is None or manifest_attempt == accepted


def fence_key(job_prefix: str) -> str:
    """Beside the checkpoints it guards: a job's workers may write there (infra/storage/iam.py WRITABLE)."""
    return f"{job_prefix}/checkpoints/{FENCE}"


def read_fence(store: ObjectStore, job_prefix: str) -> Fence | None:
    """The job's fence, or None for a job that never had one (then every manifest counts)."""
    try:
        data, etag = store.get_with_etag(fence_key(job_prefix))  # type: ignore[attr-defined]
    except ObjectNotFoundError:
        return None
    return Fence.parse(data, etag)


def _create(store: ObjectStore, job_prefix: str, fence: Fence) -> bool:
    try:
        store.put_bytes(fence_key(job_prefix), fence.body(), if_none_match=True)
        return True
    except ObjectExistsError:
        return False


def advance_attempt(store: ObjectStore, job_prefix: str, attempt: int,
                    manifest_steps: Callable[[], Iterable[int]]) -> Fence:
    """Make `attempt` the fence's (the control plane, before it starts the attempt's gang): from then on an older
    attempt's commit is refused by the store. Steps the fence accepted but whose manifest (`manifest_steps()`:
    the steps with a manifest in the store now) is not there yet are revoked. Raises StaleAttemptError when the
    fence is already at `attempt` or later (another control plane started it)."""
    for _ in range(TRIES):
        current = read_fence(store, job_prefix)
        if current is None:
            if _create(store, job_prefix, Fence(attempt)):
                return read_fence(store, job_prefix) or Fence(attempt)
            continue
        if current.attempt >= attempt:
            raise StaleAttemptError(f"the job's fence is at attempt {current.attempt}; attempt {attempt} is not newer "
                                    "(another control plane started it)", attempt=attempt, fenced_at=current.attempt)
        present = set(manifest_steps())
        unwritten = {s for s in current.commits if s not in present}
        new = replace(current, attempt=attempt, revoked=current.revoked | unwritten,
                      commits={s: a for s, a in current.commits.items() if s in present})
        try:
            store.put_bytes(fence_key(job_prefix), new.body(), if_match=current.etag)
        except ObjectChangedError:
            continue  # an old attempt's commit (or another writer) won the round: read again
        if unwritten:
            logger.warning("attempt %d fenced: steps %s were accepted for an older attempt whose manifest never "
                           "arrived; a manifest that lands there later is not a checkpoint", attempt, sorted(unwritten))
        return read_fence(store, job_prefix) or new
    raise RuntimeError(f"could not advance the fence of {job_prefix} to attempt {attempt} in {TRIES} tries")


def commit(store: ObjectStore, job_prefix: str, step: int, attempt: int, write: Callable[[], None], *,
           manifest_steps: Callable[[], Iterable[int]], before_write: Callable[[], None] | None = None) -> None:
    """Commit checkpoint `step` for `attempt`: add it to the fence with If-Match on the ETag just read, then
    `write()` the manifest. The store refuses the fence write (412, StaleAttemptError with status 412) when a newer
    attempt advanced the fence since the read; a fence that already names a newer attempt refuses without a write.
    `before_write` runs between the read and the conditional write (tests pause there). A job with no fence yet
    (a checkpointer used outside the flow) gets one at this attempt; a fence behind this attempt is advanced
    (`manifest_steps`: as for `advance_attempt`)."""
    for _ in range(TRIES):
        current = read_fence(store, job_prefix)
        if current is None:
            _create(store, job_prefix, Fence(attempt))
            continue
        if current.attempt > attempt:
            raise StaleAttemptError(f"checkpoint step {step} refused: the job's fence is at attempt "
                                    f"{current.attempt}, this gang is attempt {attempt}",
                                    attempt=attempt, fenced_at=current.attempt)
        if current.attempt < attempt:
            with contextlib.suppress(StaleAttemptError):  # someone else advanced it: read again
                advance_attempt(store, job_prefix, attempt, manifest_steps)
            continue
        new = replace(current, commits={**current.commits, step: attempt}, revoked=current.revoked - {step})
        if before_write is not None:
            before_write()
        try:
            store.put_bytes(fence_key(job_prefix), new.body(), if_match=current.etag)
        except ObjectChangedError as exc:
            latest = read_fence(store, job_prefix)
            if latest is not None and latest.attempt > attempt:
                raise StaleAttemptError(f"checkpoint step {step} refused by the store (HTTP {exc.status}): the "
                                        f"job's fence moved to attempt {latest.attempt} after this gang "
                                        f"(attempt {attempt}) read it", attempt=attempt,
                                        fenced_at=latest.attempt, status=exc.status) from exc
            continue  # the fence changed for another reason (the controller epoch): read again
        write()
        return
    raise RuntimeError(f"could not commit step {step} under the fence of {job_prefix} in {TRIES} tries")
