"""The lakeFS dataset catalog: `lakefs://REPO/REF/PATH` -> a version pinned to a lakeFS commit.

REF may be anything lakeFS resolves (branch, tag, commit id, `main~1`); `getCommit` turns it into the immutable
commit id, and every read after that names the commit, never the branch, so a branch moving during a run changes
nothing. PATH is a dataset version folder (manifest.json + shards), as written by `publish`. Releases are tags;
lineage (run id, code commit, ...) goes into commit metadata.

Built on the high-level `lakefs` SDK (`lakefs.Client`, `Repository`, `Reference`, `Branch`, `Tag`,
`StoredObject`), configured the way lakeFS users configure lakectl: `~/.lakectl.yaml` (or the file named by
LAKECTL_CONFIG_FILE) with `server.endpoint_url` and `credentials.access_key_id` / `credentials.secret_access_key`,
overridden by LAKECTL_SERVER_ENDPOINT_URL, LAKECTL_CREDENTIALS_ACCESS_KEY_ID and
LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY. LAKEFS_* variables are the lakeFS *server's* own settings and are refused
with a pointer to their LAKECTL_* equivalents.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainforge.datasets.catalog import SOURCE_FILE, CatalogError, ResolvedDataset, load_version_dir
from trainforge.datasets.manifest import MANIFEST_FILE
from trainforge.home import home
from trainforge.infra.storage import ObjectNotFoundError

if TYPE_CHECKING:
    import lakefs

CONFIG_FILE_ENV = "LAKECTL_CONFIG_FILE"
ENDPOINT_ENV = "LAKECTL_SERVER_ENDPOINT_URL"
ACCESS_KEY_ENV = "LAKECTL_CREDENTIALS_ACCESS_KEY_ID"
SECRET_KEY_ENV = "LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY"
# the lakeFS server's settings (its LAKEFS_ config prefix) that people set for a client by mistake -> the
# lakectl name that means what they meant
SERVER_ENV = {"LAKEFS_ENDPOINT": ENDPOINT_ENV, "LAKEFS_ACCESS_KEY_ID": ACCESS_KEY_ENV,
              "LAKEFS_SECRET_ACCESS_KEY": SECRET_KEY_ENV}
HOW_TO_CONFIGURE = (f"run `lakectl config`, or write ~/.lakectl.yaml (another file: {CONFIG_FILE_ENV}=PATH) with "
                    "`server: {endpoint_url: http://HOST:8000}` and `credentials: {access_key_id: ..., "
                    f"secret_access_key: ...}}`, or set {ENDPOINT_ENV}, {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}")
_READ_CHUNK = 8 << 20


def parse_url(url: str) -> tuple[str, str, str]:
    """`lakefs://repo/ref/path/to/version` -> (repo, ref, path)."""
    if not url.startswith("lakefs://"):
        raise CatalogError(f"not a lakefs:// reference: {url!r}")
    parts = url.removeprefix("lakefs://").split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise CatalogError(f"{url!r}: expected lakefs://REPOSITORY/REF/PATH (PATH: the dataset version folder)")
    return parts[0], parts[1], parts[2].strip("/")


# ---- configuration, the lakectl way ----
def lakectl_config_file() -> Path:
    """The lakectl config file the SDK reads: LAKECTL_CONFIG_FILE, else ~/.lakectl.yaml."""
    named = os.environ.get(CONFIG_FILE_ENV)  # set, even empty, it is the file: the SDK's getenv(name, default)
    return Path(named) if named is not None else Path.home() / ".lakectl.yaml"


def _config_file_data() -> dict[str, Any]:
    import yaml

    path = lakectl_config_file()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"lakeFS: cannot read the lakectl config {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CatalogError(f"lakeFS: the lakectl config {path} is not a mapping (expected server: and "
                           "credentials: blocks)")
    return data


def lakectl_endpoint() -> str | None:
    """The lakeFS endpoint lakectl would use (env over file), without contacting the server; None if unset."""
    if os.environ.get(ENDPOINT_ENV) is not None:  # the SDK's `is not None`: set (even empty) wins over the file
        return os.environ[ENDPOINT_ENV] or None
    server = _config_file_data().get("server")
    endpoint = server.get("endpoint_url") if isinstance(server, dict) else None
    return str(endpoint) if endpoint else None


def lakectl_configured() -> bool:
    """Whether a lakeFS client is configured (LAKECTL_* env or the lakectl config file names an endpoint). Checks
    the environment and the file only; the server is not contacted."""
    try:
        return lakectl_endpoint() is not None
    except CatalogError:
        return True  # configured, but broken: using it reports why


def not_configured_error() -> CatalogError:
    """The error for "no lakeFS client configuration", naming what to set; LAKEFS_* (the server's settings) are
    called out with their lakectl equivalents."""
    server_vars = [k for k in SERVER_ENV if os.environ.get(k)]
    if server_vars:
        mapping = ", ".join(f"{k} -> {SERVER_ENV[k]}" for k in server_vars)
        return CatalogError(f"lakeFS is not configured: trainforge no longer reads {', '.join(server_vars)} "
                            f"(LAKEFS_ is the lakeFS server's own configuration prefix); rename them the lakectl "
                            f"way ({mapping}), or {HOW_TO_CONFIGURE}")
    return CatalogError(f"lakefs:// references need a configured lakeFS client: no endpoint in "
                        f"{lakectl_config_file()} and {ENDPOINT_ENV} is not set; {HOW_TO_CONFIGURE}")


# ---- errors ----
def _message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    if isinstance(body, (str, bytes)):  # a raw lakefs_sdk ApiException carries the JSON text
        with contextlib.suppress(ValueError, AttributeError):
            return str(json.loads(body).get("message") or exc.reason)
    return str(getattr(exc, "reason", None) or exc)


@contextlib.contextmanager
def _errors(what: str, host: str = "") -> Iterator[None]:
    """SDK errors -> CatalogError with a readable reason (404 -> "not found")."""
    import urllib3
    from lakefs.exceptions import LakeFSException, NotFoundException, ServerException

    # lakefs_sdk directly: the high-level SDK lets a few generated-client errors through unconverted (e.g.
    # ObjectWriter's presigned upload calls staging_api.link_physical_address outside its exception handler);
    # lakefs.exceptions has no equivalent to catch them by.
    from lakefs_sdk.exceptions import ApiException

    try:
        yield
    except NotFoundException as exc:
        raise CatalogError(f"lakeFS: {what}: not found ({_message(exc)})") from None
    except ServerException as exc:
        raise CatalogError(f"lakeFS: {what}: HTTP {exc.status_code} {_message(exc)}") from None
    except ApiException as exc:
        if exc.status == 404:
            raise CatalogError(f"lakeFS: {what}: not found ({_message(exc)})") from None
        raise CatalogError(f"lakeFS: {what}: HTTP {exc.status} {_message(exc)}") from None
    except LakeFSException as exc:
        raise CatalogError(f"lakeFS: {what}: {type(exc).__name__} {exc}".rstrip()) from None
    except urllib3.exceptions.HTTPError as exc:
        raise CatalogError(f"lakeFS: {what}: cannot reach {host or 'the server'}: {exc}") from None


class LakeFSCatalog:
    def __init__(self, client: lakefs.Client):
        self.client = client
        self.endpoint = client.config.host
        self._pre_sign: dict[str, bool] = {}

    @classmethod
    def from_env(cls) -> LakeFSCatalog:
        """The lakectl configuration chain: the config file (LAKECTL_CONFIG_FILE or ~/.lakectl.yaml), overridden
        by LAKECTL_SERVER_ENDPOINT_URL / LAKECTL_CREDENTIALS_ACCESS_KEY_ID / LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY
        (also a session token or an IAM provider, as lakectl and the lakefs SDK support them)."""
        import lakefs
        from lakefs.exceptions import LakeFSException, NoAuthenticationFound

        endpoint = lakectl_endpoint()
        if endpoint is None:
            raise not_configured_error()
        try:
            client = lakefs.Client()  # no kwargs: the SDK's ClientConfig reads the lakectl file and env
        except NoAuthenticationFound:
            raise CatalogError(f"lakeFS at {endpoint}: no credentials: set {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}, "
                               f"or credentials.access_key_id / credentials.secret_access_key in "
                               f"{lakectl_config_file()}") from None
        except (LakeFSException, TypeError, ValueError) as exc:  # e.g. an unknown key in the config's blocks
            raise CatalogError(f"lakeFS: bad client configuration ({lakectl_config_file()}, LAKECTL_*): "
                               f"{type(exc).__name__} {exc}") from None
        return cls(client)

    @classmethod
    def connect(cls, endpoint: str, access_key_id: str, secret_access_key: str) -> LakeFSCatalog:
        """Explicit endpoint and credentials, bypassing the lakectl chain."""
        import lakefs

        return cls(lakefs.Client(host=endpoint, username=access_key_id, password=secret_access_key))

    def repository(self, repo: str) -> lakefs.Repository:
        import lakefs

        return lakefs.Repository(repo, client=self.client)

    def _errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        return _errors(what, self.endpoint)

    def pre_sign(self, repo: str) -> bool:
        """Whether data moves through pre-signed storage URLs (the server's storage config), asked once per
        repository: the SDK otherwise asks (getRepository) for every object it opens."""
        if repo not in self._pre_sign:
            with self._errors(f"storage config of {repo}"):
                storage_id = self.repository(repo).properties.storage_id or ""
                try:
                    self._pre_sign[repo] = bool(self.client.storage_config_by_id(storage_id).pre_sign_support)
                except KeyError:  # a storage the server's config does not list: data through the server itself
                    self._pre_sign[repo] = False
        return self._pre_sign[repo]

    def commit_id(self, repo: str, ref: str) -> str:
        """Any ref (branch, tag, commit, `main~1`) -> the immutable commit id."""
        with self._errors(f"resolve {repo}@{ref}"):
            return self.repository(repo).ref(ref).get_commit().id

    def read(self, repo: str, commit: str, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """An object's bytes at a commit, or the half-open byte range [start, end) (one ranged getObject)."""
        if byte_range is not None and byte_range[1] <= byte_range[0]:
            return b""
        with self._errors(f"read {key} at {repo}@{commit[:12]}"):
            obj = self.repository(repo).commit(commit).object(key)
            with obj.reader("rb", pre_sign=self.pre_sign(repo)) as f:
                if byte_range is None:
                    return bytes(f.read())
                f.seek(byte_range[0])
                return bytes(f.read(byte_range[1] - byte_range[0]))

    def resolve(self, url: str) -> ResolvedDataset:
        repo, ref, path = parse_url(url)
        commit = self.commit_id(repo, ref)
        folder = home() / "cache" / "lakefs" / repo / commit / path
        if not (folder / MANIFEST_FILE).is_file():
            data = self.read(repo, commit, f"{path}/{MANIFEST_FILE}")
            folder.mkdir(parents=True, exist_ok=True)
            _atomic_write(folder / SOURCE_FILE, json.dumps({"store_url": f"lakefs://{repo}/{commit}",
                                                            "prefix": path}).encode())
            _atomic_write(folder / MANIFEST_FILE, data)
        return load_version_dir(folder, f"lakefs://{repo}/{commit}/{path}")

    def publish(self, version_dir: Path, repo: str, branch: str, path: str, *, message: str,
                metadata: dict[str, str] | None = None, tag: str | None = None) -> str:
        """Upload a version folder to `branch` under `path`, commit it (metadata = lineage), optionally tag the
        commit. Returns the commit id."""
        files = sorted(p for p in version_dir.iterdir() if p.is_file() and p.name != SOURCE_FILE)
        target = self.repository(repo).branch(branch)
        for p in sorted(files, key=lambda f: f.name == MANIFEST_FILE):  # manifest last
            key = f"{path}/{p.name}"
            # the writer spools to memory, then to a temporary file, and uploads on close
            with (self._errors(f"upload {key} to {repo}@{branch}"), p.open("rb") as src,
                  target.object(key).writer("wb", pre_sign=self.pre_sign(repo),
                                            content_type="application/octet-stream") as dst):
                shutil.copyfileobj(src, dst, _READ_CHUNK)
        commit = self.record(repo, branch, message, metadata or {})
        if tag:
            self.tag(repo, tag, commit)
        return commit

    def record(self, repo: str, branch: str, message: str, metadata: dict[str, str], allow_empty: bool = False) -> str:
        """A commit on `branch` carrying `metadata` (lineage); allow_empty for a pure lineage record."""
        with self._errors(f"commit {repo}@{branch}"):
            return self.repository(repo).branch(branch).commit(
                message, metadata={k: str(v) for k, v in metadata.items()}, allow_empty=allow_empty).id

    def tag(self, repo: str, tag: str, ref: str) -> str:
        """Tag `ref` (an existing tag is an error: releases are immutable); returns the tagged commit id."""
        with self._errors(f"tag {repo} {tag}"):
            return self.repository(repo).tag(tag).create(ref).get_commit().id

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
        try:
            return self.catalog.read(self.repo, self.commit, key, byte_range)
        except CatalogError as exc:
            if ": not found" in str(exc):
                raise ObjectNotFoundError(key) from None
            raise

    def get_file(self, key: str, path: Path) -> None:
        path.write_bytes(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        """headObject: False when the object is not at this commit; other failures (auth, network) raise."""
        with self.catalog._errors(f"stat {key} at {self.repo}@{self.commit[:12]}"):
            return self.catalog.repository(self.repo).commit(self.commit).object(key).exists()

    def list(self, prefix: str = "", *, start_after: str = "") -> list[str]:
        """Keys under `prefix`, sorted (listObjects, paged by the SDK)."""
        from lakefs import ObjectInfo

        with self.catalog._errors(f"list {prefix or '/'} at {self.repo}@{self.commit[:12]}"):
            ref = self.catalog.repository(self.repo).commit(self.commit)
            return sorted(o.path for o in ref.objects(prefix=prefix, after=start_after or None, amount=1000)
                          if isinstance(o, ObjectInfo))

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
