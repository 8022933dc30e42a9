"""A train-job flow run fine-tuned from a Hugging Face folder that transformers wrote (`init_from: ./folder/`): the
workers start from exactly its weights, the job trains and registers, and lineage puts the folder (content hash,
the model card's license) upstream of the registered model.

Run: .venv/bin/python -m pytest tests/integration/test_init_from_hf_flow.py   (one flow run, about 40 seconds)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.plan.model import preset
from trainforge.registry.jobs import JobStore
from trainforge.registry.lineage import LineageStore

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_job_fine_tunes_from_a_transformers_folder(prefect_api, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from trainforge.trainer.models.hf_llama import load_hf_folder

    ensure_demo_dataset()
    tiny = preset("tiny")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tiny.vocab, hidden_size=tiny.hidden, intermediate_size=tiny.ffn_hidden,
        num_hidden_layers=tiny.layers, num_attention_heads=tiny.heads, num_key_value_heads=tiny.kv_heads,
        max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base", safe_serialization=True)
    (tmp_path / "base" / "README.md").write_text("---\nlicense: mit\n---\nA base model.\n")
    (tmp_path / "spec").mkdir()
    doc = small_spec(max_steps=8)
    doc.update(name="tiny-hf-ft", init_from="../base/")  # relative to the spec's folder

    result = run_flow(doc, base_dir=tmp_path / "spec")
    assert result["state"] == "completed" and sorted(result["checkpoints"]) == [8]
    worker_config = json.loads((JobStore().get(result["job_id"]).folder / "worker-config.json").read_text())
    started_from = load_file(worker_config["init_weights"])
    expected, _ = load_hf_folder(tmp_path / "base")
    assert started_from.keys() == expected.keys()
    assert all(torch.equal(started_from[k], v) for k, v in expected.items())

    model = result["model"]
    [weights] = [n for n in LineageStore().upstream(f"model:{model['model_name']}/{model['version']}")
                 if n.kind == "weights"]
    assert weights.license == "mit" and weights.attrs["source"] == str((tmp_path / "base").resolve())
