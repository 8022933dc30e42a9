"""The train-job flow with an elastic job (min_gpus 1, max_gpus 2) on a cluster of 2 one-slot nodes, one of which
another job holds: the flow starts it on 1 worker (dp 1, 2 micro-batches of 4: global batch 8); when the other job
ends, the live scheduler grows the running job onto the freed node, the segment supervisor ends the segment at an
emergency checkpoint, the flow re-provisions and the job finishes on 2 workers (dp 2) from that checkpoint,
resharded. The resize is in the job record, in events.jsonl and in MLflow (`world_size`); the model is registered.
(The scheduler grows a job by whole nodes, so a one-node cluster would never grow it.)

Run: .venv/bin/python -m pytest tests/integration/test_elastic_flow.py -s   (about 1-2 minutes on 2 cores)
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import read_events
from trainforge.home import home
from trainforge.infra.scheduler.live import GangRequest
from trainforge.registry.jobs import JobStore
from trainforge.tasks.chaos import chaos_cluster
from trainforge.tasks.provision import live_scheduler, release_gang

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 60
TWO_NODES = {"name": "two-nodes", "node_mtbf_hours": 10000, "node_groups": [
    {"name": "n", "gpu_type": "cpu", "nodes": 2, "gpus_per_node": 1, "nodes_per_rack": 2, "memory_per_node_gb": 16,
     "intra_node_link": "loopback", "inter_node_link": "loopback"}]}


def elastic_spec() -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["name"] = "tiny-elastic"
    doc["training"].update({"max_steps": STEPS, "global_batch_size": 8, "seq_len": 64})
    doc["resources"].update({"min_gpus": 1, "max_gpus": 2, "gpus_per_node": 1})
    doc["parallelism"].pop("dp", None)
    doc["parallelism"]["micro_batch_size"] = 4
    doc["checkpoint"]["interval_steps"] = 10
    doc["evaluation"]["batches"] = 1
    return doc


def release_once_training(stop: threading.Event) -> None:
    """The other job ends once ours trains (on 1 worker)."""
    while not stop.wait(0.2):
        for folder in (home() / "jobs").glob("tiny-elastic-*") if (home() / "jobs").is_dir() else ():
            path = folder / "events.jsonl"
            evs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
            if any(e["type"] == "metrics" and e["step"] >= 3 for e in evs):
                release_gang("other-job")
                return


def test_elastic_job_starts_small_and_grows_when_capacity_frees(prefect_api):
    ensure_demo_dataset()
    from trainforge.flows.train_job import train_job

    with chaos_cluster(TWO_NODES):
        live_scheduler().request(GangRequest(job_id="other-job", team="other", gpu_type="cpu", num_gpus=1,
                                             gpus_per_node=1), timeout_s=10)
        stop = threading.Event()
        watcher = threading.Thread(target=release_once_training, args=(stop,), daemon=True)
        watcher.start()
        try:
            result = train_job(copy.deepcopy(elastic_spec()), "elastic.yaml", str(EXAMPLES))
        finally:
            stop.set()
            watcher.join(timeout=5)
    assert result["state"] == "completed" and result["model"]["version"]
    record = JobStore().get(result["job_id"])
    [resize] = record.data["resizes"]
    assert (resize["from_workers"], resize["to_workers"], resize["from_dp"], resize["to_dp"]) == (1, 2, 1, 2)
    assert resize["accumulation"] == [2, 1] and resize["global_batch_size"] == 8
    assert record.data["allocation"]["workers"] == 2
    assert [s["state"] for s in record.data["segments"]] == ["resized", "completed"]
    events, _ = read_events(record.events_path)
    starts = [e for e in events if e["type"] == "segment_start"]
    assert [e["world_size"] for e in starts] == [1, 2]
    assert starts[1]["resumed_from"] == resize["after_step"] and 0 < starts[1]["resumed_from"] < STEPS
    assert [e["step"] for e in events if e["type"] == "segment_end"][-1] == STEPS
    from trainforge.registry.tracking import Tracker

    history = Tracker().client.get_metric_history(result["mlflow_run_id"], "world_size")
    assert [m.value for m in history] == [2.0]
