"""Checkpoint manifests with content-addressed chunks: chunking, dedup, verification, quarantine (no torch).

Run: .venv/bin/python -m pytest tests/unit/test_manifest_dedup.py -q
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.dedup import ChunkWriter, UploadStats, chunk_key, cut_points, decode, encode
from trainforge.registry.manifest import (
    CheckpointRef,
    latest_intact,
    list_committed,
    materialize,
    read_manifest,
    step_prefix,
    verify,
    write_manifest,
)

JOB = "teams/t/jobs/j"


@pytest.fixture
def store(tmp_path):
    return LocalObjectStore(tmp_path / "store").scoped(JOB)


def commit(store, tmp_path, step, files: dict[str, bytes], known=None, codec=None):
    folder = tmp_path / f"src-{step}"
    folder.mkdir()
    writer = ChunkWriter(store, JOB, codec, known=set(known or ()))
    stats = UploadStats()
    entries = []
    for name, data in files.items():
        (folder / name).write_bytes(data)
        entries.append(writer.write_file(folder / name, name, stats))
    write_manifest(store, step_prefix(JOB, step), {"step": step, "files": entries})
    return writer, stats


def test_cut_points_are_content_defined():
    data = os.urandom(6 << 20)
    a = cut_points(data)
    b = cut_points(b"x" * 1000 + data)  # an insertion shifts offsets but not the cut points after it
    assert a[-1] == len(data) and b[-1] == len(data) + 1000
    assert len({x + 1000 for x in a} & set(b)) >= len(a) - 2
    assert cut_points(b"") == [0] and cut_points(b"abc") == [3]
    assert all(y - x <= 2 << 20 for x, y in zip([0, *a], a, strict=False))


@pytest.mark.parametrize("codec", [None, "zlib"])
def test_codec_roundtrip(codec):
    data = b"abc" * 1000
    assert decode(encode(data, codec), codec) == data


def test_unchanged_bytes_are_stored_once(store, tmp_path):
    # Seeded bytes: chunk boundaries are content-defined, so random data made this test flaky (a rare long chunk
    # straddling the frozen/trained boundary); fixed content gives the same chunks every run.
    rng = random.Random(7)
    frozen, trained, retrained = (rng.randbytes(4 << 20) for _ in range(3))
    writer, first = commit(store, tmp_path, 10, {"a.distcp": frozen + trained})
    _, second = commit(store, tmp_path, 20, {"a.distcp": frozen + retrained}, known=writer.known)
    assert first.bytes_written == 8 << 20
    assert second.chunks_reused > 0
    assert second.bytes_written < 0.7 * second.bytes_logical
    for step in (10, 20):
        ref = list_committed(store, JOB)[0 if step == 10 else 1]
        assert verify(store, ref) == []
    out = tmp_path / "out"
    assert materialize(store, list_committed(store, JOB)[0], out) == []
    assert (out / "a.distcp").read_bytes() == frozen + trained


def _chunk_path(store, ref: CheckpointRef, i: int = 0) -> Path:
    sha, _ = ref.files[0]["chunks"][i]
    return store.local_path(chunk_key(JOB, sha, None))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_checkpoint_is_detected_quarantined_and_skipped(store, tmp_path, damage):
    commit(store, tmp_path, 10, {"a.distcp": os.urandom(1 << 20)})
    commit(store, tmp_path, 20, {"a.distcp": os.urandom(1 << 20)})
    newest = list_committed(store, JOB)[-1]
    path = _chunk_path(store, newest)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        path.unlink()
    problems = verify(store, newest)
    assert problems and "a.distcp" in problems[0]
    ref, skipped = latest_intact(store, JOB)
    assert ref is not None and ref.step == 10
    assert skipped and skipped[0][0] == 20
    # Quarantined: never listed (hence never loaded or promoted) again.
    assert [r.step for r in list_committed(store, JOB)] == [10]
    assert [r.step for r in list_committed(store, JOB, include_quarantined=True)] == [10, 20]


def test_missing_manifest_means_not_committed(store, tmp_path):
    commit(store, tmp_path, 10, {"a.distcp": b"one"})
    store.put_bytes(f"{step_prefix(JOB, 20)}/__0_0.distcp", b"half-written")  # a save that died before commit
    assert [r.step for r in list_committed(store, JOB)] == [10]
    assert latest_intact(store, JOB)[0].step == 10
    store.put_bytes(f"{step_prefix(JOB, 30)}/manifest.json", b"{not json")
    assert read_manifest(store, step_prefix(JOB, 30)) is None
    assert [r.step for r in list_committed(store, JOB)] == [10]


def test_manifest_is_written_once(store, tmp_path):
    commit(store, tmp_path, 10, {"a.distcp": b"one"})
    from trainforge.infra.storage import ObjectExistsError

    with pytest.raises(ObjectExistsError):
        write_manifest(store, step_prefix(JOB, 10), {"step": 10, "files": []})
    assert json.loads(store.get_bytes(f"{step_prefix(JOB, 10)}/manifest.json"))["files"]


def test_materialize_reuses_a_matching_local_copy(store, tmp_path):
    commit(store, tmp_path, 10, {"a.distcp": b"payload" * 1000})
    ref = list_committed(store, JOB)[0]
    out = tmp_path / "local"
    assert materialize(store, ref, out) == []
    for key in store.list(f"{JOB}/chunks/"):
        store.delete(key)  # the store lost its chunks: the verified local copy still serves
    assert materialize(store, ref, out) == []
    (out / "a.distcp").write_bytes(b"stale")
    assert materialize(store, ref, out)  # a stale local copy is not trusted


def test_a_step_saved_again_after_quarantine_commits(tmp_path):
    """A resume from an older checkpoint replays a step whose commit was found corrupt: the new commit replaces
    it (create-only manifest write would otherwise fail) and the evidence stays under new names."""
    from trainforge.infra.storage import LocalObjectStore
    from trainforge.registry.manifest import (
        list_committed,
        quarantine,
        retire_quarantined,
        step_prefix,
        write_manifest,
    )

    store = LocalObjectStore(tmp_path)
    job = "teams/t/jobs/j"
    prefix = step_prefix(job, 8)
    write_manifest(store, prefix, {"step": 8, "files": [], "attempt": 1})
    (ref,) = list_committed(store, job)
    quarantine(store, ref, ["__0_0.distcp: sha256 mismatch"])
    assert list_committed(store, job) == []
    assert retire_quarantined(store, prefix) is True
    write_manifest(store, prefix, {"step": 8, "files": [], "attempt": 2})
    (again,) = list_committed(store, job)
    assert again.manifest["attempt"] == 2
    kept = [k.rsplit("/", 1)[1] for k in store.list(prefix + "/")]
    assert any(k.startswith("manifest.corrupt-") for k in kept) and any(k.startswith("quarantine.retired-") for k in kept)
    assert retire_quarantined(store, prefix) is False
