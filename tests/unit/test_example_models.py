"""The Hugging Face folder the fine-tune example starts from (examples/models/tiny-llama/, made by
examples/models/make_tiny_llama.py with transformers): the script makes that folder (same config, tensor names and
shapes; same values under the same transformers), `examples/tiny-cpu-finetune.yaml` validates against it, and the
folder converts to trainforge's model with transformers' own logits. The flow run from it is
tests/integration/test_init_from_hf_flow.py.

Run: .venv/bin/python -m pytest tests/unit/test_example_models.py -q
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.specs.cases import EXAMPLES, build_demo_dataset
from trainforge.spec import parse_spec
from trainforge.tasks.init_folder import card_license, materialise
from trainforge.trainer.loop import load_init_weights
from trainforge.trainer.models.hf_config import model_args_of, read_hf_config
from trainforge.trainer.models.llama import build_model
from trainforge.validate import validate_document

transformers = pytest.importorskip("transformers")
SHIPPED = EXAMPLES / "models" / "tiny-llama"
EXAMPLE = EXAMPLES / "tiny-cpu-finetune.yaml"


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_llama", EXAMPLES / "models" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_makes_the_shipped_folder(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    made = _script().make(tmp_path / "made")
    assert model_args_of(read_hf_config(made)) == model_args_of(read_hf_config(SHIPPED))
    ours, shipped = load_file(made / "model.safetensors"), load_file(SHIPPED / "model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in shipped.items()}
    if json.loads((SHIPPED / "config.json").read_text()).get("transformers_version") == transformers.__version__:
        assert all(torch.equal(ours[k], v) for k, v in shipped.items()), "rerun examples/models/make_tiny_llama.py"
    assert card_license(SHIPPED) == "apache-2.0" and not (SHIPPED / "pytorch_model.bin").exists()


def test_the_finetune_example_validates_and_converts_with_transformers_logits(tmp_path: Path) -> None:
    build_demo_dataset()
    doc = yaml.safe_load(EXAMPLE.read_text())
    report = validate_document(doc, str(EXAMPLE), base_dir=EXAMPLES)
    assert report.ok(strict=True), [p.render() for p in report.problems]
    spec = parse_spec(doc)
    weights, folder = materialise(spec, EXAMPLES, tmp_path / "run")
    assert folder.source == str(SHIPPED.resolve()) and folder.license == "apache-2.0"
    m = spec.model
    ours = build_model({"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
                        "ffn_hidden": m.ffn_hidden, "vocab": m.vocab, "experts": 0, "top_k": 0,
                        "max_seq_len": spec.training.seq_len}).eval()
    load_init_weights(ours, str(weights))
    hf = transformers.LlamaForCausalLM.from_pretrained(SHIPPED).eval()
    tokens = torch.randint(0, m.vocab, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
