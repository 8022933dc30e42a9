"""What a Hugging Face Llama folder's config.json says, read without torch (validation runs before any process).

`check_config` lists what trainforge's Llama (trainer/models/llama.py) cannot reproduce, so a folder it would load
with the wrong math (another rotary base, biases, rope scaling) is refused by name instead of training on
silently different logits. `spec_mismatches` compares the folder's architecture numbers with the spec's model
section: the spec stays the one place the planner and the workers read them from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"

# What trainforge's Llama computes with; a config that asks for something else is refused (key, wanted value).
ROPE_THETA = 10000.0
NORM_EPS = 1e-5
_FIXED: tuple[tuple[str, Any], ...] = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))


class HFFormatError(ValueError):
    """A folder that is not a Llama checkpoint trainforge can read, or a model it cannot write as one."""


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / HF_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HFFormatError(f"{path}: not a readable Hugging Face config ({exc})") from None
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        got = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise HFFormatError(f"{path}: model_type is {got!r}; only Llama models are read")
    return config


MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")
"""The spec's model numbers a folder is checked against (ModelShape's attributes of the same names)."""


def shape_numbers(shape: Any) -> dict[str, int]:
    """A resolved model shape's numbers under the spec's field names, to compare with `model_args_of`."""
    return {k: int(getattr(shape, k)) for k in MODEL_FIELDS}


def model_args_of(config: dict[str, Any]) -> dict[str, int]:
    """The spec's model numbers a Hugging Face Llama config describes (what `init_from` checks the spec against)."""
    try:
        return {"layers": int(config["num_hidden_layers"]), "hidden": int(config["hidden_size"]),
                "heads": int(config["num_attention_heads"]),
                "kv_heads": int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                "ffn_hidden": int(config["intermediate_size"]), "vocab": int(config["vocab_size"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise HFFormatError(f"{HF_CONFIG} lacks a Llama architecture number ({exc})") from None


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:  # transformers >= 5 keeps it here
        return float(params["rope_theta"])
    return float(config.get("rope_theta", ROPE_THETA))


def check_config(config: dict[str, Any]) -> list[str]:
    """What in this Llama config trainforge's Llama would compute differently (empty: loads exactly)."""
    out = []
    args = model_args_of(config)
    for key, want in _FIXED:
        if key in config and config[key] != want:
            out.append(f"{key} is {config[key]!r} (trainforge's Llama has {want!r})")
    if (theta := _rope_theta(config)) != ROPE_THETA:
        out.append(f"rope_theta is {theta:g} (trainforge's Llama rotates with base {ROPE_THETA:g})")
    if float(config.get("rms_norm_eps", NORM_EPS)) != NORM_EPS:
        out.append(f"rms_norm_eps is {config['rms_norm_eps']!r} (trainforge's Llama uses {NORM_EPS:g})")
    scaling = config.get("rope_scaling")
    params = config.get("rope_parameters")
    rope_type = (params or {}).get("rope_type", "default") if isinstance(params, dict) else "default"
    if scaling or rope_type != "default":
        out.append(f"rope scaling {scaling or rope_type!r} is set (trainforge's Llama has plain rotary embeddings)")
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * args["heads"] != args["hidden"]:
        out.append(f"head_dim {head_dim} x {args['heads']} heads is not hidden_size {args['hidden']}")
    if args["hidden"] % args["heads"] or args["heads"] % args["kv_heads"]:
        out.append("hidden_size, num_attention_heads and num_key_value_heads do not divide")
    return out


def spec_mismatches(config: dict[str, Any], spec_model: dict[str, int | None]) -> dict[str, tuple[Any, int]]:
    """{field: (spec's value, the folder's)} where the spec's resolved model numbers differ from the folder's."""
    folder = model_args_of(config)
    return {k: (spec_model.get(k), v) for k, v in folder.items() if spec_model.get(k) != v}


def folder_problems(config: dict[str, Any], spec_model: dict[str, int | None], experts: int = 0) -> list[str]:
    """Why a folder's model is not the spec's, each with how to fix it; empty when it loads exactly."""
    out = [f"{p}; start from a plain Llama checkpoint" for p in check_config(config)]
    if experts:
        out.append("the model section is a mixture of experts; a Hugging Face Llama folder holds a dense model")
    mismatch = spec_mismatches(config, spec_model)
    if mismatch:
        shown = ", ".join(f"{k} {ours} here, {theirs} in the folder" for k, (ours, theirs) in mismatch.items())
        want = ", ".join(f"{k}: {theirs}" for k, (_, theirs) in mismatch.items())
        out.append(f"the model section does not match the folder's {HF_CONFIG} ({shown}); set model: {{{want}}}")
    return out
