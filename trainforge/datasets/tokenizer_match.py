"""Does a job's data speak its model's vocabulary? The tokenizer a spec names (`dataset.tokenizer`), or the one a
Hugging Face `init_from` folder ships, against the tokenizer a dataset version was built with. Pure apart from
reading the named tokenizer.json; `validate` runs it on the versions it resolves, submit on every version before
the gang is provisioned."""

from __future__ import annotations

from pathlib import Path

from trainforge.datasets import tokenizer
from trainforge.spec import JobSpec, Problem, is_weights_folder, weights_folder_location

BYTE_LEVEL_NAMES = ("byte-level", "byte", tokenizer.NAME)
BUILD_WITH = "trainforge datasets build SOURCE --out catalog://NAME --license ID --tokenizer "
"""The command a fix names (followed by the tokenizer to build with)."""


def wanted_file(spec: JobSpec, base_dir: Path) -> Path | None:
    """The tokenizer.json `dataset.tokenizer` names, resolved against the spec's folder (None: byte-level or unset)."""
    wanted = spec.dataset.tokenizer
    if wanted is None or wanted.strip().lower() in BYTE_LEVEL_NAMES:
        return None
    path = Path(wanted.removeprefix("file://")).expanduser()
    try:
        return tokenizer.tokenizer_file(path if path.is_absolute() else base_dir / path)
    except OSError:  # an over-long name: reading it says what is wrong
        return path if path.is_absolute() else base_dir / path


def spec_tokenizer_problems(spec: JobSpec, base_dir: Path) -> list[Problem]:
    """`dataset.tokenizer` must name a readable tokenizer.json (checked whatever the dataset's scheme)."""
    file = wanted_file(spec, base_dir)
    if file is None:
        return []
    try:
        tokenizer.read_tokenizer_json(file)
    except tokenizer.TokenizerError as exc:
        return [Problem("dataset.tokenizer", str(exc), spec.dataset.tokenizer,
                        "name a Hugging Face tokenizer.json (relative to the spec file) or a folder holding one, "
                        "or write byte-level")]
    return []


def describe(manifest_tokenizer: str) -> str:
    if manifest_tokenizer == tokenizer.NAME:
        return "the built-in byte-level tokenizer"
    digest = manifest_tokenizer.rsplit(":", 1)[-1][:12]
    if tokenizer.is_bpe(manifest_tokenizer):
        return f"a BPE trained on its source (tokenizer.json sha256 {digest}...)"
    if tokenizer.is_pretrained(manifest_tokenizer):
        return f"a pretrained tokenizer.json (sha256 {digest}...)"
    return repr(manifest_tokenizer)


def tokenizer_problem(spec: JobSpec, manifest_tokenizer: str, base_dir: Path, dataset: str) -> Problem | None:
    """None when the data was tokenized as the job expects; otherwise the problem, naming the field to change.
    `dataset` names the version for the message (e.g. `demo-text@1a2b3c4d5e6f`)."""
    wanted = spec.dataset.tokenizer
    if wanted is not None:
        file = wanted_file(spec, base_dir)
        if file is None:
            if manifest_tokenizer == tokenizer.NAME:
                return None
            return Problem("dataset.tokenizer", f"{dataset} was tokenized with {describe(manifest_tokenizer)}, not "
                           "the byte-level one", wanted, "point dataset.ref at a byte-level version, or set "
                           "dataset.tokenizer to the tokenizer.json it was built with")
        try:
            text = tokenizer.read_tokenizer_json(file)
        except tokenizer.TokenizerError:
            return None  # spec_tokenizer_problems reports the unreadable file
        if tokenizer.same_tokenizer(manifest_tokenizer, text):
            return None
        return Problem("dataset.tokenizer", f"{dataset} was tokenized with {describe(manifest_tokenizer)}, not with "
                       f"{file}", wanted, f"build the data with it ({BUILD_WITH}{file}), or point dataset.ref at a "
                       "version built with it")
    if not (spec.init_from and is_weights_folder(spec.init_from)):
        return None
    location = weights_folder_location(spec.init_from, base_dir)
    if location.startswith("s3://"):
        return None  # read at submit, once fetched (tasks/init_folder.py calls folder_tokenizer_problem)
    return folder_tokenizer_problem(spec, manifest_tokenizer, Path(location), dataset)


def folder_tokenizer_problem(spec: JobSpec, manifest_tokenizer: str, folder: Path, dataset: str) -> Problem | None:
    """A Hugging Face folder's tokenizer.json (if it ships one) against the data's, unless the spec named the
    tokenizer itself (`dataset.tokenizer` wins: the user chose)."""
    folder_file = folder / tokenizer.TOKENIZER_FILE
    if spec.dataset.tokenizer is not None or not folder_file.is_file():
        return None
    try:
        text = tokenizer.read_tokenizer_json(folder_file)
    except tokenizer.TokenizerError as exc:
        return Problem("init_from", str(exc), spec.init_from, "remove or repair the folder's tokenizer.json")
    if tokenizer.same_tokenizer(manifest_tokenizer, text):
        return None
    # the fix names the file as the user can reach it: a fetched s3 folder's copy is deleted after the check
    location = weights_folder_location(spec.init_from, folder) if spec.init_from else ""
    how = (f"download {location}{tokenizer.TOKENIZER_FILE}, then {BUILD_WITH}PATH" if location.startswith("s3://")
           else f"{BUILD_WITH}{folder_file}")
    return Problem("init_from", f"the folder's tokenizer.json is not the tokenizer {dataset} was built with "
                   f"({describe(manifest_tokenizer)}): the model would read ids of another vocabulary", spec.init_from,
                   f"build the data with the folder's tokenizer ({how}), or set dataset.tokenizer to "
                   "the data's own tokenizer to fine-tune on it anyway")
