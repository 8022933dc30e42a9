"""trainforge Llama <-> Hugging Face Llama folder (trainer/models/hf_llama.py): exact round trip, and transformers
computes the same logits from the exported folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainforge.trainer.models.hf_llama import HFFormatError, hf_config, load_hf_folder, save_hf_folder
from trainforge.trainer.models.llama import build_model

MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab=256, experts=0, top_k=0)


def test_the_folder_round_trips_bit_for_bit_and_transformers_agrees(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ours = build_model({**MODEL, "max_seq_len": 64}).eval()
    save_hf_folder(ours.state_dict(), MODEL, tmp_path, max_seq_len=64)
    back, config = load_hf_folder(tmp_path)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_moe_and_foreign_folders_are_refused(tmp_path: Path) -> None:
    with pytest.raises(HFFormatError, match="mixture-of-experts"):
        hf_config({**MODEL, "experts": 8}, max_seq_len=64)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(HFFormatError, match="only Llama"):
        load_hf_folder(tmp_path)
