"""What the parallelism engine can run: one source of truth for the advisor, `validate` and the engine.

The planner used to accept layouts the engine refused at worker start (after the GPUs were granted): expert
parallelism with FSDP sharding, expert parallelism with pipeline stages, and a tensor-parallel degree that is a
multiple of the KV heads (the engine shards KV heads over TP ranks and does not replicate them). Each rule lives
here once; `plan.layout.layout_problems` reports it (so the advisor never returns such a layout and `validate`
rejects it before allocation), and the engine's own checks (`trainer/parallel/mesh.py` `ParallelDims`,
`trainer/parallel/tp.py`) raise with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LayoutProblem:
    field: str
    message: str
    fix: str


def engine_problems(*, tp: int = 1, pp: int = 1, ep: int = 1, fsdp: bool = False,
                    kv_heads: int | None = None) -> list[LayoutProblem]:
    """The rules of the parallelism engine that are not arithmetic (those are in `layout_problems`).
    `fsdp`: the data-parallel ranks shard parameters (shard-grad-op, full-shard, hybrid-shard with dp > 1).
    `kv_heads`: None where the caller does not know the model (the mesh), which skips that rule."""
    out: list[LayoutProblem] = []
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


def check_supported(**degrees: int | bool | None) -> None:
    """`engine_problems(**degrees)` as an exception, for the engine's own checks."""
    refused = engine_problems(**degrees)  # type: ignore[arg-type]
    if refused:
        raise UnsupportedLayout("; ".join(f"{p.field}: {p.message} ({p.fix})" for p in refused))
