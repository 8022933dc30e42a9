"""The tiny-model chaos jobs of tests/chaos/ and bench/chaos_mttr.py; the drill machinery (segments with faults,
retries and re-provisioning like the flow, measurements from the records) is trainforge/tasks/chaos.py, which
`trainforge chaos` uses too.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.tasks.chaos import (  # noqa: F401  (re-exported for the tests and the bench)
    CHAOS_CLUSTER,
    FAST_HEALTH,
    ChaosJob,
    chaos_cluster,
    events,
    measure,
    prepare_job,
    run_job,
    unhealthy_nodes,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def make_job(job_id: str, *, steps: int = 24, interval: int = 8, segment_max_steps: int | None = None,
             workers: int = 2, min_workers: int | None = None, micro_batch: int | None = None) -> ChaosJob:
    """The tiny model on `workers` gloo ranks; 4 workers are laid out as 2 nodes of 2 (see CHAOS_CLUSTER).
    `min_workers` < `workers` makes the job elastic (resources.min_gpus .. max_gpus, dp from the size it gets)."""
    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": steps, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = interval
    if min_workers is not None and min_workers < workers:
        doc["resources"].update({"min_gpus": min_workers, "max_gpus": workers, "gpus_per_node": 2})
        doc["parallelism"].pop("dp", None)  # dp follows the size the scheduler grants
        doc["parallelism"]["micro_batch_size"] = micro_batch or 8 // workers
    elif workers != 2:
        doc["resources"].update({"min_gpus": workers, "gpus_per_node": 2})
        doc["parallelism"].update({"dp": workers, "micro_batch_size": micro_batch or 8 // workers})
    elif micro_batch:
        doc["parallelism"]["micro_batch_size"] = micro_batch
    if segment_max_steps:
        doc["fault_tolerance"]["segment_max_steps"] = segment_max_steps
    multi = workers > 2 or (min_workers is not None and min_workers < workers)
    return prepare_job(doc, "chaos.yaml", EXAMPLES, job_id, cluster=CHAOS_CLUSTER if multi else None)
