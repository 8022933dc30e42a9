"""The lakeFS dataset catalog: `lakefs://REPO/REF/PATH` -> a version pinned to a lakeFS commit.

REF may be anything lakeFS resolves (branch, tag, commit id, `main~1`); `getCommit` turns it into the immutable
commit id, and every read after that names the commit, never the branch, so a branch moving during a run changes
nothing. PATH is a dataset version folder (manifest.json + shards), as written by `publish`. Releases are tags;
lineage (run id, code commit, ...) goes into commit metadata.

Uses the generated `lakefs_sdk` client. Endpoint and credentials: LAKEFS_ENDPOINT (e.g. http://host:8000),
LAKEFS_ACCESS_KEY_ID, LAKEFS_SECRET_ACCESS_KEY.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from trainforge.datasets.catalog import SOURCE_FILE, CatalogError, ResolvedDataset, load_version_dir
from trainforge.datasets.manifest import MANIFEST_FILE
from trainforge.home import home
from trainforge.infra.storage import ObjectNotFoundError


def parse_url(url: str) -> tuple[str, str, str]:
    """`lakefs://repo/ref/path/to/version` -> (repo, ref, path)."""
    if not url.startswith("lakefs://"):
        raise CatalogError(f"not a lakefs:// reference: {url!r}")
    parts = url.removeprefix("lakefs://").split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise CatalogError(f"{url!r}: expected lakefs://REPOSITORY/REF/PATH (PATH: the dataset version folder)")
    return parts[0], parts[1], parts[2].strip("/")


class LakeFSCatalog:
    def __init__(self, endpoint: str, access_key_id: str | None = None, secret_access_key: str | None = None):
        import lakefs_sdk

        config = lakefs_sdk.Configuration(host=endpoint.rstrip("/") + "/api/v1", username=access_key_id,
                                          password=secret_access_key)
        self.endpoint = endpoint
        self.client = lakefs_sdk.ApiClient(config)
        self.commits = lakefs_sdk.CommitsApi(self.client)
        self.objects = lakefs_sdk.ObjectsApi(self.client)
        self.tags = lakefs_sdk.TagsApi(self.client)

    @classmethod
    def from_env(cls) -> LakeFSCatalog:
        endpoint = os.environ.get("LAKEFS_ENDPOINT")
        if not endpoint:
            raise CatalogError("lakefs:// references need LAKEFS_ENDPOINT (and LAKEFS_ACCESS_KEY_ID / "
                               "LAKEFS_SECRET_ACCESS_KEY) in the environment")
        return cls(endpoint, os.environ.get("LAKEFS_ACCESS_KEY_ID"), os.environ.get("LAKEFS_SECRET_ACCESS_KEY"))

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from lakefs_sdk.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            reason = exc.reason
            with contextlib.suppress(ValueError):
                reason = json.loads(exc.body or "{}").get("message", reason)
            if exc.status == 404:
                raise CatalogError(f"lakeFS: {what}: not found ({reason})") from None
            raise CatalogError(f"lakeFS: {what}: HTTP {exc.status} {reason}") from None

    def commit_id(self, repo: str, ref: str) -> str:
        """Any ref (branch, tag, commit, `main~1`) -> the immutable commit id."""
        return self._call(f"resolve {repo}@{ref}", self.commits.get_commit, repo, ref).id

    def resolve(self, url: str) -> ResolvedDataset:
        repo, ref, path = parse_url(url)
        commit = self.commit_id(repo, ref)
        folder = home() / "cache" / "lakefs" / repo / commit / path
        if not (folder / MANIFEST_FILE).is_file():
            data = self._call(f"read {path}/{MANIFEST_FILE} at {repo}@{commit[:12]}", self.objects.get_object,
                              repo, commit, f"{path}/{MANIFEST_FILE}")
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / SOURCE_FILE, json.dumps({"store_url": f"lakefs://{repo}/{commit}",
                                                            "prefix": path}).encode())
            _atomic_write(folder / MANIFEST_FILE, bytes(data))
        return load_version_dir(folder, f"lakefs://{repo}/{commit}/{path}")

    def publish(self, version_dir: Path, repo: str, branch: str, path: str, *, message: str,
                metadata: dict[str, str] | None = None, tag: str | None = None) -> str:
        """Upload a version folder to `branch` under `path`, commit it (metadata = lineage), optionally tag the
        commit. Returns the commit id."""
        files = sorted(p for p in version_dir.iterdir() if p.is_file() and p.name != SOURCE_FILE)
        for p in sorted(files, key=lambda f: f.name == MANIFEST_FILE):  # manifest last
            self._call(f"upload {path}/{p.name}", self.objects.upload_object, repo, branch, f"{path}/{p.name}",
                       content=str(p))  # the generated client streams a file given by path
        commit = self.record(repo, branch, message, metadata or {})
        if tag:
            self.tag(repo, tag, commit)
        return commit

    def record(self, repo: str, branch: str, message: str, metadata: dict[str, str], allow_empty: bool = False) -> str:
        """A commit on `branch` carrying `metadata` (lineage); allow_empty for a pure lineage record."""
        import lakefs_sdk

        creation = lakefs_sdk.CommitCreation(message=message, metadata={k: str(v) for k, v in metadata.items()},
                                             allow_empty=allow_empty)
        return self._call(f"commit {repo}@{branch}", self.commits.commit, repo, branch, creation).id

    def tag(self, repo: str, tag: str, ref: str) -> str:
        import lakefs_sdk

        return self._call(f"tag {repo} {tag}", self.tags.create_tag, repo,
                          lakefs_sdk.TagCreation(id=tag, ref=ref)).commit_id

    def store(self, repo: str, commit: str) -> LakeFSObjectStore:
        return LakeFSObjectStore(self, repo, commit)


class LakeFSObjectStore:
    """Read-only ObjectStore view of one lakeFS commit (ranged reads through getObject's Range header), so the
    streaming reader and its cache tiers work on lakeFS data unchanged."""

    def __init__(self, catalog: LakeFSCatalog, repo: str, commit: str):
        self.catalog, self.repo, self.commit = catalog, repo, commit
        self.url = f"lakefs://{repo}/{commit}"
        self.prefix = ""

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        rng = None if byte_range is None else f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        try:
            return bytes(self.catalog._call(f"read {key}", self.catalog.objects.get_object, self.repo, self.commit,
                                            key, range=rng))
        except CatalogError as exc:
            if "not found" in str(exc):
                raise ObjectNotFoundError(key) from None
            raise

    def get_file(self, key: str, path: Path) -> None:
        path.write_bytes(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        try:
            self.catalog._call(f"stat {key}", self.catalog.objects.stat_object, self.repo, self.commit, key)
            return True
        except CatalogError:
            return False

    def list(self, prefix: str = "") -> list[str]:
        out, after = [], ""
        while True:
            page = self.catalog._call(f"list {prefix}", self.catalog.objects.list_objects, self.repo, self.commit,
                                      prefix=prefix, after=after, amount=1000)
            out += [o.path for o in page.results]
            if not page.pagination.has_more:
                return sorted(out)
            after = page.pagination.next_offset

    def _read_only(self, *_: Any, **__: Any) -> None:
        raise PermissionError("a lakeFS commit is immutable: publish through LakeFSCatalog.publish")

    put_bytes = put_file = delete = _read_only


def open_lakefs_store(url: str) -> LakeFSObjectStore:
    repo, commit = url.removeprefix("lakefs://").split("/", 1)
    return LakeFSCatalog.from_env().store(repo, commit)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
