"""The embedded dataset catalog: content-addressed versions in a local folder, with named refs.

Layout under `$TRAINFORGE_HOME/datasets/{name}/`:
  versions/{version_id}/manifest.json + shard files   (immutable once committed)
  refs/{ref}                                           (a branch or tag: the version id it points at)
A version is committed by writing its files into a temporary folder and renaming it into place, so a reader
never sees a half-written version.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainforge.datasets.manifest import MANIFEST_FILE, DatasetManifest, ShardInfo
from trainforge.home import home

NAME_OK = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")


@dataclass(frozen=True, slots=True)
class ResolvedDataset:
    """An immutable dataset version: what a run trains on and records."""

    ref: str
    name: str
    version: str
    license: str
    path: Path
    manifest: DatasetManifest


class CatalogError(LookupError):
    pass


class EmbeddedCatalog:
    def __init__(self, root: Path | None = None):
        self.root = (root or home() / "datasets").resolve()

    def _dir(self, name: str) -> Path:
        if not name or set(name) - NAME_OK:
            raise CatalogError(f"dataset name {name!r} may only use lowercase letters, digits, '-', '_' and '.'")
        return self.root / name

    def commit(self, name: str, build: Callable[[Path], list[ShardInfo]], *, sample_len: int, token_dtype: str,
               vocab_size: int, tokenizer: str, license: str, provenance: dict | None = None,
               ref: str = "main") -> ResolvedDataset:
        """Build a version in a temporary folder, then rename it into place and move `ref` to it."""
        base = self._dir(name)
        (base / "versions").mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=base / "versions"))
        try:
            shards = build(tmp)
            manifest = DatasetManifest(name=name, shards=tuple(shards), sample_len=sample_len,
                                       token_dtype=token_dtype, vocab_size=vocab_size, tokenizer=tokenizer,
                                       license=license, provenance=provenance or {})
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
            final = base / "versions" / manifest.version_id
            if final.exists():
                shutil.rmtree(tmp)  # same content already committed: versions are content-addressed
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.set_ref(name, ref, manifest.version_id)
        return self.resolve(name, manifest.version_id)

    def set_ref(self, name: str, ref: str, version: str) -> None:
        refs = self._dir(name) / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        tmp = refs / f".{ref}.tmp"
        tmp.write_text(version)
        os.replace(tmp, refs / ref)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def resolve(self, name: str, ref: str = "main") -> ResolvedDataset:
        base = self._dir(name)
        if not base.is_dir():
            known = ", ".join(self.names()) or "none"
            raise CatalogError(f"dataset {name!r} is not in the catalog at {self.root} (known: {known})")
        version = ref
        ref_file = base / "refs" / ref
        if ref_file.is_file():
            version = ref_file.read_text().strip()
        else:
            matches = [p.name for p in (base / "versions").iterdir() if p.name.startswith(ref)] if len(ref) >= 8 else []
            if len(matches) != 1:
                raise CatalogError(f"dataset {name!r} has no ref or version {ref!r}")
            version = matches[0]
        return load_version_dir(base / "versions" / version, f"catalog://{name}@{ref}")


def load_version_dir(path: Path, ref: str) -> ResolvedDataset:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CatalogError(f"{path} has no {MANIFEST_FILE}: not a committed dataset version")
    try:
        manifest = DatasetManifest.from_dict(json.loads(manifest_path.read_text()))
    except (ValueError, TypeError, KeyError) as exc:
        raise CatalogError(f"{manifest_path} is not a valid dataset manifest: {exc}") from None
    return ResolvedDataset(ref=ref, name=manifest.name, version=manifest.version_id, license=manifest.license,
                           path=path, manifest=manifest)
