"""A ModelShape measured on a real `nn.Module` (parameter counts per block and total), for planning a user's own
model. Apart from plan/model.py because it imports torch (lazily, in `summarize_module`): the contract and the
control plane import plan/model.py and must never reach torch (tests/unit/test_layers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainforge.plan.model import ModelShape


@dataclass(frozen=True, slots=True)
class ModuleSummary:
    """Parameter counts of a real `nn.Module`, read without allocating memory (meta device works)."""

    total_params: int
    largest_module_params: int
    """Largest number of parameters held directly by one submodule (DeepSpeed's `largest_layer_params`)."""
    block_params: tuple[int, ...]
    """Parameters of each repeated block (the longest `nn.ModuleList`)."""
    vocab: int
    hidden: int


def summarize_module(module: Any) -> ModuleSummary:
    """Count parameters per block of an `nn.Module` (built on the meta device: nothing is allocated). Shared
    parameters count once. torch is imported lazily here and only here."""
    import torch

    seen: set[int] = set()
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=len) if lists else []
    block_params = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    emb = next((m for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
    vocab, hidden = (emb.num_embeddings, emb.embedding_dim) if emb is not None else (0, 0)
    return ModuleSummary(total, largest, block_params, vocab, hidden)


def shape_from_module(module: Any, *, heads: int, kv_heads: int | None = None, name: str = "module",
                      mlp: Literal["swiglu", "gelu"] = "swiglu") -> ModelShape:
    """A ModelShape whose parameter counts are those of the real module (per block and total); the width and
    vocabulary come from its embedding, the layer count from its longest ModuleList. `heads` cannot be read from
    weights and must be given."""
    summary = summarize_module(module)
    if not summary.block_params or not summary.hidden:
        raise ValueError("shape_from_module needs an nn.Embedding and an nn.ModuleList of blocks")
    per_layer = max(summary.block_params)
    h = summary.hidden
    kv = kv_heads or heads
    attention = 2 * h * h + 2 * h * (h // heads) * kv
    ffn = max(1, (per_layer - attention - 2 * h) // ((3 if mlp == "swiglu" else 2) * h))
    return ModelShape(name, len(summary.block_params), h, heads, kv, ffn, summary.vocab, mlp,
                      measured_layer_params=per_layer, measured_total_params=summary.total_params)
