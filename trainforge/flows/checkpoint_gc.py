"""The `checkpoint-gc` flow: the scheduled sweep (hourly in prefect.yaml) applying each job's retention policy
(`checkpoint.keep_last`, `keep_best`, `keep_every`) to its committed checkpoints and collecting what no manifest
references any more.

Every job in the job store ($TRAINFORGE_HOME/jobs) with a worker config is swept, except running or pending ones
(their own flow applies retention after every commit, and owns the record meanwhile). The safety rules are
`trainforge.tasks.checkpoints.apply_retention`'s: the newest intact checkpoint, the registry's protected steps and
anything younger than `grace_s` that no manifest references (an in-flight save) are never deleted.
Returns {job_id: {"deleted": [steps], "kept": [steps]} or {"skipped": why} or {"error": why}}.
"""

from __future__ import annotations

import json
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainforge.tasks.checkpoints import GC_GRACE_S

ACTIVE = ("running", "pending")


@task(name="gc-job", cache_policy=NO_CACHE)
def gc_job(job_folder: str, grace_s: float) -> dict[str, Any]:
    from pathlib import Path

    from trainforge.registry.jobs import JobRecord
    from trainforge.registry.manifest import list_committed
    from trainforge.spec import parse_spec
    from trainforge.tasks.checkpoints import apply_retention, job_store

    folder = Path(job_folder)
    record = JobRecord(folder, json.loads((folder / "job.json").read_text()))
    config = json.loads((folder / "worker-config.json").read_text())
    spec = parse_spec(record.data["spec"], record.data.get("source") or "<job>")
    deleted = apply_retention(spec, config, record.data.get("protected_steps", []), grace_s=grace_s)
    kept = [r.step for r in list_committed(job_store(config), config["storage_prefix"])]
    if deleted:
        record.reload()
        checkpoints = record.data.get("checkpoints") or {}
        record.update(checkpoints={k: v for k, v in checkpoints.items() if int(k) not in deleted})
    return {"deleted": sorted(deleted), "kept": sorted(kept)}


@flow(name="checkpoint-gc", log_prints=False)
def checkpoint_gc(grace_s: float = GC_GRACE_S, include_active: bool = False) -> dict[str, Any]:
    """Apply retention to every job's checkpoints. `include_active=True` also sweeps running jobs (safe: the
    newest checkpoint and young unreferenced objects stay), for a job whose flow died without cleanup."""
    from trainforge.registry.jobs import JobStore

    log = get_run_logger()
    out: dict[str, Any] = {}
    for record in JobStore().list():
        if not (record.folder / "worker-config.json").is_file():
            out[record.job_id] = {"skipped": "no worker config (never started)"}
            continue
        if record.data.get("state") in ACTIVE and not include_active:
            out[record.job_id] = {"skipped": f"{record.data.get('state')}: its own flow applies retention"}
            continue
        try:
            out[record.job_id] = gc_job(str(record.folder), grace_s)
        except Exception as exc:  # noqa: BLE001 - one broken job must not stop the sweep of the others
            log.warning("checkpoint-gc: %s: %s", record.job_id, exc)
            out[record.job_id] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    swept = [v for v in out.values() if "deleted" in v]
    log.info("checkpoint-gc: %d job(s) swept, %d checkpoint(s) deleted", len(swept),
             sum(len(v["deleted"]) for v in swept))
    return out
