"""A worker on another machine fetches the job's code, dataset and initial weights into its node's folder.

The flow published them to the job's prefix in the object store (tasks/inputs.py) and named them in
`SegmentConfig.inputs`; `localize` returns the config with `code_dir`, `init_weights` and `dataset.path` pointing
at the node's copies, so nothing after it reads the flow's host. Under the node's lock the first rank downloads and
the others (and later segments, and torchrun restarts) find the copy there: every name is the content's hash, each
download is checked against it and renamed into place whole, so an interrupted fetch leaves nothing that looks
complete. A config without `inputs` (one host: the local backend) is returned as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from trainforge.contract.config import SegmentConfig
from trainforge.datasets.catalog import write_source_folder
from trainforge.infra.storage import ObjectStore, open_store
from trainforge.infra.storage.base import ObjectNotFoundError
from trainforge.infra.storage.credentials import with_job_credentials
from trainforge.registry.manifest import sha256_bytes, sha256_file

LOCK_TIMEOUT_S = 600.0
"""How long a rank waits for another rank of its node to finish fetching (a large code tree on a slow link)."""


class InputsFetchError(RuntimeError):
    """An input the flow published is missing or is not what the config says (a platform fault, not the user's).
    `the_jobs`: the input itself is gone or changed in the store (every node would fail the same); otherwise this
    node could not get it (the store out of its reach, a refused login, its own lock): the node's."""

    def __init__(self, message: str, *, the_jobs: bool = False):
        super().__init__(message)
        self.the_jobs = the_jobs


@contextlib.contextmanager
def _node_lock(folder: Path, timeout_s: float) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise InputsFetchError(f"another process held {folder / '.lock'} for over {timeout_s:.0f} s "
                                           "while fetching the job's inputs") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock, also when this process is killed


def _mismatch(key: str, got: str, sha256: str) -> InputsFetchError:
    return InputsFetchError(f"the job's input {key} has sha256 {got[:16]}..., its config says {sha256[:16]}...: "
                            "it changed in the store after the flow published it; resubmit the job", the_jobs=True)


@contextlib.contextmanager
def _fetching(store: ObjectStore, key: str) -> Iterator[None]:
    """A store error while fetching an input, said as what it is: the platform's, naming the key and the store."""
    try:
        yield
    except InputsFetchError:
        raise
    except Exception as exc:
        raise InputsFetchError(
            f"could not fetch the job's input {key} from {store.url}: {type(exc).__name__}: {exc}. The node must "
            "reach the job's object store (its endpoint and credentials in the node's environment), and the flow "
            "published the input before the segment started: a prefix deleted since needs a resubmit",
            the_jobs=isinstance(exc, ObjectNotFoundError)) from exc


def _code(store: ObjectStore, key: str, sha256: str, folder: Path) -> Path:
    final = folder / "code" / sha256
    if final.is_dir():
        return final
    with _fetching(store, key):
        data = store.get_bytes(key)  # at most tasks/inputs.py MAX_CODE_BYTES
    if (got := sha256_bytes(data)) != sha256:
        raise _mismatch(key, got, sha256)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=final.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(tmp, filter="data")  # no absolute paths, no '..', no device files
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _weights(store: ObjectStore, key: str, sha256: str, folder: Path) -> Path:
    """Streamed to a file (weights are gigabytes: never whole in memory), hashed from disk, renamed into place."""
    final = folder / "init" / f"{sha256}.safetensors"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".fetch-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with _fetching(store, key):
            store.get_file(key, tmp)
        if (got := sha256_file(tmp)) != sha256:
            raise _mismatch(key, got, sha256)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def _dataset_store(url: str) -> ObjectStore:
    """The store the shard readers stream from (datasets/stream.py `open_reader` opens the same)."""
    if url.startswith("lakefs://"):
        from trainforge.datasets.lakefs_catalog import open_lakefs_store

        return open_lakefs_store(url)  # type: ignore[return-value]
    return open_store(url)


def localize(cfg: SegmentConfig, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> SegmentConfig:
    """`cfg` with its inputs fetched into `{node_dir}/inputs` (see the module docstring)."""
    inputs = cfg.inputs
    if inputs is None:
        return cfg
    if cfg.node_dir is None:
        raise InputsFetchError("the segment config names inputs to fetch but no node folder (SegmentConfig.for_node)")
    folder = Path(cfg.node_dir) / "inputs"
    job = with_job_credentials(open_store(cfg.storage_url)).scoped(cfg.storage_prefix)
    with _node_lock(folder, lock_timeout_s):
        code = _code(job, f"{cfg.storage_prefix}/{inputs.code}", inputs.code_sha256, folder)
        weights = None
        if inputs.init_weights is not None and inputs.init_weights_sha256 is not None:
            weights = str(_weights(job, f"{cfg.storage_prefix}/{inputs.init_weights}", inputs.init_weights_sha256,
                                   folder))
        version = cfg.dataset.require_pinned()
        dataset_store = _dataset_store(inputs.dataset_store)
        with _fetching(dataset_store, f"{inputs.dataset_prefix}/manifest.json"):
            data = write_source_folder(folder / "datasets" / version, dataset_store, inputs.dataset_prefix,
                                       url=inputs.dataset_store)
    return cfg.model_copy(update={"code_dir": str(code), "init_weights": weights, "inputs": None,
                                  "dataset": cfg.dataset.model_copy(update={"path": str(data)})})

