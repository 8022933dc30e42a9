"""A restore reads each checkpoint byte from the store once, each rank only its load plan's chunks, and resumes
bitwise; a corrupt chunk sends every rank back, together, to the previous commit (tests/distributed/restore_worker.py
on 4 gloo ranks, FSDP over 4 and HSDP 2 x 2; the object store is a local folder here, SeaweedFS in
bench/restore_bytes.py).

Run: .venv/bin/python -m pytest tests/distributed/test_restore_ranges.py -q   (about a minute)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.conftest import run_torchrun
from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.dedup import MAX_CHUNK
from trainforge.registry.manifest import list_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 4
JOB = "teams/t/jobs/restore"


def run(tmp_path: Path, layout: str, phases: list[str], world: int = WORLD) -> dict[str, list[dict]]:
    cfg = {"out": str(tmp_path), "store": str(tmp_path / "store"), "layout": layout, "width": 192, "layers": 4,
           "steps": 6, "interval": 2, "phases": phases}
    run_torchrun(world, "tests.distributed.restore_worker", [],
                 env={"RESTORE_CONFIG": json.dumps(cfg), "TRAINFORGE_REPLICA_DIR": str(tmp_path / "shm")})
    return {f"{p}-{i}": [json.loads((tmp_path / f"{p}-{i}-rank{r}.json").read_text()) for r in range(world)]
            for i, p in enumerate(phases)}


def unique_bytes(files: list[dict], skip: set[str]) -> int:
    return sum(size for sha, size in {(sha, size) for f in files if f["name"] not in skip
                                      for sha, size in f["chunks"]})


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_restore_reads_each_chunk_once_resumes_bitwise_and_skips_a_corrupt_commit(tmp_path, layout):
    results = run(tmp_path, layout, ["train", "resume", "corrupt"])
    train, resume, corrupt = results["train-0"], results["resume-1"], results["corrupt-2"]
    reference = [r["digest"] for r in train]

    # Resumed from the newest commit (step 4) straight from the store: bitwise the uninterrupted run.
    assert [r["start"] for r in resume] == [4] * WORLD
    assert [r["digest"] for r in resume] == reference

    # Each chunk of the checkpoint came from the store once, in all (the reader counts; the bench counts outside).
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    step4 = next(c for c in list_committed(store, JOB, include_quarantined=True) if c.step == 4)
    fetched = [r["bytes"]["store"] for r in resume]
    assert sum(fetched) == unique_bytes(step4.files, skip={".metadata"})  # .metadata: read by rank 0, broadcast
    shards = [f["bytes"] for f in step4.files if f["name"].endswith(".distcp")]
    share = sum(shards) / WORLD
    for rank, got in enumerate(fetched):
        assert 0 < got <= 1.1 * share + 2 * MAX_CHUNK, (rank, got, share)
    received = [r["bytes"]["peers"] for r in resume]
    if layout == "hsdp":  # replicas split their shard's reads and hand each other the rest
        assert all(got > 0 for got in received), received

    # A flipped byte in one chunk of step 4: every rank went back to step 2 together, step 4 is quarantined, and the
    # run from step 2 ends bitwise where the uninterrupted one did.
    assert corrupt[0]["corrupted"]["step"] == 4
    assert [r["skipped"] for r in corrupt] == [[4]] * WORLD
    assert [r["start"] for r in corrupt] == [2] * WORLD
    assert [r["digest"] for r in corrupt] == reference
    # step 4 was saved again by the run from step 2, so its quarantine record was kept under a retired name
    assert any("/quarantine.retired-" in key for key in store.list(step4.prefix + "/"))


def test_a_resharded_restore_reads_each_chunk_once_and_equals_a_whole_copy_load(tmp_path):
    """Saved by 4 ranks, restored by 2 (an elastic shrink): each rank's ranges cross the old shard files, the
    chunks on their edges are needed by both ranks and still read once; the result is what DCP loads from a whole
    local copy (main's restore, the oracle)."""
    run(tmp_path, "fsdp", ["train"])
    results = run(tmp_path, "fsdp", ["restore", "legacy"], world=2)
    ranged, whole = results["restore-0"], results["legacy-1"]
    assert [r["start"] for r in ranged] == [4, 4] and [r["start"] for r in whole] == [4, 4]
    assert [r["digest"] for r in ranged] == [r["digest"] for r in whole]
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    step4 = next(c for c in list_committed(store, JOB) if c.step == 4)
    # rng files of ranks 2 and 3 have no reader at world 2
    skip = {".metadata", "rng-rank00002.safetensors", "rng-rank00003.safetensors"}
    assert sum(r["bytes"]["store"] for r in ranged) == unique_bytes(step4.files, skip=skip)
