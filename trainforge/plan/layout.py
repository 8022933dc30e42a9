"""A parallel layout (degrees, micro-batch, schedule, sharding) and the divisibility rules it must obey.

`layout_problems` is pure and returns every broken rule with the numbers, so dry-run validation can report all
of them at once and the advisor can reject a candidate without raising.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainforge.plan.model import ModelShape
from trainforge.plan.support import LayoutProblem, engine_problems, uses_fsdp

__all__ = ["Layout", "LayoutProblem", "gradient_accumulation_steps", "layout_problems"]


@dataclass(frozen=True, slots=True)
class Layout:
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    sharding: str = "none"
    activation_checkpointing: str = "none"

    @property
    def world_size(self) -> int:
        # Expert parallelism is folded into the data-parallel ranks (torchtitan's convention): it does not
        # multiply the world size.
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        parts += [f"mb={self.micro_batch_size}", f"sharding={self.sharding}", f"ac={self.activation_checkpointing}"]
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        return ",".join(parts)


def gradient_accumulation_steps(layout: Layout, global_batch_size: int) -> int:
    """Micro-batches per optimizer step per data-parallel rank (pipeline micro-batches included)."""
    return global_batch_size // (layout.dp * layout.micro_batch_size)


def interleaved_micro_batches_ok(micro_batches: int, pp: int, vpp: int) -> bool:
    """Whether m micro-batches (m >= pp) run on torch's interleaved 1F1B as the planner prices them: m + (p-1)/v
    slots and min(m, p + (p-1)/v) micro-batches in flight. A multiple of pp does; so does any m up to p + (p-1)/v
    (one round: every micro-batch is in flight, as priced). Otherwise torch's flexible rounds warm up more
    micro-batches than the memory model holds, or its constructor refuses m (tests/unit/plan/
    test_pipeline_schedules.py simulates torch's own action lists)."""
    return micro_batches % pp == 0 or micro_batches <= pp + (pp - 1) / vpp


def layout_problems(
    layout: Layout,
    model: ModelShape,
    *,
    global_batch_size: int,
    world_size: int,
    gpus_per_node: int,
    uneven_stages: bool = False,
    engine: str | None = None,
) -> list[LayoutProblem]:
    """Every divisibility / topology rule the layout breaks, with the numbers. `uneven_stages` accepts pipeline
    stages that hold different numbers of blocks (Llama 3 405B: 126 layers on 16 stages, sec. 3.3.2). `engine`:
    also what that engine cannot run (None: the caller checks the engine choice itself, as `validate` does)."""
    out: list[LayoutProblem] = []
    if layout.world_size != world_size:
        out.append(LayoutProblem(
            "parallelism",
            f"dp({layout.dp}) * tp({layout.tp}) * pp({layout.pp}) = {layout.world_size} != world size ({world_size})",
            "make the product of the degrees equal resources.min_gpus, or leave a degree unset for the planner",
        ))
    if model.heads % layout.tp:
        out.append(LayoutProblem("parallelism.tp", f"tp ({layout.tp}) does not divide attention heads ({model.heads})",
                                 f"use a tp that divides {model.heads}"))
    if layout.tp > gpus_per_node:
        out.append(LayoutProblem("parallelism.tp", f"tp ({layout.tp}) exceeds GPUs per node ({gpus_per_node}); "
                                 "tensor parallelism needs NVLink within one node",
                                 f"use tp <= {gpus_per_node} and add pipeline or data parallelism"))
    elif gpus_per_node % layout.tp:
        out.append(LayoutProblem("parallelism.tp", f"tp ({layout.tp}) does not divide GPUs per node ({gpus_per_node})",
                                 "use a tp that divides the node size so TP groups never straddle nodes"))
    chunks = layout.pp * layout.vpp
    if uneven_stages and chunks > model.layers:
        out.append(LayoutProblem("parallelism.pp", f"{chunks} pipeline chunks exceed layers ({model.layers})",
                                 f"use at most {model.layers} stages x virtual stages"))
    elif not uneven_stages and model.layers % chunks:
        what = f"pp ({layout.pp})" + (f" * virtual stages ({layout.vpp})" if layout.vpp > 1 else "")
        out.append(LayoutProblem("parallelism.pp", f"{what} = {chunks} does not divide layers ({model.layers})",
                                 f"use a stage count that divides {model.layers}"))
    if layout.ep > 1:
        if not model.experts:
            out.append(LayoutProblem("parallelism.ep", f"ep ({layout.ep}) is set but the model has no experts",
                                     "remove ep or set model.experts"))
        elif model.experts % layout.ep:
            out.append(LayoutProblem("parallelism.ep", f"ep ({layout.ep}) does not divide experts ({model.experts})",
                                     f"use an ep that divides {model.experts}"))
        if layout.dp % layout.ep:
            out.append(LayoutProblem("parallelism.ep", f"ep ({layout.ep}) does not divide dp ({layout.dp})",
                                     "expert parallelism borrows data-parallel ranks; pick ep dividing dp"))
    out += engine_problems(tp=layout.tp, pp=layout.pp, ep=layout.ep, fsdp=uses_fsdp(layout.sharding, layout.dp),
                           kv_heads=model.kv_heads if model.heads % layout.tp == 0 else None, engine=engine,
                           sharding=layout.sharding)
    per_step = layout.dp * layout.micro_batch_size
    if global_batch_size % per_step:
        out.append(LayoutProblem(
            "training.global_batch_size",
            f"global batch ({global_batch_size}) is not a multiple of dp ({layout.dp}) * micro-batch "
            f"({layout.micro_batch_size}) = {per_step}",
            f"use a global batch that is a multiple of {per_step}, or change the micro-batch size",
        ))
    elif layout.pp > 1 and gradient_accumulation_steps(layout, global_batch_size) < layout.pp:
        n = gradient_accumulation_steps(layout, global_batch_size)
        out.append(LayoutProblem(
            "parallelism.micro_batch_size",
            f"{n} micro-batches per step is fewer than pp ({layout.pp}) stages; the pipeline would be mostly bubble",
            f"raise the global batch or lower the micro-batch so there are at least {layout.pp} (ideally "
            f">= {4 * layout.pp})",
        ))
    elif (layout.pp > 1 and layout.vpp > 1
          and not interleaved_micro_batches_ok(gradient_accumulation_steps(layout, global_batch_size),
                                               layout.pp, layout.vpp)):
        n = gradient_accumulation_steps(layout, global_batch_size)
        out.append(LayoutProblem(
            "parallelism.virtual_stages",
            f"interleaved 1F1B needs the micro-batches per step ({n}) to be a multiple of pp ({layout.pp}), or at "
            f"most pp + (pp-1)/v = {layout.pp + (layout.pp - 1) / layout.vpp:g}",
            f"pick a global batch / micro-batch giving a multiple of {layout.pp} micro-batches, or virtual_stages: 1",
        ))
    if layout.vpp > 1 and layout.schedule != "interleaved-1f1b":
        out.append(LayoutProblem("parallelism.virtual_stages", f"virtual stages ({layout.vpp}) need the "
                                 f"interleaved-1f1b schedule, not {layout.schedule}", "set virtual_stages: 1"))
    if layout.sharding == "hybrid-shard":
        group = math.gcd(layout.dp, max(1, gpus_per_node // (layout.tp * layout.pp)))
        if not 1 < group < layout.dp:
            out.append(LayoutProblem(
                "parallelism.sharding",
                f"hybrid-shard shards over the data-parallel ranks of one node ({group}) and replicates across "
                f"nodes; with dp ({layout.dp}), tp ({layout.tp}), pp ({layout.pp}) that is "
                + ("no sharding" if group <= 1 else "the same as full-shard"),
                "use full-shard (or shard-grad-op)",
            ))
    return out
