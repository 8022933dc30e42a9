"""The planner's eager-kernel bytes against the engine's own Llama block, counted.

`perf.eager_bytes_per_token` prices the non-matmul kernels of trainforge's block (trainer/models/llama.py), which
the engine runs eagerly: one kernel per aten op. Here the block runs forward and backward on meta tensors (shapes
only, no data) in bf16 under a dispatch mode that adds up, for every op that is not a matmul, a view or an
allocation, the bytes of its inputs and outputs: what that kernel reads and writes. Flash attention is a stand-in
whose output is laid out as flash attention's is ((b, s, heads, d) memory order), so transposing it back is a view;
the planner counts attention as matmul FLOPs. Recomputation goes through the engine's own `apply_ac`.
Run: pytest tests/unit/plan/test_engine_block.py -q
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the torch-free suite (`make test-pure`) skips this file

from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from trainforge.plan.comm import tp_recompute_collectives  # noqa: E402
from trainforge.plan.layout import Layout  # noqa: E402
from trainforge.plan.memory import activation_bytes_per_layer  # noqa: E402
from trainforge.plan.model import ModelShape  # noqa: E402
from trainforge.plan.perf import memory_bound_bytes_per_token  # noqa: E402
from trainforge.trainer.models import llama  # noqa: E402
from trainforge.trainer.parallel.activation_checkpointing import apply_ac  # noqa: E402

SEQ = 4096
MATMULS = {"mm", "addmm", "bmm"}
MOVE_NOTHING = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "select", "slice", "unbind", "split",
                "alias", "detach", "unsqueeze", "squeeze", "_reshape_alias", "empty_like", "empty_strided",
                "new_empty_strided", "empty", "new_empty", "zeros_like", "ones_like", "lift_fresh"}


class _Bytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ not in MATMULS | MOVE_NOTHING:
            self.total += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                              if isinstance(t, torch.Tensor))
        return out


class _FlashAttention(torch.autograd.Function):
    """Flash attention's layout and saves, without its arithmetic: the output is (b, heads, s, d) over (b, s, heads,
    d) memory (like q), and backward keeps q, k, v, the output and the fp32 log-sum-exp per head and token."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _OneBlock(nn.Module):
    def __init__(self, cfg: llama.LlamaConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": llama.Block(cfg)})
        cos, sin = llama.rope_tables(cfg.hidden // cfg.heads, cfg.max_seq_len, cfg.rope_theta)
        self.cos, self.sin = cos.to("meta"), sin.to("meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers["0"](x, self.cos, self.sin)


def _meta_block(shape: ModelShape, recompute: str, monkeypatch: pytest.MonkeyPatch,
                dtype: torch.dtype = torch.bfloat16) -> tuple[_OneBlock, torch.Tensor]:
    """The engine's block for `shape` on meta tensors, flash attention stood in for, recomputation applied by the
    engine's `apply_ac`; and an input of SEQ tokens."""
    cfg = llama.LlamaConfig(layers=1, hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads,
                            ffn_hidden=shape.ffn_hidden, vocab=shape.vocab, max_seq_len=SEQ)
    monkeypatch.setattr(llama.F, "scaled_dot_product_attention",
                        lambda q, k, v, is_causal=True: _FlashAttention.apply(q, k, v))
    with torch.device("meta"):
        model = _OneBlock(cfg).to(dtype)
        x = torch.empty(1, SEQ, shape.hidden, dtype=dtype, requires_grad=True)
    apply_ac(model, recompute)
    return model, x


def _forward_backward(model: nn.Module, x: torch.Tensor) -> None:
    y = model(x)
    y.backward(torch.empty_like(y))


def saved_storage_bytes(forward: Any, ignore: list[torch.Tensor]) -> tuple[int, Any]:
    """Bytes that `forward()` keeps for backward, and its output: every tensor saved (by an op, flash attention or a checkpoint
    holding its input), each storage once, `ignore`'s storages (parameters, tables) left out. DTensors count their
    local shard (the TP probe below uses it too)."""
    def storage(t: torch.Tensor) -> Any:
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()

    skip = {storage(t)._cdata for t in ignore}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage(t)._cdata not in skip:
            saved[storage(t)._cdata] = storage(t).nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return sum(saved.values()), out


def _counted_bytes_per_token(shape: ModelShape, recompute: str, monkeypatch: pytest.MonkeyPatch) -> float:
    model, x = _meta_block(shape, recompute, monkeypatch)
    counter = _Bytes()
    with counter:
        _forward_backward(model, x)
    return counter.total / SEQ


SHAPES = [
    ModelShape("mha", 1, 768, 12, 12, 2048, 32000),  # multi-head: no repeat of k and v
    ModelShape("gqa", 1, 1024, 16, 4, 2816, 32000),
    ModelShape("gqa-wide-heads", 1, 2048, 16, 2, 5504, 32000),
]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_eager_bytes_are_the_engine_blocks_own(shape: ModelShape, recompute: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _counted_bytes_per_token(shape, recompute, monkeypatch)
    priced = memory_bound_bytes_per_token(shape, Layout(dp=1, activation_checkpointing=recompute), SEQ,
                                          flash_attention=True, kernels="eager")
    # Left out of the price: per-token scalars (the norms' mean and rsqrt, ~130 B) and the norm weights' gradient.
    assert priced == pytest.approx(counted, rel=2e-3), (counted, priced)


def test_eager_kernels_move_several_times_the_fused_bytes() -> None:
    """Why it matters: for a 7B-wide block eager kernels move about 4x the bytes a fused engine's do."""
    shape = ModelShape("llama-7b-wide", 1, 4096, 32, 32, 11008, 32000)
    none = Layout(dp=1)
    eager = memory_bound_bytes_per_token(shape, none, SEQ, flash_attention=True, kernels="eager")
    fused = memory_bound_bytes_per_token(shape, none, SEQ, flash_attention=True)
    assert 3.5 < eager / fused < 5.0, eager / fused


class _Flops(TorchDispatchMode):
    """Matmul FLOPs (2 per multiply-add) of every mm the block runs, recomputation included."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket.__name__ == "mm":
            a, b = args[0], args[1]
            self.total += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return out


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_recomputed_flops_are_the_engine_blocks_own(recompute: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmul FLOPs the engine's block runs under each recomputation mode are what the planner charges the
    native engine. Left out on both sides: the attention core (a stand-in here; the planner's 12*h*s per token,
    plus 4*h*s recomputed) and the norms' weights (6 FLOPs per weight in the planner, elementwise in the engine)."""
    from trainforge.plan.perf import hardware_layer_flops_per_token

    shape = SHAPES[1]
    model, x = _meta_block(shape, recompute, monkeypatch)
    counter = _Flops()
    with counter:
        _forward_backward(model, x)
    h = shape.hidden
    core = 12.0 * h * SEQ + (4.0 * h * SEQ if recompute != "none" else 0.0)
    norms = 6.0 * 2 * h + (2.0 * 2 * h if recompute == "full" else 0.0)
    priced = hardware_layer_flops_per_token(shape, Layout(dp=1, activation_checkpointing=recompute), SEQ,
                                            engine="native")
    assert priced - core - norms == counter.total / SEQ


def _saved_bytes_per_token(shape: ModelShape, recompute: str, dtype: torch.dtype,
                           monkeypatch: pytest.MonkeyPatch) -> float:
    """Bytes the block keeps for backward after its forward, per token (`saved_storage_bytes`)."""
    model, x = _meta_block(shape, recompute, monkeypatch, dtype)
    return saved_storage_bytes(lambda: model(x), [*model.parameters(), model.cos, model.sin])[0] / SEQ


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_saved_activations_are_the_engine_blocks_own(shape: ModelShape, recompute: str, precision: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    counted = _saved_bytes_per_token(shape, recompute, dtype, monkeypatch)
    priced, _ = activation_bytes_per_layer(shape, Layout(dp=1, activation_checkpointing=recompute), SEQ, precision,
                                           engine="native")
    # Left out of the price: the norms' per-token rsqrt (4 B each).
    assert priced / SEQ == pytest.approx(counted, rel=2e-3, abs=16), (counted, priced / SEQ)


_TP_PROBE = """
import json, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from trainforge.trainer.models import llama
from trainforge.trainer.parallel.activation_checkpointing import apply_ac
from trainforge.trainer.parallel.tp import apply_tp
tp, s, (h, heads, kv, f) = 2, 64, json.loads(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)  # shapes only: collectives do nothing
mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
sys.path.insert(0, ".")
from torch.utils._python_dispatch import TorchDispatchMode
from tests.unit.plan.test_engine_block import _FlashAttention, saved_storage_bytes
llama.F.scaled_dot_product_attention = lambda q, k, v, is_causal=True: _FlashAttention.apply(q, k, v)

class Collectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._overloadpacket.__name__ in (
                "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            self.count += 1
        return func(*args, **(kwargs or {}))

out, collectives = {}, {}
for recompute in ("none", "selective", "full"):
    cfg = llama.LlamaConfig(layers=1, hidden=h, heads=heads, kv_heads=kv, ffn_hidden=f, vocab=64, max_seq_len=s)
    model = llama.Llama(cfg).to(torch.bfloat16)
    apply_tp(model, mesh, loss_parallel=False)
    apply_ac(model, recompute)
    x = torch.randn(1, s // tp, h, dtype=torch.bfloat16, requires_grad=True)  # sequence-parallel: this rank's shard
    counter = Collectives()
    with counter:
        saved, y = saved_storage_bytes(lambda: model.layers["0"](x, model.rope_cos, model.rope_sin),
                                       [*model.parameters(), model.rope_cos, model.rope_sin])
        y.backward(torch.ones_like(y))
    out[recompute] = saved / s
    collectives[recompute] = counter.count
print(json.dumps({"saved": out, "collectives": collectives}))
"""


def test_saved_activations_under_tensor_parallelism_are_the_engine_blocks_own() -> None:
    """tp 2 with sequence parallelism, the engine's TP plan on a fake process group (in a subprocess: it sets up
    torch.distributed): the norms' tensors and the attention's and MLP's are split by t, the projections' inputs,
    all-gathered, are not; a checkpoint keeps its input before the all-gather. And the TP collectives one block
    makes in forward and backward, recomputation included, are the ones plan/comm.py charges."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    shape = ModelShape("tp-gqa", 1, 256, 8, 4, 512, 64)
    done = subprocess.run([sys.executable, "-c", _TP_PROBE, json.dumps([256, 8, 4, 512])],
                          cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counted = json.loads(done.stdout.strip().splitlines()[-1])
    for recompute, n in counted["collectives"].items():  # forward + backward of one block
        assert n == 8 + tp_recompute_collectives(recompute, "native"), (recompute, n)
    for recompute, per_token in counted["saved"].items():
        priced, _ = activation_bytes_per_layer(shape, Layout(dp=2, tp=2, activation_checkpointing=recompute), 64,
                                               "bf16", engine="native")
        assert priced / 64 == pytest.approx(per_token, rel=2e-3, abs=16), (recompute, per_token, priced / 64)
