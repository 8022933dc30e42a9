"""A Llama-style decoder: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP.

Shape legend: B batch, S sequence, D model width, H heads, K kv heads, E head dim, V vocab.
`build_model(config)` is the managed-mode entrypoint: it takes the spec's resolved model numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    experts: int = 0
    """Mixture-of-experts FFN in every block when > 0 (models/moe.py)."""
    top_k: int = 0
    capacity_factor: float | None = None
    """Expert capacity = ceil(factor * tokens * top_k / experts); None = no token is dropped."""
    aux_loss_coef: float = 0.01


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)  # S, E/2
    return angles.cos(), angles.sin()


def apply_rope(x_BSHE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BSHE.float().unflatten(-1, (-1, 2)).unbind(-1)
    s = x_BSHE.shape[1]
    c, si = cos[:s, None, :], sin[:s, None, :]
    out = torch.stack((x1 * c - x2 * si, x1 * si + x2 * c), dim=-1).flatten(-2)
    return out.type_as(x_BSHE)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        # Head counts come from the weights so tensor parallelism (which shards wq/wk/wv) needs no model changes.
        q = self.wq(x_BSD).view(b, s, -1, self.head_dim)
        k = self.wk(x_BSD).view(b, s, -1, self.head_dim)
        v = self.wv(x_BSD).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        if cfg.experts:
            from trainforge.trainer.models.moe import MoEFeedForward

            self.feed_forward: nn.Module = MoEFeedForward(cfg)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        # A ModuleDict keyed by layer number keeps checkpoint keys stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.hidden // cfg.heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2/Llama-style init: N(0, 0.02), output projections scaled by 1/sqrt(2*layers)."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("router.weight"):
                nn.init.normal_(p, std=std)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens_BS: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens_BS) if self.tok_embeddings is not None else tokens_BS
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the MoE load-balancing losses of the last forward (0 for a dense model)."""
        return sum((m.aux_loss for m in self.modules() if hasattr(m, "aux_loss") and not callable(m.aux_loss)),
                   start=0.0)

    def pipeline_chunk(self, layer_ids: list[str], first: bool, last: bool) -> Llama:
        """A pipeline stage sharing this model's modules: the given layers, plus the embedding on the first stage
        and the final norm and output on the last. Keys stay those of the full model (ModuleDict by index)."""
        chunk = Llama.__new__(Llama)
        nn.Module.__init__(chunk)
        chunk.config = self.config
        chunk.tok_embeddings = self.tok_embeddings if first else None
        chunk.layers = nn.ModuleDict({i: self.layers[i] for i in layer_ids})
        chunk.norm = self.norm if last else None
        chunk.output = self.output if last else None
        chunk.register_buffer("rope_cos", self.rope_cos, persistent=False)
        chunk.register_buffer("rope_sin", self.rope_sin, persistent=False)
        return chunk

    def keep_only(self, layer_ids: set[str], first: bool, last: bool) -> None:
        """Drop what this pipeline rank does not own, so the optimizer and checkpoint see only its part."""
        for i in [k for k in self.layers if k not in layer_ids]:
            del self.layers[i]
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = self.output = None


def build_model(config: dict[str, Any]) -> Llama:
    """Managed-mode entrypoint: the resolved model numbers of the spec -> the model (on the current device)."""
    cfg = LlamaConfig(
        layers=config["layers"], hidden=config["hidden"], heads=config["heads"], kv_heads=config["kv_heads"],
        ffn_hidden=config["ffn_hidden"], vocab=config["vocab"], max_seq_len=config.get("max_seq_len", 2048),
        experts=config.get("experts", 0), top_k=config.get("top_k", 0),
        capacity_factor=config.get("capacity_factor"), aux_loss_coef=config.get("aux_loss_coef", 0.01),
    )
    return Llama(cfg)
