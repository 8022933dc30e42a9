"""trainforge's Llama <-> a Hugging Face `LlamaForCausalLM` folder (config.json + model.safetensors).

Names follow transformers' Llama (`model.layers.N.self_attn.q_proj.weight`, ...). The one non-renaming step is
rotary embedding layout: trainforge rotates adjacent pairs of each head's dims (Meta's layout), transformers
rotates the first half against the second (`rotate_half`), so the rows of q_proj and k_proj are permuted per
head on the way out and back on the way in (the permutation transformers' own convert_llama_weights_to_hf
applies). Grouped-query attention repeats kv heads the same way on both sides (each kv head serves consecutive
query heads), so nothing else moves. Dense models only: the MoE blocks have no Llama counterpart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainforge.trainer.models.hf_config import (
    HF_CONFIG,
    HF_WEIGHTS,
    HFFormatError,
    check_config,
    model_args_of,
    read_hf_config,
)

__all__ = ["HF_CONFIG", "HF_WEIGHTS", "HFFormatError", "check_config", "from_hf", "hf_config", "load_hf_folder",
           "model_args_of", "read_hf_config", "save_hf_folder", "to_hf"]

_LAYER = {  # trainforge suffix after layers.N. -> transformers suffix after model.layers.N.
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def _pairs_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(suffix: str, config: dict[str, Any]) -> int | None:
    """How many heads a tensor's rows hold when its rows carry rotary dims (q and k), else None."""
    return {"attention.wq.weight": config["num_attention_heads"],
            "attention.wk.weight": config["num_key_value_heads"]}.get(suffix)


def hf_config(model: dict[str, Any], *, max_seq_len: int, rope_theta: float = 10000.0,
              norm_eps: float = 1e-5, dtype: str = "float32") -> dict[str, Any]:
    """transformers' LlamaConfig for the spec's resolved model numbers (`SegmentConfig.model_args()`)."""
    if model.get("experts"):
        raise HFFormatError("a mixture-of-experts model has no Hugging Face Llama form (dense models only)")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": model["vocab"], "hidden_size": model["hidden"], "intermediate_size": model["ffn_hidden"],
        "num_hidden_layers": model["layers"], "num_attention_heads": model["heads"],
        "num_key_value_heads": model["kv_heads"], "head_dim": model["hidden"] // model["heads"],
        "max_position_embeddings": max_seq_len, "rms_norm_eps": norm_eps,
        "rope_theta": rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
    }


def to_hf(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """trainforge state dict -> transformers tensors (q/k rows permuted per head)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in _TOP:
            out[_TOP[key]] = tensor
            continue
        prefix, _, rest = key.partition(".")
        layer, _, suffix = rest.partition(".")
        if prefix != "layers" or suffix not in _LAYER:
            raise HFFormatError(f"tensor {key!r} has no Hugging Face Llama counterpart")
        if (heads := _rope_heads(suffix, config)) is not None:
            tensor = _pairs_to_halves(tensor, heads)
        out[f"model.layers.{layer}.{_LAYER[suffix]}"] = tensor.contiguous()
    return out


def from_hf(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """transformers tensors -> trainforge state dict (the inverse of `to_hf`)."""
    top = {v: k for k, v in _TOP.items()}
    layer_names = {v: k for k, v in _LAYER.items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" not in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key in top:
            out[top[key]] = tensor
            continue
        parts = key.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in layer_names:
            if key.endswith("rotary_emb.inv_freq"):
                continue  # older exports carry the rotary table; trainforge recomputes it
            raise HFFormatError(f"tensor {key!r} is not part of a Llama model")
        suffix = layer_names[parts[3]]
        if (heads := _rope_heads(suffix, config)) is not None:
            tensor = _halves_to_pairs(tensor, heads)
        out[f"layers.{parts[2]}.{suffix}"] = tensor.contiguous()
    return out


def save_hf_folder(state: dict[str, torch.Tensor], model: dict[str, Any], out: Path, *, max_seq_len: int,
                   metadata: dict[str, str] | None = None) -> dict[str, Any]:
    """Write `out/config.json` and `out/model.safetensors` that `LlamaForCausalLM.from_pretrained(out)` loads."""
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = hf_config(model, max_seq_len=max_seq_len, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(state, config), str(out / HF_WEIGHTS), metadata={"format": "pt", **(metadata or {})})
    (out / HF_CONFIG).write_text(json.dumps(config, indent=1))
    return config


def load_hf_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A Hugging Face Llama folder's weights in trainforge's names (no pickle: safetensors files only)."""
    config = read_hf_config(folder)
    if problems := check_config(config):
        raise HFFormatError(f"{folder / HF_CONFIG}: " + "; ".join(problems))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise HFFormatError(f"{folder}: no .safetensors weights (pickled .bin weights are not loaded)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return from_hf(tensors, config), config
