"""The production object store: S3 (or any S3-compatible server) through boto3.

- Big uploads go multipart with concurrent parts (`multipart_threshold`, `part_size`, `max_concurrency`);
  big downloads are split into concurrent ranged GETs checked against the object's ETag.
- Conditional create (`if_none_match=True`) sends `If-None-Match: *`; the server answers 412 when the key
  exists, which becomes ObjectExistsError. That is the commit primitive of checkpoints: two racing writers,
  exactly one wins. A conditional write goes as one PutObject up to `conditional_put_limit` (5 GiB, PutObject's
  own limit), however big: servers check a conditional CompleteMultipartUpload less carefully than a PutObject
  (SeaweedFS 4.48 checks it outside its object lock: four racing completions had 1-3 winners per round here,
  four racing PutObjects always one). Only beyond that limit does the condition ride on CompleteMultipartUpload.
- Throttling, 5xx and connection errors are retried by botocore's "standard" mode (exponential backoff with
  jitter, `max_attempts` in all); a 409 ConditionalRequestConflict on a conditional write is retried here.
- `max_upload_bytes_per_s` bounds the average upload rate of the whole store (token bucket, per request/part).
- Credentials come from the arguments or the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, else
  boto3's usual chain). They live only inside the boto3 client: never in an attribute, repr, log line or pickle.
- `scoped(prefix)` handles refuse keys outside the prefix on the client side; with per-job credentials
  (`with_credentials`) the server refuses them too (see iam.py for the policies).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from trainforge.infra.storage.base import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    PermissionDeniedError,
    StorageError,
    check_key,
    in_scope,
    scoped_list_prefix,
)
from trainforge.infra.storage.iam import render_job_iam_policy

__all__ = ["MIN_PART_SIZE", "RateLimiter", "S3ObjectStore", "render_job_iam_policy"]

log = logging.getLogger(__name__)

MiB = 1024 * 1024
_LOADER: Any = None
_LOADER_LOCK = threading.Lock()


def _session() -> boto3.session.Session:
    """A fresh boto3 session (it resolves credentials of its own: the environment may change between stores) over
    the process's one botocore data loader, which parses the S3 service model and the endpoint data (large JSON
    files) once per process: a client cost 80 ms of CPU alone and 4 were made in each worker (its dataset,
    inputs, checkpoints, reader), 11 ms with the shared loader."""
    import botocore.loaders
    import botocore.session

    global _LOADER
    with _LOADER_LOCK:
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))
        loader = _LOADER
    core = botocore.session.Session()
    core.register_component("data_loader", loader)
    return boto3.session.Session(botocore_session=core)


MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000
MAX_PUT_OBJECT = 5 * 1024 * MiB  # S3's limit for a single PutObject
DEFAULT_REGION = "us-east-1"

_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_DENIED_CODES = {
    "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "InvalidToken", "ExpiredToken",
    "AllAccessDisabled", "403",
}
_EXISTS_CODES = {"PreconditionFailed", "412"}
_READ_RETRIES = 3


class RateLimiter:
    """A token bucket in bytes per second, shared by every thread of a store: bounds the average upload
    rate (so background checkpoint uploads do not starve training I/O). Bursts up to one second's worth."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        self.rate = float(bytes_per_s)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = self.rate
        self._last = clock()

    def acquire(self, n: int) -> float:
        """Take n bytes' worth of tokens, sleeping as needed (n may exceed the burst). Returns the wait."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait


def _code(e: ClientError) -> tuple[str, int | None]:
    return (str(e.response.get("Error", {}).get("Code", "")),
            e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


class S3ObjectStore:
    """An ObjectStore on `s3://bucket/root`; keys are relative to `root`, as for LocalObjectStore."""

    def __init__(
        self,
        bucket: str,
        root: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 16 * MiB,
        max_concurrency: int = 8,
        max_attempts: int = 8,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
        max_upload_bytes_per_s: float | None = None,
        conditional_put_limit: int = MAX_PUT_OBJECT,
    ):
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum part size)")
        if multipart_threshold < 1 or max_concurrency < 1 or max_attempts < 1:
            raise ValueError("multipart_threshold, max_concurrency and max_attempts must be positive")
        self.bucket = bucket
        self.root = root.strip("/")
        if self.root:
            check_key(self.root)
        self.endpoint_url = endpoint_url
        self.region = region or DEFAULT_REGION
        self.multipart_threshold = multipart_threshold
        self.conditional_put_limit = conditional_put_limit
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self._timeouts = (connect_timeout, read_timeout)
        # Shared by scoped handles and copies: one bound for everything this store uploads.
        self._limiter = RateLimiter(max_upload_bytes_per_s) if max_upload_bytes_per_s else None
        self.prefix = ""  # the scope of a scoped handle, relative to root
        self._client = self._make_client(access_key_id, secret_access_key, session_token)
        self._set_url()

    # ---- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3ObjectStore:
        """`s3://bucket/root`, with the endpoint and credentials from the environment:
        TRAINFORGE_S3_ENDPOINT or AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (none: AWS itself),
        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (none: boto3's default chain),
        AWS_REGION or AWS_DEFAULT_REGION (default us-east-1). Tuning: TRAINFORGE_S3_MULTIPART_THRESHOLD_MB,
        TRAINFORGE_S3_PART_SIZE_MB, TRAINFORGE_S3_CONCURRENCY, TRAINFORGE_S3_MAX_UPLOAD_MBPS (MiB/s).
        Keyword arguments override all of these."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3://bucket[/prefix] URL: {url!r}")
        opts: dict[str, Any] = {
            "endpoint_url": _env("TRAINFORGE_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            "region": _env("AWS_REGION", "AWS_DEFAULT_REGION") or DEFAULT_REGION,
            "access_key_id": _env("AWS_ACCESS_KEY_ID"),
            "secret_access_key": _env("AWS_SECRET_ACCESS_KEY"),
            "session_token": _env("AWS_SESSION_TOKEN"),
        }
        for var, name in (("TRAINFORGE_S3_MULTIPART_THRESHOLD_MB", "multipart_threshold"),
                          ("TRAINFORGE_S3_PART_SIZE_MB", "part_size")):
            if v := _env(var):
                opts[name] = int(float(v) * MiB)
        if v := _env("TRAINFORGE_S3_CONCURRENCY"):
            opts["max_concurrency"] = int(v)
        if v := _env("TRAINFORGE_S3_MAX_UPLOAD_MBPS"):
            opts["max_upload_bytes_per_s"] = float(v) * MiB
        opts.update(kwargs)
        return cls(parsed.netloc, parsed.path, **opts)

    def _make_client(self, access_key_id: str | None, secret_access_key: str | None,
                     session_token: str | None) -> Any:
        config = Config(
            region_name=self.region,
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": self.max_attempts},
            max_pool_connections=max(10, 2 * self.max_concurrency),
            connect_timeout=self._timeouts[0],
            read_timeout=self._timeouts[1],
        )
        return _session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            config=config,
        )

    def _set_url(self) -> None:
        path = "/".join(p for p in (self.root, self.prefix) if p)
        self.url = f"s3://{self.bucket}" + (f"/{path}" if path else "")

    def with_credentials(self, access_key_id: str, secret_access_key: str,
                         session_token: str | None = None) -> S3ObjectStore:
        """The same store and scope seen through other credentials (e.g. a job's own identity)."""
        other = copy.copy(self)
        other._client = self._make_client(access_key_id, secret_access_key, session_token)
        return other

    def scoped(self, prefix: str) -> ObjectStore:
        prefix = check_key(prefix.strip("/"))
        if not in_scope(prefix, self.prefix):
            raise PermissionDeniedError(f"cannot widen a handle scoped to {self.prefix}/ to {prefix}/")
        other = copy.copy(self)  # shares the (thread-safe) client
        other.prefix = prefix
        other._set_url()
        return other

    def __repr__(self) -> str:
        return f"S3ObjectStore(url={self.url!r}, endpoint={self.endpoint_url!r}, region={self.region!r})"

    def __copy__(self) -> S3ObjectStore:  # copies share the client (handles, scopes); pickles do not exist
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __reduce__(self) -> Any:
        # Pickling would have to carry the credentials into task results or checkpoints: refuse, and let the
        # receiving process open the store from its URL and its own environment.
        raise TypeError("S3ObjectStore is not picklable: pass store.url and call open_store() where it is used")

    # ---- keys and errors --------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        check_key(key)
        if not in_scope(key, self.prefix):
            raise PermissionDeniedError(f"this handle may only access {self.prefix}/; refused {key!r}")
        return f"{self.root}/{key}" if self.root else key

    def _relative(self, full: str) -> str:
        return full[len(self.root) + 1:] if self.root else full

    def _error(self, e: ClientError, op: str, key: str) -> Exception:
        err = self._classify(e, op, key)
        err.s3_code = _code(e)[0]  # type: ignore[attr-defined]
        return err

    def _classify(self, e: ClientError, op: str, key: str) -> Exception:
        code, status = _code(e)
        msg = e.response.get("Error", {}).get("Message", "")
        where = f"{op} s3://{self.bucket}/{key}"
        if code == "NoSuchBucket":
            return StorageError(f"{where}: bucket {self.bucket!r} does not exist")
        if code in _NOT_FOUND_CODES or status == 404:
            return ObjectNotFoundError(key)
        if code in _EXISTS_CODES or status == 412:
            return ObjectExistsError(key)
        if code in _DENIED_CODES or status == 403:
            return PermissionDeniedError(f"{where}: refused by the server ({code or status}) {msg}".rstrip())
        return StorageError(f"{where}: {code or status} {msg}".rstrip())

    @contextmanager
    def _translate(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except ClientError as e:
            raise self._error(e, op, key) from None
        except BotoCoreError as e:
            raise StorageError(f"{op} s3://{self.bucket}/{key}: {type(e).__name__}: {e}") from None

    def _put_object(self, full: str, key: str, body: Any, if_none_match: bool, if_match: str | None = None) -> None:
        kw = {"IfNoneMatch": "*"} if if_none_match else {}
        if if_match is not None:
            kw = {"IfMatch": if_match}
        if self._limiter is not None:
            self._limiter.acquire(_body_size(body))
        for attempt in range(self.max_attempts):
            if hasattr(body, "seek"):
                body.seek(0)
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body, **kw)
                return
            except ClientError as e:
                # AWS answers 409 when a conditional write races another write in flight: retry, and the
                # retry sees the winner (412) or succeeds.
                if _code(e)[0] == "ConditionalRequestConflict" and attempt + 1 < self.max_attempts:
                    time.sleep(min(2.0, 0.05 * 2**attempt) * random.random())
                    continue
                err = self._error(e, "put", key)
                if if_match is not None and isinstance(err, ObjectExistsError | ObjectNotFoundError):
                    # the server refused the overwrite: the ETag moved on (412) or the key is gone
                    raise ObjectChangedError(key, if_match, status=_code(e)[1] or 412) from None
                raise err from None
            except BotoCoreError as e:
                raise StorageError(f"put s3://{self.bucket}/{key}: {type(e).__name__}: {e}") from None

    # ---- writes -----------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> None:
        full = self._full(key)
        size = len(data)
        if if_match is not None:  # one PutObject: the server compares and writes in one step
            if size > MAX_PUT_OBJECT:
                raise ValueError(f"a conditional overwrite is one PutObject: at most {MAX_PUT_OBJECT} bytes")
            self._put_object(full, key, bytes(data), False, if_match)
        elif self._goes_multipart(size, if_none_match):
            view = memoryview(data)
            self._multipart(full, key, size, lambda off, n: bytes(view[off:off + n]), if_none_match)
        else:
            self._put_object(full, key, data if isinstance(data, bytes) else bytes(data), if_none_match)
        log.debug("put s3://%s/%s (%d bytes)", self.bucket, full, size)

    def put_file(self, key: str, path: Path, *, if_none_match: bool = False) -> None:
        full = self._full(key)
        path = Path(path)
        size = path.stat().st_size
        if self._goes_multipart(size, if_none_match):
            fd = os.open(path, os.O_RDONLY)
            try:
                self._multipart(full, key, size, lambda off, n: os.pread(fd, n, off), if_none_match)
            finally:
                os.close(fd)
        else:
            with open(path, "rb") as f:
                self._put_object(full, key, f, if_none_match)
        log.debug("put_file s3://%s/%s (%d bytes)", self.bucket, full, size)

    def _goes_multipart(self, size: int, if_none_match: bool) -> bool:
        """Multipart for big objects, except a conditional write PutObject can carry (see the module's note)."""
        if if_none_match and size <= min(self.conditional_put_limit, MAX_PUT_OBJECT):
            return False
        return size >= self.multipart_threshold

    def part_size_for(self, size: int) -> int:
        """The part size used for an object of `size` bytes (grown so that it needs at most 10,000 parts)."""
        return max(self.part_size, math.ceil(size / MAX_PARTS))

    def _multipart(self, full: str, key: str, size: int, read: Callable[[int, int], bytes],
                   if_none_match: bool) -> None:
        part = self.part_size_for(size)
        n_parts = max(1, math.ceil(size / part))
        if if_none_match and self.exists(key):  # cheap early exit; the real check is on completion
            raise ObjectExistsError(key)
        with self._translate("create_multipart_upload", key):
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]

        def upload(i: int) -> dict[str, Any]:
            off = i * part
            body = read(off, min(part, size - off))
            if self._limiter is not None:
                self._limiter.acquire(len(body))
            r = self._client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                         PartNumber=i + 1, Body=body)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        try:
            with self._translate("upload_part", key):
                parts = _run_concurrently(upload, range(n_parts), self.max_concurrency)
            kw = {"IfNoneMatch": "*"} if if_none_match else {}
            with self._translate("complete_multipart_upload", key):
                self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}, **kw
                )
        except BaseException:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception as abort_error:  # leftovers are also reaped by a bucket lifecycle rule
                log.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket, full,
                            type(abort_error).__name__)
            raise
        log.debug("multipart s3://%s/%s: %d parts of %d bytes", self.bucket, full, n_parts, part)

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except ClientError as e:
            err = self._error(e, "delete", key)
            if not isinstance(err, ObjectNotFoundError):
                raise err from None
        except BotoCoreError as e:
            raise StorageError(f"delete s3://{self.bucket}/{key}: {type(e).__name__}: {e}") from None

    # ---- reads ------------------------------------------------------------------------------------------

    def head(self, key: str) -> dict[str, Any]:
        """Size and ETag of an object: {"size": int, "etag": str}."""
        full = self._full(key)
        with self._translate("head", key):
            r = self._client.head_object(Bucket=self.bucket, Key=full)
        return {"size": int(r["ContentLength"]), "etag": r.get("ETag", "")}

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        full = self._full(key)
        with self._translate("get", key):
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read(), resp.get("ETag", "")

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFoundError:
            return False
        return True

    def _read_body(self, op: str, key: str, **kw: Any) -> bytes:
        """GetObject and read the body, retrying a body cut short (botocore retries only the request)."""
        for attempt in range(_READ_RETRIES):
            with self._translate(op, key):
                resp = self._client.get_object(Bucket=self.bucket, **kw)
            try:
                return resp["Body"].read()
            except (BotoCoreError, OSError) as e:
                if attempt + 1 == _READ_RETRIES:
                    raise StorageError(f"{op} s3://{self.bucket}/{key}: body read failed: {e}") from None
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        full = self._full(key)
        if byte_range is None:
            return self._read_body("get", key, Key=full)
        start, end = byte_range
        if start < 0 or end < 0:
            raise ValueError(f"byte_range must be non-negative, got {byte_range}")
        if end <= start:
            self.head(key)  # still raises ObjectNotFoundError for a missing key
            return b""
        try:
            return self._read_body("get_range", key, Key=full, Range=f"bytes={start}-{end - 1}")
        except StorageError as e:
            if getattr(e, "s3_code", None) == "InvalidRange":  # start at or past the end: the empty slice, as for a local file
                self.head(key)
                return b""
            raise

    def get_file(self, key: str, path: Path) -> None:
        """Download to `path` (atomically: temp file + rename); big objects as concurrent ranged GETs."""
        full = self._full(key)
        path = Path(path)
        info = self.head(key)
        size, etag = info["size"], info["etag"]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        try:
            if size < self.multipart_threshold:
                kw = {"IfMatch": etag} if etag else {}
                _write_all(fd, self._read_body("get", key, Key=full, **kw))
            else:
                os.ftruncate(fd, size)
                part = self.part_size_for(size)

                def fetch(i: int) -> None:
                    off = i * part
                    rng = f"bytes={off}-{min(size, off + part) - 1}"
                    data = self._read_body("get_range", key, Key=full, Range=rng, IfMatch=etag)
                    _pwrite_all(fd, data, off)

                _run_concurrently(fetch, range(math.ceil(size / part)), self.max_concurrency)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
        except ObjectExistsError:  # 412 on If-Match: the object changed while we read it
            raise StorageError(f"s3://{self.bucket}/{key} changed during download; retry") from None
        finally:
            if fd >= 0:
                os.close(fd)
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.debug("get_file s3://%s/%s (%d bytes)", self.bucket, full, size)

    def list(self, prefix: str = "", *, start_after: str = "") -> list[str]:
        prefix = scoped_list_prefix(prefix, self.prefix)
        full_prefix = f"{self.root}/{prefix}" if self.root else prefix
        kw = {"StartAfter": f"{self.root}/{start_after}" if self.root else start_after} if start_after else {}
        keys: list[str] = []
        with self._translate("list", prefix or "/"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full_prefix, **kw
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = self._relative(obj["Key"])
                    if in_scope(key, self.prefix):
                        keys.append(key)
        return sorted(keys)


    # ---- pinned reads of data in place (datasets.inplace) ------------------------------------------------

    def versioning_enabled(self) -> bool:
        """Whether the bucket keeps object versions (a suspended or never-enabled bucket does not)."""
        with self._translate("get_bucket_versioning", "/"):
            return self._client.get_bucket_versioning(Bucket=self.bucket).get("Status") == "Enabled"

    def list_objects(self, prefix: str = "", *, versions: bool = False) -> list[ObjectInfo]:
        """Every object under `prefix` with its size and ETag (and, with `versions`, the current version's id;
        deleted keys are left out), sorted by key. Keys are relative to the store's root."""
        prefix = scoped_list_prefix(prefix, self.prefix)
        full_prefix = f"{self.root}/{prefix}" if self.root else prefix
        out: list[ObjectInfo] = []
        op = "list_object_versions" if versions else "list_objects_v2"
        with self._translate(op, prefix or "/"):
            for page in self._client.get_paginator(op).paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Versions" if versions else "Contents", ()):
                    if versions and not obj.get("IsLatest"):
                        continue
                    key = self._relative(obj["Key"])
                    if in_scope(key, self.prefix):
                        out.append(ObjectInfo(key, int(obj["Size"]), obj.get("ETag", ""),
                                              obj.get("VersionId") if versions else None))
        return sorted(out, key=lambda o: o.key)

    def get_range_pinned(self, key: str, byte_range: tuple[int, int], *, etag: str = "",
                         version_id: str | None = None) -> bytes:
        """Bytes [start, end) of one pinned object: of version `version_id` when given, else only while its ETag
        is still `etag`. Raises ObjectChangedError when that version or ETag is gone (overwritten or deleted)."""
        full = self._full(key)
        start, end = byte_range
        if end <= start:
            return b""
        kw: dict[str, Any] = {"Key": full, "Range": f"bytes={start}-{end - 1}"}
        if version_id:
            kw["VersionId"] = version_id
        elif etag:
            kw["IfMatch"] = etag
        try:
            return self._read_body("get_range", key, **kw)
        except (ObjectExistsError, ObjectNotFoundError):  # 412: the ETag moved on; 404: the key or version is gone
            raise ObjectChangedError(key, etag, version_id) from None
        except StorageError as e:
            if getattr(e, "s3_code", None) in ("NoSuchVersion", "InvalidArgument") and version_id:
                raise ObjectChangedError(key, etag, version_id) from None
            raise


def _body_size(body: Any) -> int:
    if isinstance(body, bytes | bytearray | memoryview):
        return len(body)
    return os.fstat(body.fileno()).st_size


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _run_concurrently(fn: Callable[[int], Any], items: range, max_workers: int) -> list[Any]:
    """fn over items on a thread pool, results in order; the first failure cancels what has not started."""
    if len(items) == 1:
        return [fn(items[0])]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(items)), thread_name_prefix="s3") as ex:
        futures: list[Future[Any]] = [ex.submit(fn, i) for i in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                for g in futures:
                    g.cancel()
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
