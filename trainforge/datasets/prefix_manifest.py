"""An in-place dataset version: the objects under an s3:// prefix, pinned. Pure: no I/O.

The manifest lists every object trained on with its size, ETag and (where the bucket keeps versions) version id,
plus how the objects are read (format, text field, chunk size). Its digest is the version id, so a version id pins
the exact bytes as the object store identifies them: a read checks the pinned version id or ETag, and a changed
object fails the read instead of training on other data (`datasets.inplace`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from trainforge.datasets.chunks import Chunk, plan_chunks
from trainforge.datasets.manifest import content_id

KIND = "s3-prefix"
Format = Literal["jsonl", "text", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "text", "parquet")
DEFAULT_CHUNK_BYTES = 4 << 20
"""4 MiB: about a million tokens of English per chunk, so a chunk's dropped tail (less than one sample) is noise,
and a ranged GET is long enough to run at the link's rate."""
SUFFIXES: dict[str, tuple[str, ...]] = {"jsonl": (".jsonl", ".json", ".ndjson"), "text": (".txt", ".text"),
                                        "parquet": (".parquet", ".pq")}


@dataclass(frozen=True, slots=True)
class SourceObject:
    key: str
    """The object's key in the bucket (the full key, not relative to the prefix)."""
    size: int
    etag: str
    version_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrefixManifest:
    name: str
    source: str
    """`s3://bucket/prefix` (the prefix the objects were listed under, without the pattern)."""
    pattern: str
    """Glob the keys (relative to the prefix) matched; empty = every key with the format's suffix."""
    format: str
    text_field: str
    """The JSON field (jsonl) or column (parquet) holding a document's text; unused for text."""
    license: str
    chunk_bytes: int
    versioned: bool
    """Whether the bucket kept versions when the prefix was pinned (reads then go by version id)."""
    objects: tuple[SourceObject, ...]

    kind = KIND

    @property
    def bucket(self) -> str:
        return self.source.removeprefix("s3://").partition("/")[0]

    @property
    def prefix(self) -> str:
        return self.source.removeprefix("s3://").partition("/")[2]

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    def chunks(self) -> list[Chunk]:
        return plan_chunks([o.size for o in self.objects], self.chunk_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["objects"] = [{k: v for k, v in asdict(o).items() if v is not None} for o in self.objects]
        d["kind"] = KIND
        return d

    @property
    def version_id(self) -> str:
        return content_id(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrefixManifest:
        if d.get("kind") != KIND:
            raise ValueError(f"not an in-place dataset manifest (kind {d.get('kind')!r})")
        objects = tuple(SourceObject(**o) for o in d["objects"])
        fields = {k: v for k, v in d.items() if k not in ("kind", "objects")}
        return cls(**fields, objects=objects)


def is_prefix_manifest(d: dict[str, Any]) -> bool:
    return d.get("kind") == KIND


def split_ref(ref: str) -> tuple[str, str, str]:
    """`s3://bucket/prefix[/glob]` -> (bucket, prefix, pattern): the prefix ends before the first path segment
    holding a glob character (`*?[`); the rest is the pattern the relative keys must match."""
    if not ref.startswith("s3://"):
        raise ValueError(f"not an s3:// reference: {ref!r}")
    bucket, _, path = ref.removeprefix("s3://").partition("/")
    parts = [p for p in path.split("/") if p]
    cut = next((i for i, p in enumerate(parts) if set(p) & set("*?[")), len(parts))
    return bucket, "/".join(parts[:cut]), "/".join(parts[cut:])


def matches(relative_key: str, pattern: str, fmt: str) -> bool:
    """Whether a key (relative to the prefix) belongs to the dataset: the pattern if given, else the format's
    suffixes. Keys ending in '/' (folder markers) and hidden files (a segment starting with '.' or '_', as Spark
    and Hadoop write `_SUCCESS`) never do."""
    if not relative_key or relative_key.endswith("/"):
        return False
    if any(seg.startswith((".", "_")) for seg in relative_key.split("/")):
        return False
    if pattern:
        return fnmatch.fnmatchcase(relative_key, pattern)
    return relative_key.lower().endswith(SUFFIXES[fmt])


def derived_name(bucket: str, prefix: str) -> str:
    """A catalog name for a prefix: `s3.{bucket}.{prefix}` in the catalog's alphabet (lowercase, '-' for others)."""
    raw = f"s3.{bucket}.{prefix.strip('/').replace('/', '.')}".rstrip(".").lower()
    return re.sub(r"[^a-z0-9._-]", "-", raw)[:200]
