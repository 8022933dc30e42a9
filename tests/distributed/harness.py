"""One rank of a layout-equivalence run (started by torchrun from conftest.run_layout; world 1 = the reference).

Argument: a JSON file {layout, model, steps, global_batch, seq_len, seed, out, save_at?, load_from?, grad_clip?}.
Builds the reference Llama from the seed, applies the layout with the engine's `parallelize`, trains on
deterministic synthetic tokens with AdamW through the production Engine's step (trainer/engine.py: NativeEngine,
DeepSpeedEngine; tests/distributed/test_train_loop.py runs loop.train itself), and writes per-step losses plus
this rank's full (gathered) weights.
Checkpoints go through the platform's Checkpointer (DCP) on a local object store.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from trainforge.infra.storage import open_store
from trainforge.trainer.checkpoint import Checkpointer
from trainforge.trainer.distributed import DistContext, shutdown
from trainforge.trainer.engine import DeepSpeedEngine, Engine, NativeEngine
from trainforge.trainer.models.llama import build_model
from trainforge.trainer.parallel.mesh import MeshAxis
from trainforge.trainer.parallel.parallelize import autocast, parallelize


def batch(step: int, cfg: dict, dp_rank: int, dp: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + step)
    tokens = torch.randint(0, cfg["model"]["vocab"], (cfg["global_batch"], cfg["seq_len"] + 1), generator=g)
    per = cfg["global_batch"] // dp
    mine = tokens[dp_rank * per:(dp_rank + 1) * per].split(cfg["layout"].get("micro_batch_size", 1))
    return [c[:, :-1] for c in mine], [c[:, 1:] for c in mine]


def engine_step(engine: Engine, cfg: dict, step: int) -> tuple[float, float | None]:
    """One step as loop.train makes it (forward/backward, the explicit staging wait, optimizer step, global loss),
    at the constant LR the reference uses: (loss, gradient norm before clipping)."""
    xs, ys = batch(step, cfg, engine.dp_rank, engine.dp_degree)
    local = engine.forward_backward(xs, ys)
    engine.wait_for_staging()
    norm = engine.step(cfg.get("lr", 1e-3))
    return engine.global_loss(local), norm


def run(cfg: dict, ctx: DistContext) -> None:
    torch.manual_seed(cfg["seed"])
    model = build_model({**cfg["model"], "max_seq_len": cfg["seq_len"]})
    layout = cfg["layout"]
    if layout.get("engine") == "deepspeed":
        return run_deepspeed(cfg, ctx, model)
    pm = parallelize(model, layout, world_size=ctx.world_size, rank=ctx.rank, device=ctx.device,
                     local_batch=cfg["global_batch"] // layout["dp"])
    opt = torch.optim.AdamW(pm.model.parameters(), lr=cfg.get("lr", 1e-3), weight_decay=0.1)
    ckpt = None
    if cfg.get("store"):
        ckpt = Checkpointer(ctx, open_store(cfg["store"]).scoped("job"), "job", Path(cfg["store_staging"]),
                            lambda *a: None, guard_optimizer=False)
    # The production engine's step (trainer/engine.py), the one loop.train drives.
    engine = NativeEngine(pm, opt, ckpt, cfg.get("grad_clip"), ctx.device)
    if layout.get("precision"):  # as NativeEngine.build sets it
        pm.precision_ctx = lambda: autocast(layout["precision"], ctx.device)
    start = 0
    if cfg.get("load") and ckpt is not None:
        ref, _ = ckpt.latest()
        assert ref is not None
        start = engine.restore(ref)
    losses, norms = [], []
    calls = _count_fsdp_collectives()
    fsdp_calls = []
    tp_bytes: dict[str, int] = {}
    tp_group = pm.mesh[MeshAxis.TP].get_group().group_name if pm.mesh is not None and pm.dims.tp > 1 else None
    for step in range(start, cfg["steps"]):
        calls.clear()
        calls.update(all_gather=0, reduce_scatter=0)
        with _TPBytes(tp_group, tp_bytes) if tp_group and cfg.get("count_tp") else contextlib.nullcontext():
            loss, norm = engine_step(engine, cfg, step)
        fsdp_calls.append(dict(calls))
        losses.append(loss)
        norms.append(norm)
        if ckpt is not None and step + 1 == cfg.get("save_at"):
            engine.save(step + 1, {"world_size": ctx.world_size})
    engine.close()
    sd = get_model_state_dict(pm.model, options=StateDictOptions(full_state_dict=True))
    out = Path(cfg["out"])
    torch.save({k: v.detach().clone() for k, v in sd.items()}, out / f"weights-{ctx.rank}.pt")
    if ctx.rank == 0:
        units = sum(isinstance(m, FSDPModule) for m in pm.model.modules())
        (out / "result.json").write_text(json.dumps({"losses": losses, "norms": norms, "kind": pm.kind,
                                                     "pipeline": pm.pipeline is not None,
                                                     "fsdp_units": units, "fsdp_calls": fsdp_calls,
                                                     "tp_bytes": tp_bytes}))
    del pm, model, opt, sd


class _TPBytes(TorchDispatchMode):
    """Bytes per dtype that the tensor-parallel collectives move (DTensor's functional all-gathers, reduce-scatters
    and all-reduces on the TP group, forward and backward: as CommDebugMode sees them, with their dtypes)."""

    OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")

    def __init__(self, group_name: str, into: dict[str, int]) -> None:
        super().__init__()
        self.group_name, self.into = group_name, into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in self.OPS and self.group_name in args:
            t = args[0]
            key = f"{name} {str(t.dtype).removeprefix('torch.')}"
            self.into[key] = self.into.get(key, 0) + t.numel() * t.element_size()
        return func(*args, **(kwargs or {}))


def _count_fsdp_collectives() -> dict[str, Any]:
    """Count FSDP2's all-gathers and reduce-scatters (one call per FSDP unit and collective) in this process."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    calls: dict[str, Any] = {"all_gather": 0, "reduce_scatter": 0}
    for cls, key in ((collectives.DefaultAllGather, "all_gather"), (collectives.DefaultReduceScatter,
                                                                     "reduce_scatter")):
        original = cls.__call__

        def counted(self, *args, _original=original, _key=key, **kwargs):  # type: ignore[no-untyped-def]
            inp = kwargs["input_tensor"] if "input_tensor" in kwargs else args[1]
            calls[_key] += 1
            calls[f"{_key}_dtypes"] = sorted({*calls.get(f"{_key}_dtypes", []), str(inp.dtype)})
            return _original(self, *args, **kwargs)

        cls.__call__ = counted  # type: ignore[method-assign]
    all_reduce = torch.distributed.all_reduce

    def counted_all_reduce(*args, **kwargs):  # type: ignore[no-untyped-def]
        if sys._getframe(1).f_code.co_name == "foreach_reduce":  # HSDP's all-reduce across replicas
            calls["all_reduce"] = calls.get("all_reduce", 0) + 1
        return all_reduce(*args, **kwargs)

    torch.distributed.all_reduce = counted_all_reduce
    return calls


def run_deepspeed(cfg: dict, ctx: DistContext, model: torch.nn.Module) -> None:
    from trainforge.trainer.parallel.deepspeed_engine import build_deepspeed

    training = {"global_batch_size": cfg["global_batch"], "grad_clip": cfg.get("grad_clip"), "precision": "fp32",
                "optimizer": {"lr": cfg.get("lr", 1e-3), "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}}
    ds = DeepSpeedEngine(build_deepspeed(model, cfg["layout"], training, ctx.world_size), None, ctx)
    engine = ds.engine
    losses, norms = [], []
    for step in range(cfg["steps"]):
        loss, norm = engine_step(ds, cfg, step)
        losses.append(loss)
        norms.append(norm)
    stage = engine.zero_optimization_stage()
    params = list(engine.module.parameters())
    # ZeRO-3 partitions the parameters themselves: gather the full tensors to compare them (a no-op under 1/2).
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        sizes = [p.numel() for p in params]
    torch.save(full, Path(cfg["out"]) / f"weights-{ctx.rank}.pt")
    if ctx.rank == 0:
        Path(cfg["out"], "result.json").write_text(json.dumps({
            "losses": losses, "norms": norms, "kind": "deepspeed", "pipeline": False, "zero_stage": stage,
            "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in engine.module.modules()),
            # what this rank holds of each parameter outside the gather: 0 elements under ZeRO-3 (partitioned)
            "local_numel": sum(p.numel() for p in params), "full_numel": sum(sizes)}))
    del engine, ds, model


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    ctx = DistContext.from_env(60)
    run(cfg, ctx)
    shutdown(ctx)


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()
