"""Mixture-of-experts feed-forward: top-k router, load-balancing loss, capacity factor, SwiGLU experts.

Shape legend: N tokens (B*S), D model width, F expert width, E experts, El experts held by this rank.
The experts' weights are stacked (E, D, F) so expert parallelism shards them on dim 0 (parallel/ep.py installs
`dispatch`, which sends each token to the rank holding its expert with all-to-all and brings the result back).
Without it every expert is local: the same code is the dense-routing reference.

Load-balancing loss: Switch Transformer (Fedus et al. 2021, eq. 4): coef * E * sum_e f_e * P_e, with f_e the
fraction of routed assignments and P_e the mean router probability of expert e.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""(tokens grouped by local expert, count per local expert) -> outputs in the same order."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.num_experts, self.top_k = cfg.experts, cfg.top_k
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn_hidden))
        self.w3 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn_hidden))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.ffn_hidden, cfg.hidden))
        self.aux_loss: torch.Tensor = torch.zeros(())
        # Replaced by parallel/ep.py: routes grouped tokens to the experts (local call when not expert-parallel).
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, ExpertFn], torch.Tensor] = _dispatch_local

    def expert_params(self) -> list[nn.Parameter]:
        return [self.w1, self.w3, self.w2]

    def run_experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        outs = [(F.silu(c @ w1[e]) * (c @ w3[e])) @ w2[e] for e, c in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        n, k, e = x.shape[0], self.top_k, self.num_experts
        probs = F.softmax(self.router(x).float(), dim=-1)  # N, E
        top_p, top_i = probs.topk(k, dim=-1)
        weights = (top_p / top_p.sum(-1, keepdim=True)).flatten()  # N*k
        expert_ids = top_i.flatten()
        token_ids = torch.arange(n, device=x.device).repeat_interleave(k)
        counts = torch.bincount(expert_ids, minlength=e)
        self.aux_loss = self.aux_loss_coef * e * (counts.float() / (n * k) * probs.mean(0)).sum()
        order = torch.argsort(expert_ids, stable=True)
        if self.capacity_factor is not None:
            # Keep the first `capacity` assignments of each expert (token order); the rest are dropped.
            capacity = math.ceil(self.capacity_factor * n * k / e)
            starts = torch.cumsum(counts, 0) - counts
            position = torch.arange(order.numel(), device=x.device) - starts[expert_ids[order]]
            order = order[position < capacity]
            counts = counts.clamp(max=capacity)
        out_sorted = self.dispatch(x[token_ids[order]], counts, self.run_experts)
        weighted = out_sorted * weights[order, None].to(out_sorted.dtype)
        out = torch.zeros_like(x).index_add(0, token_ids[order], weighted.to(x.dtype))
        return out.view_as(x_BSD)


def _dispatch_local(x_sorted: torch.Tensor, counts: torch.Tensor, experts: ExpertFn) -> torch.Tensor:
    return experts(x_sorted, counts.tolist())
