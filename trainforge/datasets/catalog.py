"""The embedded dataset catalog: content-addressed versions in an ObjectStore, with branches and tags.

Keys, relative to the catalog's store (a local folder `$TRAINFORGE_HOME/datasets` by default, or any store given
by `TRAINFORGE_DATASETS_URL`, e.g. `s3://bucket/datasets`):
  {name}/versions/{version_id}/manifest.json + shard files   (immutable once committed)
  {name}/refs/{branch}                                       (a moving pointer: the version id)
  {name}/tags/{tag}                                          (an immutable pointer, written if-none-match)
  {name}/quality/{version_id}.json                           (the quality-gate report of a version)
A version is committed by writing its shards first and its manifest last (on a local store: a temporary folder
renamed into place), so a reader, which only trusts a version whose manifest exists, never sees half of one.
Versions in a remote store resolve to a local folder holding the manifest and `source.json` (where the shards
are); `stream.open_reader` streams such shards through the cache tiers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.datasets import tokenizer
from trainforge.datasets.manifest import MANIFEST_FILE, DatasetManifest, ShardInfo
from trainforge.datasets.prefix_manifest import PrefixManifest, is_prefix_manifest
from trainforge.home import home
from trainforge.infra.storage import (
    LocalObjectStore,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStore,
    open_store,
)

NAME_OK = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
SOURCE_FILE = "source.json"
DATASETS_URL_ENV = "TRAINFORGE_DATASETS_URL"


@dataclass(frozen=True, slots=True)
class ResolvedDataset:
    """An immutable dataset version: what a run trains on and records."""

    ref: str
    name: str
    version: str
    license: str
    path: Path
    manifest: DatasetManifest | PrefixManifest
    """Tokenized shards (DatasetManifest), or the pinned objects of an s3:// prefix read in place."""

    @property
    def in_place(self) -> bool:
        return isinstance(self.manifest, PrefixManifest)


class CatalogError(LookupError):
    pass


class DatasetWithdrawn(CatalogError):
    """The version a reference resolves to was withdrawn (`trainforge lineage withdraw`): no job may train on it.
    `reason` says which version, who withdrew it, when and why; `fix` what to do instead."""

    def __init__(self, ref: str, name: str, version: str, who: str, why: str, when: str):
        self.ref, self.name, self.version, self.who, self.why, self.when = ref, name, version, who, why, when
        self.reason = (f"dataset version {name}@{version} (what {ref} resolves to) was withdrawn by {who} at {when}: "
                       f"{why}; no new job may train on it")
        self.fix = (f"pick another version of {name!r} (`trainforge datasets show {name}` lists its versions and "
                    f"branches) and set dataset.ref to it; `trainforge lineage trained-on {name}@{version[:12]}` "
                    "lists what was already trained on the withdrawn one")
        super().__init__(f"{self.reason}. Fix: {self.fix}")


def _check_ref_name(ref: str) -> str:
    if not ref or set(ref) - NAME_OK - set("ABCDEFGHIJKLMNOPQRSTUVWXYZ") or ref.startswith("."):
        raise CatalogError(f"ref name {ref!r} may only use letters, digits, '-', '_' and '.'")
    return ref


def default_store() -> ObjectStore:
    url = os.environ.get(DATASETS_URL_ENV)
    return open_store(url) if url else LocalObjectStore(home() / "datasets")


class _Prefixed:
    """The catalog's view of a store under a key prefix (e.g. a handle scoped to `teams/nlp/datasets`)."""

    def __init__(self, store: ObjectStore, prefix: str):
        self.inner, self.prefix = store, prefix.strip("/")
        base, scope = store.url.rstrip("/"), getattr(store, "prefix", "")
        if scope and base.endswith("/" + scope):  # a scoped handle's URL names its scope; keys are from the root
            base = base[: -len(scope) - 1]
        self.url = f"{base}/{self.prefix}"  # open_store(self.url) reads keys relative to the prefix

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if key else self.prefix + "/"

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        self.inner.put_bytes(self._k(key), data, if_none_match=if_none_match)

    def put_file(self, key: str, path: Path, *, if_none_match: bool = False) -> None:
        self.inner.put_file(self._k(key), path, if_none_match=if_none_match)

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        return self.inner.get_bytes(self._k(key), byte_range)

    def get_file(self, key: str, path: Path) -> None:
        self.inner.get_file(self._k(key), path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(self._k(key))

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.prefix) + 1
        return [k[n:] for k in self.inner.list(self._k(prefix))]

    def delete(self, key: str) -> None:
        self.inner.delete(self._k(key))


class EmbeddedCatalog:
    def __init__(self, root: Path | None = None, *, store: ObjectStore | None = None, prefix: str = ""):
        if store is None:
            store = LocalObjectStore(root) if root is not None else default_store()
        self.store: ObjectStore = _Prefixed(store, prefix) if prefix else store  # type: ignore[assignment]
        self.local = isinstance(store, LocalObjectStore) and not store.prefix
        self.root = store.root if isinstance(store, LocalObjectStore) else home() / "cache" / "catalog"

    def _check_name(self, name: str) -> str:
        if not name or set(name) - NAME_OK:
            raise CatalogError(f"dataset name {name!r} may only use lowercase letters, digits, '-', '_' and '.'")
        return name

    def _dir(self, name: str) -> Path:
        return Path(self.root) / self._check_name(name)

    # ---- writing --------------------------------------------------------------------------------------

    def commit(self, name: str, build: Callable[[Path], list[ShardInfo]], *, sample_len: int, token_dtype: str,
               vocab_size: int, tokenizer: str, license: str, provenance: dict | None = None,
               ref: str | None = "main", features: dict[str, dict[str, Any]] | None = None) -> ResolvedDataset:
        """Build a version in a temporary folder, publish it (manifest last), then move branch `ref` to it
        (ref=None: publish the version without moving any branch, e.g. until its quality gate passed)."""
        self._check_name(name)
        if ref is not None:
            _check_ref_name(ref)
        staging = (self._dir(name) / "versions") if self.local else home() / "staging" / "datasets"
        staging.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=staging))
        try:
            shards = build(tmp)
            manifest = DatasetManifest(name=name, shards=tuple(shards), sample_len=sample_len,
                                       token_dtype=token_dtype, vocab_size=vocab_size, tokenizer=tokenizer,
                                       license=license, provenance=provenance or {}, features=features or {})
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
            if self.local:
                final = self._dir(name) / "versions" / manifest.version_id
                if final.exists():
                    shutil.rmtree(tmp)  # same content already committed: versions are content-addressed
                else:
                    tmp.rename(final)
            else:
                self._upload(name, manifest, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if ref is not None:
            self.set_ref(name, ref, manifest.version_id)
        return self.resolve(name, manifest.version_id)

    def commit_prefix(self, manifest: PrefixManifest, ref: str | None = "main") -> ResolvedDataset:
        """Record a pinned s3:// prefix as a version: its manifest (and source.json, where the objects are), not
        its bytes. Content-addressed like every version: pinning the same objects again is the same version."""
        name = self._check_name(manifest.name)
        prefix = f"{name}/versions/{manifest.version_id}"
        source = json.dumps({"store_url": f"s3://{manifest.bucket}", "prefix": manifest.prefix}).encode()
        if not self.store.exists(f"{prefix}/{MANIFEST_FILE}"):
            self.store.put_bytes(f"{prefix}/{SOURCE_FILE}", source)
            with contextlib.suppress(ObjectExistsError):  # pinned concurrently, same content
                self.store.put_bytes(f"{prefix}/{MANIFEST_FILE}",
                                     json.dumps(manifest.to_dict(), indent=1, sort_keys=True).encode(),
                                     if_none_match=True)
        if ref is not None:
            self.set_ref(name, ref, manifest.version_id)
        return self.resolve(name, manifest.version_id)

    def _upload(self, name: str, manifest: DatasetManifest, folder: Path) -> None:
        publish_version(self.store, f"{name}/versions/{manifest.version_id}", manifest, folder)

    def set_ref(self, name: str, ref: str, version: str) -> None:
        """Move branch `ref` to `version` (which must be committed)."""
        _check_ref_name(ref)
        self._manifest_key(name, version)
        self.store.put_bytes(f"{name}/refs/{ref}", version.encode())

    def tag(self, name: str, tag: str, ref: str = "main") -> str:
        """Pin `ref` (a branch, tag or version) under an immutable tag; re-tagging the same version is a no-op."""
        _check_ref_name(tag)
        version = self.resolve(name, ref).version
        try:
            self.store.put_bytes(f"{name}/tags/{tag}", version.encode(), if_none_match=True)
        except ObjectExistsError:
            existing = self.store.get_bytes(f"{name}/tags/{tag}").decode().strip()
            if existing != version:
                raise CatalogError(f"tag {tag!r} of dataset {name!r} already points at {existing[:12]}; tags are "
                                   "immutable: choose another tag name") from None
        return version

    def put_quality(self, name: str, version: str, report: dict[str, Any], suite: str = "") -> None:
        """Store a version's gate report; `suite`: the digest of the team suite it also ran (its own report)."""
        self.store.put_bytes(_quality_key(name, version, suite),
                             json.dumps(report, indent=1, sort_keys=True, default=str).encode())

    def get_quality(self, name: str, version: str, suite: str = "") -> dict[str, Any] | None:
        try:
            return json.loads(self.store.get_bytes(_quality_key(name, version, suite)))
        except ObjectNotFoundError:
            return None

    # ---- reading --------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        if self.local:
            return sorted(p.name for p in Path(self.root).iterdir() if p.is_dir()) if Path(self.root).is_dir() else []
        return sorted({k.split("/", 1)[0] for k in self.store.list("") if "/versions/" in k})

    def versions(self, name: str) -> list[str]:
        """Committed version ids (those with a manifest)."""
        prefix = f"{self._check_name(name)}/versions/"
        return sorted({k[len(prefix):].split("/")[0] for k in self.store.list(prefix)
                       if k.endswith("/" + MANIFEST_FILE) and k.count("/") == 3
                       and not k[len(prefix):].startswith(".")})

    def refs(self, name: str) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {"branches": {}, "tags": {}}
        for kind, folder in (("branches", "refs"), ("tags", "tags")):
            prefix = f"{self._check_name(name)}/{folder}/"
            for key in self.store.list(prefix):
                out[kind][key[len(prefix):]] = self.store.get_bytes(key).decode().strip()
        return out

    def _manifest_key(self, name: str, version: str) -> str:
        key = f"{self._check_name(name)}/versions/{version}/{MANIFEST_FILE}"
        if not self.store.exists(key):
            raise CatalogError(f"dataset {name!r} has no committed version {version!r}")
        return key

    def resolve_version(self, name: str, ref: str = "main") -> str:
        """A branch, tag, full version id or unique prefix (>= 8 characters) -> the version id."""
        self._check_name(name)
        for folder in ("refs", "tags"):
            key = f"{name}/{folder}/{ref}"
            if "/" not in ref and self.store.exists(key):
                return self.store.get_bytes(key).decode().strip()
        versions = self.versions(name)
        if not versions and not self.store.list(f"{name}/"):
            known = ", ".join(self.names()) or "none"
            raise CatalogError(f"dataset {name!r} is not in the catalog at {self.store.url} (known: {known})")
        matches = [v for v in versions if v.startswith(ref)] if len(ref) >= 8 else []
        if len(matches) != 1:
            raise CatalogError(f"dataset {name!r} has no ref or version {ref!r}")
        return matches[0]

    def resolve(self, name: str, ref: str = "main") -> ResolvedDataset:
        version = self.resolve_version(name, ref)
        if self.local:
            return load_version_dir(self._dir(name) / "versions" / version, f"catalog://{name}@{ref}")
        return self._materialize(name, version, f"catalog://{name}@{ref}")

    def _materialize(self, name: str, version: str, ref: str) -> ResolvedDataset:
        """A remote version as a local folder: its manifest plus source.json naming the store and prefix."""
        folder = home() / "cache" / "catalog" / name / version
        self._manifest_key(name, version)  # raises CatalogError for a version that is not committed
        write_source_folder(folder, self.store, f"{name}/versions/{version}")
        return load_version_dir(folder, ref)


def _quality_key(name: str, version: str, suite: str = "") -> str:
    return f"{name}/quality/{version}.json" if not suite else f"{name}/quality/{version}.team-{suite[:16]}.json"


def publish_version(store: ObjectStore, prefix: str, manifest: DatasetManifest, folder: Path) -> None:
    """A version folder's shards, tokenizer and manifest under `prefix`, the manifest last (the commit point);
    a no-op when the manifest is there already (versions are content-addressed)."""
    if store.exists(f"{prefix}/{MANIFEST_FILE}"):
        return
    for shard in manifest.shards:
        store.put_file(f"{prefix}/{shard.file}", folder / shard.file)
    if tokenizer.ships_json(manifest.tokenizer):  # a BPE or pretrained tokenizer travels with the version
        store.put_file(f"{prefix}/{tokenizer.TOKENIZER_FILE}", folder / tokenizer.TOKENIZER_FILE)
    # ObjectExistsError: committed concurrently with identical content
    with contextlib.suppress(ObjectExistsError):
        store.put_file(f"{prefix}/{MANIFEST_FILE}", folder / MANIFEST_FILE, if_none_match=True)


def write_source_folder(folder: Path, store: ObjectStore | _Prefixed, prefix: str, url: str | None = None) -> Path:
    """A version in a store as a local folder the readers take: its manifest (written last, so a folder with one is
    complete), its tokenizer if it ships one, and source.json naming the store (`url`, else the store's own) and
    prefix the shards stream from. Kept when already there."""
    if not (folder / MANIFEST_FILE).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        data = store.get_bytes(f"{prefix}/{MANIFEST_FILE}")
        doc = json.loads(data)
        if is_prefix_manifest(doc):  # an in-place version: its objects are where the manifest says, not here
            pinned = PrefixManifest.from_dict(doc)
            _atomic_write(folder / SOURCE_FILE, json.dumps({"store_url": f"s3://{pinned.bucket}",
                                                            "prefix": pinned.prefix}).encode())
            for key in store.list(f"{prefix}/tokenizers/"):  # the jobs' tokenizers kept beside it, by digest
                (folder / "tokenizers").mkdir(exist_ok=True)
                _atomic_write(folder / "tokenizers" / key.rsplit("/", 1)[1], store.get_bytes(key))
            _atomic_write(folder / MANIFEST_FILE, data)
            return folder
        _atomic_write(folder / SOURCE_FILE, json.dumps({"store_url": url or store.url, "prefix": prefix}).encode())
        if tokenizer.ships_json(doc["tokenizer"]):
            _atomic_write(folder / tokenizer.TOKENIZER_FILE,
                          store.get_bytes(f"{prefix}/{tokenizer.TOKENIZER_FILE}"))
        _atomic_write(folder / MANIFEST_FILE, data)
    return folder


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load_version_dir(path: Path, ref: str) -> ResolvedDataset:
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise CatalogError(f"{path} has no {MANIFEST_FILE}: not a committed dataset version")
    try:
        doc = json.loads(manifest_path.read_text())
        manifest: DatasetManifest | PrefixManifest = (
            PrefixManifest.from_dict(doc) if is_prefix_manifest(doc) else DatasetManifest.from_dict(doc))
    except (ValueError, TypeError, KeyError) as exc:
        raise CatalogError(f"{manifest_path} is not a valid dataset manifest: {exc}") from None
    return ResolvedDataset(ref=ref, name=manifest.name, version=manifest.version_id, license=manifest.license,
                           path=path, manifest=manifest)
