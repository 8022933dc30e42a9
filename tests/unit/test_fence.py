"""The job's fence (registry/fence.py) on the local store: a newer attempt fences out an older one's commits, the
store refuses the race (a write between the old attempt's read and its conditional write), and a manifest the old
attempt writes after the new one began is never a checkpoint. The same race on SeaweedFS, where the 412 is the
server's: tests/integration/test_fence.py.

Run: .venv/bin/python -m pytest tests/unit/test_fence.py -q
"""

from __future__ import annotations

import pytest

from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.fence import StaleAttemptError, advance_attempt, commit, read_fence
from trainforge.registry.manifest import (
    committed_steps,
    list_committed,
    manifest_steps,
    newest_committed,
    retire_stale_manifest,
    step_prefix,
    write_manifest,
)

JOB = "teams/t/jobs/fenced"


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "store").scoped(JOB)


def manifest(store, step: int, attempt: int) -> None:
    write_manifest(store, step_prefix(JOB, step), {"step": step, "segment_attempt": attempt, "files": []})


def commit_step(store, step: int, attempt: int, write, **kw):
    return commit(store, JOB, step, attempt, write, manifest_steps=lambda: manifest_steps(store, JOB), **kw)


def advance(store, attempt: int):
    return advance_attempt(store, JOB, attempt, lambda: manifest_steps(store, JOB))


def test_the_fence_accepts_its_attempt_and_refuses_an_older_one(store):
    advance(store, 0)
    commit_step(store, 2, 0, lambda: manifest(store, 2, 0))
    advance(store, 1)
    written = []
    with pytest.raises(StaleAttemptError) as refused:
        commit_step(store, 4, 0, lambda: written.append(4))
    assert refused.value.fenced_at == 1 and refused.value.status is None  # the read already named attempt 1
    assert written == []
    commit_step(store, 4, 1, lambda: manifest(store, 4, 1))
    assert committed_steps(store, JOB) == [2, 4]
    fence = read_fence(store, JOB)
    assert fence.attempt == 1 and fence.commits == {2: 0, 4: 1}
    with pytest.raises(StaleAttemptError, match="not newer"):  # a second control plane starting attempt 1 again
        advance(store, 1)


def test_a_newer_attempt_between_the_read_and_the_write_is_refused_by_the_store(store):
    advance(store, 0)
    written = []
    # the old attempt's rank 0 read the fence; the control plane starts attempt 1 before its write
    with pytest.raises(StaleAttemptError) as refused:
        commit_step(store, 4, 0, lambda: written.append(4), before_write=lambda: advance(store, 1))
    assert refused.value.status == 412 and refused.value.fenced_at == 1
    assert written == [] and manifest_steps(store, JOB) == set()
    assert read_fence(store, JOB).commits == {}


def test_a_manifest_that_lands_after_a_newer_attempt_began_is_never_a_checkpoint(store):
    advance(store, 0)
    commit_step(store, 2, 0, lambda: manifest(store, 2, 0))
    commit_step(store, 4, 0, lambda: None)  # accepted, and its rank 0 stalls before writing the manifest
    advance(store, 1)  # the new attempt revokes step 4: its manifest is not in the store
    assert read_fence(store, JOB).revoked == {4}
    manifest(store, 4, 0)  # the stalled rank 0 wakes up and writes it anyway
    assert committed_steps(store, JOB) == [2]
    assert [r.step for r in list_committed(store, JOB)] == [2]
    assert newest_committed(store, JOB).step == 2  # a resume never sees it
    # attempt 1 trains step 4 again: the fence accepts it for attempt 1, the stale manifest is moved aside
    commit_step(store, 4, 1, lambda: (retire_stale_manifest(store, step_prefix(JOB, 4), 1), manifest(store, 4, 1)))
    ref = newest_committed(store, JOB)
    assert ref.step == 4 and ref.manifest["segment_attempt"] == 1
    assert any("manifest.stale-" in k for k in store.list(step_prefix(JOB, 4) + "/"))


def test_a_manifest_the_fence_gave_to_another_attempt_is_not_visible(store):
    advance(store, 0)
    commit_step(store, 2, 0, lambda: None)
    advance(store, 1)
    commit_step(store, 2, 1, lambda: None)  # step 2 accepted for attempt 1, which has not written it yet
    manifest(store, 2, 0)  # attempt 0's late manifest
    assert list_committed(store, JOB) == [] and newest_committed(store, JOB) is None


def test_without_a_fence_every_manifest_counts(store):
    manifest(store, 2, 0)
    manifest(store, 4, 3)
    assert committed_steps(store, JOB) == [2, 4] and newest_committed(store, JOB).step == 4
