"""What a gang on other machines needs from the flow's disk, published to the job's prefix in the object store.

The flow resolves the code tree, the dataset version and the initial weights on its own host (tasks/prepare.py,
tasks/code_source.py). A worker on another machine cannot read those paths, so before the first segment the flow
puts each into the store under the job's prefix, content-addressed (`inputs/...`), and records where in the
config (`SegmentConfig.inputs`); every worker fetches them into its node's folder (trainer/inputs.py `localize`).

- Code: one deterministic tar of the code folder (sorted, owner and times zeroed, `.git`, caches and virtual
  environments left out), so the same tree is the same key and a resumed job uploads nothing.
- Dataset: a version in a remote catalog or lakeFS is already where every node reads it (its `source.json`); a
  version on the flow's disk is published once per job (shards, tokenizer, manifest last).
- Initial weights: the one safetensors file, as is.

The job's workers may read their whole prefix and write only some folders of it (infra/storage/iam.py): the inputs
are readable by them and theirs to read only.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tarfile
from pathlib import Path

from trainforge.contract.config import SegmentConfig, ShippedInputs
from trainforge.datasets.catalog import SOURCE_FILE, load_version_dir, publish_version
from trainforge.datasets.manifest import MANIFEST_FILE
from trainforge.datasets.training_data import TOKENIZERS_DIR
from trainforge.infra.storage import ObjectExistsError, ObjectStore, open_store
from trainforge.registry.manifest import sha256_bytes, sha256_file
from trainforge.tasks.prepare import JobRejected

log = logging.getLogger(__name__)

CODE_SKIP = frozenset({".git", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                       "node_modules"})
"""Folders never shipped with the code: history, caches and environments are the node's own."""
MAX_CODE_BYTES = 256 * 2**20


class InputsError(JobRejected):
    """The flow cannot ship an input to the job's nodes (the message says which, why and what to do)."""


def code_tar(folder: Path, max_bytes: int = MAX_CODE_BYTES) -> bytes:
    """The code folder as a tar whose bytes depend only on the tree's names, contents and executable bits."""
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d not in CODE_SKIP and not os.path.islink(os.path.join(root, d)))
            for name in sorted(files):
                path = Path(root) / name
                if path.is_symlink():  # it may point anywhere on the flow's host: the node could not follow it
                    log.warning("code folder %s: symbolic link %s is not shipped to the job's nodes", folder, path)
                    continue
                if not path.is_file() or name.endswith((".pyc", ".pyo")):
                    continue
                st = path.stat()
                total += st.st_size
                if total > max_bytes:
                    raise InputsError(
                        f"code folder {folder} holds over {max_bytes // 2**20} MiB: too much to ship to the job's "
                        "nodes with every job. Fix: keep data and weights out of code.repo (the dataset and "
                        "init_from carry them), or point code.repo at a git repository the nodes fetch")
                info = tarfile.TarInfo(str(path.relative_to(folder)))
                info.size, info.mtime, info.mode = st.st_size, 0, 0o755 if st.st_mode & 0o100 else 0o644
                with path.open("rb") as f:
                    tar.addfile(info, f)
    return buf.getvalue()


def _put_once(store: ObjectStore, key: str, data: bytes | Path) -> None:
    """Create-only: a key is its content's hash, so one already there is the same bytes."""
    if store.exists(key):
        return
    with contextlib.suppress(ObjectExistsError):
        if isinstance(data, Path):
            store.put_file(key, data, if_none_match=True)
        else:
            store.put_bytes(key, data, if_none_match=True)


def publish_inputs(config: SegmentConfig, store: ObjectStore | None = None) -> SegmentConfig:
    """The config with `inputs` set, after putting the code, the dataset (if it lives on this host) and the
    initial weights under the job's prefix in its store."""
    store = store or open_store(config.storage_url)
    job = store.scoped(config.storage_prefix)
    code_folder = Path(config.code_dir)
    if not code_folder.is_dir():
        raise InputsError(f"code folder {code_folder} (code.repo) is not a folder on the flow's host")
    tar = code_tar(code_folder)
    code_sha = sha256_bytes(tar)
    code_key = f"inputs/code/{code_sha}.tar"
    _put_once(job, f"{config.storage_prefix}/{code_key}", tar)

    init_key = init_sha = None
    if config.init_weights:
        weights = Path(config.init_weights)
        init_sha = sha256_file(weights)
        init_key = f"inputs/init/{init_sha}.safetensors"
        _put_once(job, f"{config.storage_prefix}/{init_key}", weights)

    folder = Path(config.dataset.path)
    source = folder / SOURCE_FILE
    if config.dataset.in_place:  # an s3:// prefix: its manifest (and tokenizer) ship; the objects stay where they are
        version = load_version_dir(folder, config.dataset.ref)
        dataset_prefix = f"{config.storage_prefix}/inputs/datasets/{version.name}/versions/{version.version}"
        for path in sorted(folder.glob(f"{TOKENIZERS_DIR}/*.json")):
            _put_once(store, f"{dataset_prefix}/{TOKENIZERS_DIR}/{path.name}", path)
        _put_once(store, f"{dataset_prefix}/{MANIFEST_FILE}", folder / MANIFEST_FILE)  # last: the commit point
        dataset_store = config.storage_url
    elif source.is_file():  # a remote catalog or lakeFS: the nodes stream from where it is
        src = json.loads(source.read_text())
        dataset_store, dataset_prefix = src["store_url"], src["prefix"]
    else:  # on this host's disk: a copy for the job, keyed by the version (content-addressed)
        version = load_version_dir(folder, config.dataset.ref)
        dataset_prefix = f"{config.storage_prefix}/inputs/datasets/{version.name}/versions/{version.version}"
        publish_version(store, dataset_prefix, version.manifest, folder)
        dataset_store = config.storage_url
    inputs = ShippedInputs(code=code_key, code_sha256=code_sha, init_weights=init_key, init_weights_sha256=init_sha,
                           dataset_store=dataset_store, dataset_prefix=dataset_prefix)
    return config.model_copy(update={"inputs": inputs})

