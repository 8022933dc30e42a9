"""Tensor parallelism for the reference Llama (Megatron-style, torchtitan's plan).

Attention wq/wk/wv and MLP w1/w3 are column-parallel, wo/w2 row-parallel, so each block needs one all-reduce
(or, with sequence parallelism, one all-gather + one reduce-scatter) per forward. Sequence parallelism shards the
norms' activations on the sequence dim. The embedding is vocabulary-parallel (row-wise) and the output projection
column-parallel with its logits left sharded on the vocab dim: `loss_parallel` then computes cross-entropy from
the shards, so the full (B, S, V) logits are never gathered. Head counts come from the weight shapes, so the model
needs no change; kv_heads must be divisible by tp.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainforge.plan.support import check_supported


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
             loss_parallel: bool = True) -> None:
    """Parallelize a Llama (or a pipeline chunk of one: missing embedding/norm/output are skipped) in place."""
    tp = tp_mesh.size()
    kv = getattr(model, "config", None) and model.config.kv_heads
    check_supported(tp=tp, kv_heads=kv or None)
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)  # type: ignore[arg-type]
    for block in model.layers.values():  # type: ignore[union-attr]
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)  # type: ignore[arg-type]
