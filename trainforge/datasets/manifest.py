"""Dataset manifests: what a dataset version is. Pure: no I/O.

A version id is the sha256 of the manifest's canonical JSON, and the manifest lists every shard with its sha256,
so a version id pins the exact bytes trained on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_FILE = "manifest.json"
_OPTIONAL_KEYS = ("features",)
FEATURE_DTYPES = ("bfloat16", "float16")


def canonical_json(d: dict[str, Any]) -> str:
    """The one JSON form a manifest is hashed in (sorted keys, no spaces)."""
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def content_id(d: dict[str, Any]) -> str:
    """A version id: the sha256 of a manifest's canonical JSON."""
    return hashlib.sha256(canonical_json(d).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ShardInfo:
    file: str
    num_samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class DatasetManifest:
    name: str
    shards: tuple[ShardInfo, ...]
    sample_len: int
    """Tokens per stored sample (seq_len + 1: inputs and next-token targets)."""
    token_dtype: str
    vocab_size: int
    tokenizer: str
    license: str
    provenance: dict[str, Any] = field(default_factory=dict)
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Optional per-sample feature columns: name -> {"dtype": "bfloat16"|"float16", "dim": int}, stored as
    fixed-size lists of 16-bit words next to `tokens`. Omitted from the canonical JSON when empty, so the version
    ids of datasets written before feature columns existed do not change."""

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = [asdict(s) for s in self.shards]
        for key in _OPTIONAL_KEYS:
            if not d[key]:
                del d[key]  # absent == empty: keeps older version ids stable
        return d

    def canonical_json(self) -> str:
        return canonical_json(self.to_dict())

    @property
    def version_id(self) -> str:
        return content_id(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetManifest:
        shards = tuple(ShardInfo(**s) for s in d["shards"])
        return cls(**{**d, "shards": shards})

    def shard_offsets(self) -> list[int]:
        """Global index of each shard's first sample."""
        out, acc = [], 0
        for s in self.shards:
            out.append(acc)
            acc += s.num_samples
        return out
