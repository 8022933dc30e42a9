"""Model shapes: the architecture numbers of a Llama-style decoder (dense or MoE) and what follows from them.

Parameter counts follow the Llama layout: per block, attention q/o (h*h each), k/v (h*h*kv/heads each), SwiGLU MLP
(3*h*f) or GELU MLP (2*h*f), two RMSNorm weights (2*h); plus token embedding (V*h), an untied output head (V*h) and a
final norm (h). MoE blocks hold `experts` copies of the MLP plus a router (h*experts).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

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
    tied_embeddings: bool = False
    """Input embedding and output head share one matrix (GPT-2/Megatron GPT, BLOOM)."""
    measured_layer_params: int = 0
    """Parameters per block counted on a real module (plan/module_shape.py shape_from_module); 0 = computed from the numbers."""
    measured_total_params: int = 0
    """Total parameters counted on a real module; 0 = computed from the numbers."""

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
        if self.measured_layer_params:
            return self.measured_layer_params
        mlp = self.mlp_params * max(1, self.experts) + (self.hidden * self.experts if self.experts else 0)
        return self.attention_params + mlp + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Output projection parameters (shared with the embedding when tied, but still a matmul)."""
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        if self.measured_total_params:
            return self.measured_total_params
        head = 0 if self.tied_embeddings else self.head_params
        return self.layers * self.params_per_layer + self.embedding_params + head + self.hidden

    @property
    def largest_unit_params(self) -> int:
        """The biggest block gathered at once under full sharding (a transformer block or the embedding)."""
        return max(self.params_per_layer, self.embedding_params)

    def model_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation: 6 x (matmul parameters used per token)
        + 12 x layers x hidden x seq (attention scores and values, counted without the causal half, as in
        PaLM appendix B and Megatron's 96*B*s*l*h^2*(1 + s/6h + V/16lh) with the recompute pass removed)."""
        matmul_params = self.active_params - self.embedding_params  # the embedding is a lookup, not a matmul
        if self.tied_embeddings:
            matmul_params += self.head_params
        return 6.0 * matmul_params + 12.0 * self.layers * self.hidden * seq_len

    def layer_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token of one block (active experts only)."""
        return 6.0 * self.active_layer_params + 12.0 * self.hidden * seq_len

    @property
    def active_layer_params(self) -> int:
        if not self.experts:
            return self.params_per_layer
        return self.attention_params + self.mlp_params * self.top_k + self.hidden * self.experts + 2 * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters used per token (MoE: only top_k experts' MLPs)."""
        if not self.experts:
            return self.total_params
        head = 0 if self.tied_embeddings else self.head_params
        return self.layers * self.active_layer_params + self.embedding_params + head + self.hidden


PRESETS: dict[str, ModelShape] = {
    # Llama 3.2 1B: 16 layers, 2048 hidden, 32 heads / 8 kv, ffn 8192, vocab 128256, tied embeddings (1.24B).
    "llama-1b": ModelShape("llama-1b", 16, 2048, 32, 8, 8192, 128256, tied_embeddings=True),
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


MODEL_FILE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "mlp", "vocab", "seq_len", "experts",
                     "top_k", "tied_embeddings", "name")


def shape_from_mapping(doc: dict[str, Any], name: str = "model") -> tuple[ModelShape, int | None]:
    """A shape from architecture numbers (the `--model FILE` format); returns (shape, seq_len or None)."""
    unknown = sorted(set(doc) - set(MODEL_FILE_FIELDS))
    if unknown:
        raise ValueError(f"unknown model field(s) {', '.join(unknown)}; known: {', '.join(MODEL_FILE_FIELDS)}")
    missing = [f for f in ("layers", "hidden", "heads", "vocab") if f not in doc]
    if missing:
        raise ValueError(f"model description needs {', '.join(missing)}")
    hidden, heads = int(doc["hidden"]), int(doc["heads"])
    mlp = doc.get("mlp", "swiglu")
    if mlp not in ("swiglu", "gelu"):
        raise ValueError(f"mlp must be swiglu or gelu, not {mlp!r}")
    ffn = doc.get("ffn_hidden") or (swiglu_ffn(hidden) if mlp == "swiglu" else 4 * hidden)
    shape = ModelShape(
        name=str(doc.get("name", name)), layers=int(doc["layers"]), hidden=hidden, heads=heads,
        kv_heads=int(doc.get("kv_heads") or heads), ffn_hidden=int(ffn), vocab=int(doc["vocab"]), mlp=mlp,
        experts=int(doc.get("experts", 0)), top_k=int(doc.get("top_k", 0)),
        tied_embeddings=bool(doc.get("tied_embeddings", False)),
    )
    if shape.experts and not 1 <= shape.top_k <= shape.experts:
        raise ValueError(f"top_k ({shape.top_k}) must be between 1 and experts ({shape.experts})")
    if hidden % heads or heads % shape.kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({shape.kv_heads})")
    seq = doc.get("seq_len")
    return shape, (int(seq) if seq else None)


def resolve_model(arg: str) -> tuple[ModelShape, int | None]:
    """`--model` argument: a preset name, or a YAML/JSON file of architecture numbers."""
    if arg in PRESETS:
        return PRESETS[arg], None
    path = Path(arg)
    if not path.is_file():
        raise ValueError(f"--model {arg!r} is neither a preset ({', '.join(PRESETS)}) nor a file")
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{arg}: a model description must be a mapping of architecture numbers")
    return shape_from_mapping(doc, path.stem)
