"""Make `tiny-llama/`, the Hugging Face folder `examples/tiny-cpu-finetune.yaml` starts from: written by transformers'
own `save_pretrained` (config.json, model.safetensors), as a folder from the Hub would be, plus a model card naming
its license. The weights are a seeded random initialisation, not a trained model: the folder shows the mechanics of
`init_from` (checked, converted, recorded in lineage) in a size that fits the repository (about 100k parameters).
The vocabulary is trainforge's byte-level one (260 ids), so the folder ships no tokenizer.json and fine-tunes on the
demo dataset. `tests/unit/test_example_models.py` checks that this script makes exactly the shipped folder.

Run: .venv/bin/python examples/models/make_tiny_llama.py [OUT]   (transformers installed: the test extra)
"""

from __future__ import annotations

import sys
from pathlib import Path

# The model section of examples/tiny-cpu-finetune.yaml, in transformers' names.
CONFIG = dict(vocab_size=260, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
CARD = """---
license: apache-2.0
language: en
tags: [trainforge-example]
---
# tiny-llama

A 2-layer Llama made by `examples/models/make_tiny_llama.py` (seeded random weights, trainforge's byte-level
vocabulary) for the `init_from` example `examples/tiny-cpu-finetune.yaml`. Not a trained model.
"""
SEED = 20261204


def make(out: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text(CARD)
    return out


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "tiny-llama"))
