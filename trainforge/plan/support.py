"""What the parallelism engine can run: one source of truth for the advisor, `validate` and the engine.

The planner used to accept layouts the engine refused at worker start (after the GPUs were granted): expert
parallelism with FSDP sharding, expert parallelism with pipeline stages, and a tensor-parallel degree that is a
multiple of the KV heads (the engine shards KV heads over TP ranks and does not replicate them). Which engine runs
which sharding is a rule too: the native engine (FSDP2) has no mode that shards the optimizer state alone
(`shard-optimizer`, ZeRO-1: DeepSpeed's stage 1), and DeepSpeed's engine here runs ZeRO data parallelism only (no
tp, pp, ep, nor FSDP2's hybrid sharding). Each rule lives here once; `plan.layout.layout_problems` reports it (so
the advisor never returns such a layout and `validate` rejects it before allocation), and the engine's own checks
(`trainer/parallel/mesh.py` `ParallelDims`, `trainer/parallel/tp.py`) raise with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LayoutProblem:
    field: str
    message: str
    fix: str


# The ZeRO stage each sharding is on DeepSpeed's engine (trainer/parallel/deepspeed_engine.py): none replicates
# everything (stage 0, as DDP does), shard-optimizer shards the optimizer state (1), shard-grad-op the gradients too
# (2), full-shard the parameters too (3).
DEEPSPEED_ZERO_STAGE = {"none": 0, "shard-optimizer": 1, "shard-grad-op": 2, "full-shard": 3}


def engine_problems(*, tp: int = 1, pp: int = 1, ep: int = 1, fsdp: bool = False,
                    kv_heads: int | None = None, engine: str | None = None,
                    sharding: str | None = None) -> list[LayoutProblem]:
    """The rules of the parallelism engine that are not arithmetic (those are in `layout_problems`).
    `fsdp`: the data-parallel ranks shard parameters (shard-grad-op, full-shard, hybrid-shard with dp > 1).
    `kv_heads`: None where the caller does not know the model (the mesh), which skips that rule.
    `engine` (`native` or `deepspeed`) with `sharding`: which engine runs the layout; None skips those rules (a
    caller that checks the engine choice once elsewhere: `validate` does it per spec, for script jobs too)."""
    out = engine_choice_problems(engine, sharding=sharding, tp=tp, pp=pp, ep=ep) if engine else []
    if engine == "deepspeed":  # its own rules above refuse tp, pp and ep
        return out
    if ep > 1 and fsdp:
        out.append(LayoutProblem(
            "parallelism.sharding",
            f"ep ({ep}) with FSDP sharding is not supported by the engine: experts are sharded over the "
            "data-parallel ranks, which FSDP would shard again",
            "use sharding: none with expert parallelism, or ep: 1"))
    if ep > 1 and pp > 1:
        out.append(LayoutProblem(
            "parallelism.pp",
            f"ep ({ep}) with pipeline parallelism (pp={pp}) is not supported by the engine",
            "use pp: 1 with expert parallelism, or ep: 1"))
    return out + _model_problems(tp=tp, kv_heads=kv_heads)


def engine_choice_problems(engine: str, *, sharding: str | None, tp: int = 1, pp: int = 1,
                           ep: int = 1) -> list[LayoutProblem]:
    """What the chosen engine cannot run at all, whatever the model: `validate` checks these once per spec (script
    jobs included), the advisor through `engine_problems` for every layout it tries."""
    if engine == "deepspeed":
        return _deepspeed_problems(tp=tp, pp=pp, ep=ep, sharding=sharding)
    if sharding == "shard-optimizer":
        return [LayoutProblem(
            "parallelism.sharding",
            "shard-optimizer (ZeRO-1: optimizer state sharded, gradients and weights whole) runs on engine: "
            "deepspeed (its ZeRO stage 1); the native engine's FSDP2 has no such mode",
            "use engine: deepspeed, or sharding: shard-grad-op (FSDP2 shards the gradients too: less memory, the "
            "same traffic per step)")]
    return []


def _deepspeed_problems(*, tp: int, pp: int, ep: int, sharding: str | None) -> list[LayoutProblem]:
    out: list[LayoutProblem] = []
    if tp > 1 or pp > 1:
        out.append(LayoutProblem("parallelism.engine", "the deepspeed engine provides ZeRO data parallelism only",
                                 "use engine: native for tp/pp, or drop tp/pp"))
    if ep > 1:
        out.append(LayoutProblem("parallelism.engine", "expert parallelism is applied by the native engine only",
                                 "use engine: native for ep, or drop ep"))
    if sharding is not None and sharding not in DEEPSPEED_ZERO_STAGE:
        out.append(LayoutProblem(
            "parallelism.sharding",
            f"{sharding} is FSDP2's (the native engine); the deepspeed engine runs "
            + ", ".join(f"{s} (ZeRO-{z})" for s, z in DEEPSPEED_ZERO_STAGE.items()),
            "use sharding: full-shard on deepspeed, or engine: native"))
    return out


def _model_problems(*, tp: int, kv_heads: int | None) -> list[LayoutProblem]:
    out: list[LayoutProblem] = []
    if kv_heads is not None and tp > 1 and kv_heads % tp:
        out.append(LayoutProblem(
            "parallelism.tp",
            f"tp ({tp}) does not divide kv_heads ({kv_heads}): the engine shards KV heads over the tensor-parallel "
            "ranks and does not replicate them",
            f"use a tp that divides {kv_heads}"))
    return out


def uses_fsdp(sharding: str, dp: int) -> bool:
    """The planner's sharding name -> whether parameters are sharded over the data-parallel ranks."""
    return dp > 1 and sharding in ("shard-grad-op", "full-shard", "hybrid-shard")


class UnsupportedLayout(ValueError):
    """Raised by the engine on a layout `engine_problems` refuses (a planner bug if it ever reaches a worker)."""


def check_supported(**degrees: Any) -> None:
    """`engine_problems(**degrees)` as an exception, for the engine's own checks."""
    refused = engine_problems(**degrees)
    if refused:
        raise UnsupportedLayout("; ".join(f"{p.field}: {p.message} ({p.fix})" for p in refused))
