"""The fine-tune example (examples/tiny-cpu-finetune.yaml) as a train-job flow run, from the Hugging Face folder
that transformers wrote (`init_from: models/tiny-llama/`, made by examples/models/make_tiny_llama.py): the workers
start from exactly its weights, the job trains and registers, and lineage puts the folder (content hash, the model
card's license) upstream of the registered model.

Run: .venv/bin/python -m pytest tests/integration/test_init_from_hf_flow.py   (one flow run, about 40 seconds)
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.integration.test_train_job import EXAMPLES, run_flow
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.registry.jobs import JobStore
from trainforge.registry.lineage import LineageStore

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_fine_tune_example_starts_from_its_transformers_folder(prefect_api) -> None:
    from safetensors.torch import load_file

    from trainforge.trainer.models.hf_llama import load_hf_folder

    ensure_demo_dataset()
    # examples/tiny-cpu-finetune.yaml as shipped (init_from: models/tiny-llama/, relative to the spec's folder),
    # shortened to one checkpoint interval
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu-finetune.yaml").read_text())
    doc["training"].update(max_steps=8, global_batch_size=8, seq_len=64)
    doc["checkpoint"]["interval_steps"] = 8
    doc["evaluation"]["batches"] = 2
    base = EXAMPLES / "models" / "tiny-llama"

    result = run_flow(doc, base_dir=EXAMPLES)
    assert result["state"] == "completed" and sorted(result["checkpoints"]) == [8]
    worker_config = json.loads((JobStore().get(result["job_id"]).folder / "worker-config.json").read_text())
    started_from = load_file(worker_config["init_weights"])
    expected, _ = load_hf_folder(base)
    assert started_from.keys() == expected.keys()
    assert all(torch.equal(started_from[k], v) for k, v in expected.items())

    model = result["model"]
    [weights] = [n for n in LineageStore().upstream(f"model:{model['model_name']}/{model['version']}")
                 if n.kind == "weights"]
    assert weights.license == "apache-2.0" and weights.attrs["source"] == str(base.resolve())
