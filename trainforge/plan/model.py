"""Model shapes: the architecture numbers of a Llama-style decoder (dense or MoE) and what follows from them.

Parameter counts follow the Llama layout: per block, attention q/o (h*h each), k/v (h*h*kv/heads each), SwiGLU MLP
(3*h*f) or GELU MLP (2*h*f), two RMSNorm weights (2*h); plus token embedding (V*h), an untied output head (V*h) and a
final norm (h). MoE blocks hold `experts` copies of the MLP plus a router (h*experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from trainforge.spec import ModelSpec


def swiglu_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 * 4h rounded up to a multiple (Touvron et al. 2023, model.py)."""
    f = int(2 * 4 * hidden / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    experts: int = 0
    top_k: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_params(self) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * self.ffn_hidden

    @property
    def attention_params(self) -> int:
        kv = self.hidden * self.head_dim * self.kv_heads
        return 2 * self.hidden * self.hidden + 2 * kv

    @property
    def params_per_layer(self) -> int:
        mlp = self.mlp_params * max(1, self.experts) + (self.hidden * self.experts if self.experts else 0)
        return self.attention_params + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.params_per_layer + 2 * self.embedding_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters used per token (MoE: only top_k experts' MLPs)."""
        if not self.experts:
            return self.total_params
        per_layer = self.attention_params + self.mlp_params * self.top_k + self.hidden * self.experts + 2 * self.hidden
        return self.layers * per_layer + 2 * self.embedding_params + self.hidden


PRESETS: dict[str, ModelShape] = {
    # Llama 3.2 1B: 16 layers, 2048 hidden, 32 heads / 8 kv, ffn 8192, vocab 128256.
    "llama-1b": ModelShape("llama-1b", 16, 2048, 32, 8, 8192, 128256),
    # Llama 2 7B: 32 layers, 4096 hidden, 32 heads, ffn 11008, vocab 32000.
    "llama-7b": ModelShape("llama-7b", 32, 4096, 32, 32, 11008, 32000),
    # Llama 3 8B: 32 layers, 4096 hidden, 32 heads / 8 kv, ffn 14336, vocab 128256.
    "llama-8b": ModelShape("llama-8b", 32, 4096, 32, 8, 14336, 128256),
    # Llama 2 13B: 40 layers, 5120 hidden, 40 heads, ffn 13824, vocab 32000.
    "llama-13b": ModelShape("llama-13b", 40, 5120, 40, 40, 13824, 32000),
    # Llama 2/3 70B: 80 layers, 8192 hidden, 64 heads / 8 kv, ffn 28672, vocab 32000 (Llama 2).
    "llama-70b": ModelShape("llama-70b", 80, 8192, 64, 8, 28672, 32000),
    # A 200B dense model in the same family: 96 layers, 12288 hidden, 96 heads / 8 kv, ffn 49152 (~208B params).
    "llama-200b": ModelShape("llama-200b", 96, 12288, 96, 8, 49152, 128256),
    # Llama 3.1 405B: 126 layers, 16384 hidden, 128 heads / 8 kv, ffn 53248, vocab 128256.
    "llama-405b": ModelShape("llama-405b", 126, 16384, 128, 8, 53248, 128256),
    # The tiny CPU demo model (a few million parameters, byte-level vocab).
    "tiny": ModelShape("tiny", 4, 256, 8, 4, 768, 260),
}


def preset(name: str) -> ModelShape:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def shape_from_spec(spec: ModelSpec, name: str = "model") -> ModelShape:
    """Resolve a spec's model section (preset + overrides) into a full shape. Raises ValueError if incomplete."""
    base = preset(spec.preset) if spec.preset else None
    values = {f: getattr(spec, f) for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab")}
    if base is None:
        missing = [f for f in ("layers", "hidden", "heads", "vocab") if values[f] is None]
        if missing:
            raise ValueError(f"model needs a preset or {', '.join(missing)}")
        assert values["hidden"] is not None and values["heads"] is not None
        values["kv_heads"] = values["kv_heads"] or values["heads"]
        values["ffn_hidden"] = values["ffn_hidden"] or swiglu_ffn(values["hidden"])
        return ModelShape(name=name, experts=spec.experts, top_k=spec.top_k, **values)  # type: ignore[arg-type]
    overrides = {k: v for k, v in values.items() if v is not None}
    if spec.experts:
        overrides.update(experts=spec.experts, top_k=spec.top_k)
    return replace(base, name=spec.preset or name, **overrides)
