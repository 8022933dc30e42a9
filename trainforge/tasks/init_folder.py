"""`init_from` a Hugging Face Llama folder: a local path or an `s3://bucket/prefix/`, read once per submit.

The folder is fetched (an object-store prefix: its config.json, model card, tokenizer.json and safetensors files
only; pickled `.bin` weights are never read), checked against the spec's model section and, where it ships a
tokenizer.json, against the dataset's tokenizer (validate.py checks a local folder before anything is allocated; a
remote one is checked here, still before the gang is provisioned), converted to
trainforge's tensor names (trainer/models/hf_llama.py) as the one safetensors file every fine-tune's workers
load, and recorded in lineage as a `weights:` node with its content hash and the license its model card names.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors.torch import save_file

from trainforge.datasets.tokenizer import TOKENIZER_FILE
from trainforge.datasets.tokenizer_match import folder_tokenizer_problem
from trainforge.plan.model import shape_from_spec
from trainforge.spec import JobSpec, weights_folder_location
from trainforge.trainer.models.hf_config import (
    HF_CONFIG,
    HFFormatError,
    folder_problems,
    read_hf_config,
    shape_numbers,
)

# What is fetched of a remote folder: the config, the model card (its license), the tokenizer and the safetensors
# weights.
_FETCHED_SUFFIXES = (".safetensors", ".safetensors.index.json")
_FETCHED_NAMES = (HF_CONFIG, "README.md", TOKENIZER_FILE)


class FolderError(ValueError):
    """The folder cannot be read, or holds a model the spec does not describe (the message says how to fix it)."""


@dataclass(frozen=True)
class FolderWeights:
    source: str
    """Where the folder was read: an absolute path or the `s3://` prefix."""
    sha256: str
    """The content hash of what was loaded (config.json and every weights file, by name; not the tokenizer)."""
    license: str
    """The model card's `license:` (README.md front matter), or "" when it names none."""
    files: tuple[tuple[str, str], ...]
    """(path under the source, sha256) of every file read: config.json, the weights, tokenizer.json if shipped."""


def config_problems(config: dict[str, Any], spec: JobSpec) -> list[str]:
    """Why this folder's model is not the spec's (each with how to fix it); empty when it loads exactly."""
    return folder_problems(config, shape_numbers(shape_from_spec(spec.model, spec.name)), spec.model.experts)


def fetch(source: str, dst: Path) -> Path:
    """The folder on local disk: a local source as is, a remote one downloaded into `dst` (config, model card,
    tokenizer.json and safetensors files only)."""
    if not source.startswith("s3://"):
        folder = Path(source)
        if not (folder / HF_CONFIG).is_file():
            raise FolderError(f"{folder} has no {HF_CONFIG}: not a Hugging Face model folder")
        return folder
    from trainforge.infra.storage import StorageError, open_store

    try:
        store = open_store(source.rstrip("/"))
        keys = [k for k in store.list() if "/" not in k and (k in _FETCHED_NAMES or k.endswith(_FETCHED_SUFFIXES))]
        if HF_CONFIG not in keys:
            raise FolderError(f"{source} has no {HF_CONFIG}: not a Hugging Face model folder (or not readable "
                              "with the platform's S3 credentials)")
        dst.mkdir(parents=True, exist_ok=True)
        for key in keys:
            store.get_file(key, dst / key)
    except FolderError:
        raise
    except (StorageError, OSError, ValueError) as exc:
        raise FolderError(f"{source}: cannot be read ({exc}); check the prefix and that the platform's S3 "
                          "credentials may read it") from None
    return dst


def card_license(folder: Path) -> str:
    """The `license:` of the model card's YAML front matter (Hugging Face's convention), or ""."""
    card = folder / "README.md"
    try:
        text = card.read_text(errors="replace")
    except OSError:
        return ""
    if not text.startswith("---"):
        return ""
    try:
        meta = yaml.safe_load(text.split("---", 2)[1])
    except (yaml.YAMLError, IndexError):
        return ""
    value = meta.get("license") if isinstance(meta, dict) else None
    return str(value) if isinstance(value, str) else ""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def materialise(spec: JobSpec, base_dir: Path, out: Path, data_tokenizer: tuple[str, str] | None = None
                ) -> tuple[Path, FolderWeights]:
    """Fetch, check and convert the spec's `init_from` folder into `out/model.safetensors` (trainforge's names).
    `data_tokenizer` is (the dataset version's tokenizer id, its name for messages): a folder whose tokenizer.json
    is another is refused (datasets/tokenizer_match.py). Raises FolderError with what to fix; nothing is left in
    `out` on failure."""
    assert spec.init_from
    source = weights_folder_location(spec.init_from, base_dir)
    downloaded = out / "hf"
    try:
        folder = fetch(source, downloaded)
        if data_tokenizer is not None:
            clash = folder_tokenizer_problem(spec, data_tokenizer[0], folder, data_tokenizer[1])
            if clash is not None:
                raise FolderError(f"{clash.message}. Fix: {clash.fix}")
        return _convert(spec, source, folder, out)
    finally:
        shutil.rmtree(downloaded, ignore_errors=True)  # a remote folder's copy: converted or refused, not kept


def _convert(spec: JobSpec, source: str, folder: Path, out: Path) -> tuple[Path, FolderWeights]:
    from trainforge.trainer.models.hf_llama import load_hf_folder

    try:
        config = read_hf_config(folder)
        problems = config_problems(config, spec)
        if problems:
            raise FolderError("; ".join(problems))
        state, _ = load_hf_folder(folder)
    except HFFormatError as exc:
        raise FolderError(str(exc)) from None
    weights = sorted(p.name for p in folder.iterdir() if p.name == HF_CONFIG or p.name.endswith(_FETCHED_SUFFIXES))
    files = tuple((name, _sha256(folder / name)) for name in weights)
    # the content hash (the weights: node's id) stays over config and weights: a folder's id does not change with
    # its tokenizer.json, which is listed with the files read
    content = hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in files).encode()).hexdigest()
    if (folder / TOKENIZER_FILE).is_file():
        files = tuple(sorted((*files, (TOKENIZER_FILE, _sha256(folder / TOKENIZER_FILE)))))
    target = out / "model.safetensors"
    partial = target.with_suffix(".partial")
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(partial), metadata={"format": "pt", "source": source, "sha256": content})
    partial.replace(target)  # the workers never see half a file
    return target, FolderWeights(source, content, card_license(folder), files)
