"""Expert parallelism: each rank of the ep group holds num_experts / ep experts; tokens travel by all-to-all.

Dispatch (per MoE layer, forward): exchange per-expert token counts (all_to_all_single on an (E,) tensor), then
the tokens themselves with uneven splits (`all_to_all_single_autograd`, whose backward is the reverse all-to-all),
regroup them by local expert, run the experts, undo the regrouping and send the results back. gloo on CPU has
all_to_all_single with uneven splits, so no emulation is needed.

Gradients (EP + DP, no DDP wrapper): dense parameters are averaged over every data-parallel rank; an expert's
gradient already holds the contributions of every rank of its ep group (through the all-to-all backward), so it
is summed over the replicas of that expert shard (the dp_mod_ep axis) and divided by dp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainforge.trainer.models.moe import ExpertFn, MoEFeedForward
from trainforge.trainer.parallel.mesh import MeshAxis


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def expert_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in moe_layers(model) for p in m.expert_params()}


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over the mesh's ep axis (as DTensors, so DCP sees global shapes)."""
    ep_mesh = mesh[MeshAxis.EP]
    ep = ep_mesh.size()
    for layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ValueError(f"ep ({ep}) does not divide the number of experts ({layer.num_experts})")
        for name in ("w1", "w3", "w2"):
            full = getattr(layer, name)
            setattr(layer, name, nn.Parameter(distribute_tensor(full.data, ep_mesh, [Shard(0)])))
        group = ep_mesh.get_group()
        layer.dispatch = lambda x, counts, experts, g=group, n=ep: dispatch_all_to_all(x, counts, experts, g, n)


def dispatch_all_to_all(x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertFn,
                        group: dist.ProcessGroup, ep: int) -> torch.Tensor:
    """x_sorted: this rank's assignments grouped by global expert id; counts: (E,) assignments per expert."""
    local_experts = counts.numel() // ep
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [src, local expert] counts for my experts
    recv = recv_counts.view(ep, local_experts)
    send_splits = counts.view(ep, local_experts).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    x_recv = funcol.wait_tensor(funcol.all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group))
    # Received order is (source rank, local expert); the experts want (local expert, source rank).
    starts = (torch.cumsum(recv.flatten(), 0) - recv.flatten()).view(ep, local_experts)
    perm = torch.cat([torch.arange(int(starts[s, e]), int(starts[s, e] + recv[s, e]))
                      for e in range(local_experts) for s in range(ep)]).long()
    y = experts(x_recv[perm], recv.sum(0).tolist())
    y_back = y[torch.argsort(perm)]
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(y_back, send_splits, recv_splits, group))


def sync_ep_grads(model: nn.Module, mesh: DeviceMesh) -> None:
    """The data-parallel gradient reduction of an EP + DP model (see the module docstring)."""
    experts = expert_param_ids(model)
    dp_group, replica_group = mesh[MeshAxis.DP].get_group(), mesh[MeshAxis.DP_MOD_EP].get_group()
    dp, replicas = mesh[MeshAxis.DP].size(), mesh[MeshAxis.DP_MOD_EP].size()
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        if id(p) in experts:
            if replicas > 1:
                dist.all_reduce(g, group=replica_group)
        elif dp > 1:
            dist.all_reduce(g, group=dp_group)
        g.div_(dp)
