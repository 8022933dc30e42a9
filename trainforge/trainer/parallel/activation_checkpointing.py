"""Activation checkpointing: `full` recomputes whole blocks in backward, `selective` only the attention (the
activation-heavy part: Korthikanti et al. 2022, "Reducing Activation Recomputation", sec. 5)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap in place. State-dict keys are unchanged (DCP's get_state_dict strips the wrapper's prefix)."""
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing {mode!r} is not one of none, selective, full")
    layers = model.layers  # type: ignore[union-attr]
    for key, block in list(layers.items()):
        if mode == "full":
            layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            block.attention = checkpoint_wrapper(block.attention, preserve_rng_state=False)
