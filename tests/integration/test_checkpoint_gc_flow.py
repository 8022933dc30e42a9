"""The scheduled `checkpoint-gc` flow (prefect.yaml, hourly): over a job store holding a finished job with old
checkpoints, a running job and a job that never started, it applies the finished job's retention policy (the newest
and the protected step stay, the rest and unreferenced chunks go), updates the job record, and leaves the others.

Run: .venv/bin/python -m pytest tests/integration/test_checkpoint_gc_flow.py -q   (about 15 s: a Prefect server)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.dedup import ChunkWriter, UploadStats, chunk_key
from trainforge.registry.jobs import JobStore
from trainforge.registry.manifest import list_committed, step_prefix, verify, write_manifest

pytestmark = pytest.mark.slow  # starts torchrun, workers or servers: `make test`, not `make test-fast`

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_job(tmp_path: Path, job_id: str, state: str, steps: list[int], protected: list[int]) -> tuple:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["checkpoint"] = {"interval_steps": 4, "keep_last": 1}
    record = JobStore().create(job_id, name="tiny-cpu", team=doc.get("team", "t"), spec=doc, source="tiny-cpu.yaml")
    prefix = f"jobs/{job_id}"
    url = (tmp_path / "store").as_uri()
    store = LocalObjectStore(tmp_path / "store").scoped(prefix)
    writer = ChunkWriter(store, prefix)
    for step in steps:
        f = tmp_path / f"{job_id}-{step}"
        f.write_bytes(os.urandom(200_000))
        entry = writer.write_file(f, "__0_0.distcp", UploadStats())
        write_manifest(store, step_prefix(prefix, step), {"step": step, "files": [entry], "metrics": {}})
    orphan = chunk_key(prefix, "ab" * 32, None)
    store.put_bytes(orphan, b"a crashed save's chunk")
    old = 1_000_000_000  # 2001: far past any grace period
    os.utime(tmp_path / "store" / orphan, (old, old))
    (record.folder / "worker-config.json").write_text(json.dumps({"storage_url": url, "storage_prefix": prefix}))
    record.update(state=state, protected_steps=protected, checkpoints={str(s): {"step": s} for s in steps})
    return record, store, prefix, orphan


@pytest.mark.usefixtures("prefect_api")
def test_checkpoint_gc_applies_retention_to_finished_jobs_only(tmp_path):
    from trainforge.flows.checkpoint_gc import checkpoint_gc

    done, store, prefix, orphan = make_job(tmp_path, "done-1", "completed", [4, 8, 12, 16], protected=[8])
    running, rstore, rprefix, _ = make_job(tmp_path, "running-1", "running", [4, 8, 12], protected=[])
    JobStore().create("never-1", name="never", spec={})

    result = checkpoint_gc(grace_s=60)

    assert result["done-1"] == {"deleted": [4, 12], "kept": [8, 16]}
    assert [r.step for r in list_committed(store, prefix)] == [8, 16]
    assert all(verify(store, ref) == [] for ref in list_committed(store, prefix))  # survivors intact
    assert not store.exists(orphan)
    done.reload()
    assert sorted(done.data["checkpoints"]) == ["16", "8"]
    assert "skipped" in result["running-1"] and [r.step for r in list_committed(rstore, rprefix)] == [4, 8, 12]
    assert "skipped" in result["never-1"]

    assert checkpoint_gc(grace_s=60)["done-1"] == {"deleted": [], "kept": [8, 16]}  # idempotent
