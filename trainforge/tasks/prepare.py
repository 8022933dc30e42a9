"""The steps before training: validate, resolve the dataset version, plan, provision, write the worker config.

Plain functions (tested without Prefect); `trainforge.tasks` wraps them as Prefect tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.contract.config import ResolvedDataset, SegmentConfig
from trainforge.datasets.refs import resolve_reference
from trainforge.datasets.tokenizer_match import tokenizer_problem
from trainforge.home import home
from trainforge.plan.cluster import ClusterSpec, LauncherSpec
from trainforge.plan.job import auto_checkpoint_interval
from trainforge.plan.job import (
    make_plan as make_plan,  # re-exported: the flow's steps and the CLI call it from here
)
from trainforge.registry.checkpoints import export_safetensors
from trainforge.registry.jobs import JobStore
from trainforge.registry.tracking import Tracker
from trainforge.spec import JobSpec, Problem, SpecError, is_weights_folder
from trainforge.validate import ValidationReport, validate_document


class JobRejected(ValueError):
    """Validation failed: nothing was started or written."""


def validate_report(doc: dict[str, Any], source: str, base_dir: Path,
                    cluster: ClusterSpec | None = None) -> ValidationReport:
    """The one validation of a submit: the spec and the layout it resolved (make_plan reuses it, no second
    resolution). Raises JobRejected with every problem."""
    report = validate_document(doc, source, base_dir, cluster)
    if not report.ok():
        raise JobRejected(str(SpecError(report.errors(), source)))
    assert report.spec is not None
    return report


def validate_spec(doc: dict[str, Any], source: str, base_dir: Path, cluster: ClusterSpec | None = None) -> JobSpec:
    spec = validate_report(doc, source, base_dir, cluster).spec
    assert spec is not None
    return spec


def resolve_dataset(spec: JobSpec, base_dir: Path, pinned: str | None = None) -> dict[str, Any]:
    """The version the job trains on: what `dataset.ref` names now, or `pinned` (a resumed job's own version)."""
    ds = resolve_reference(pinned or spec.dataset.ref, base_dir, spec.dataset)
    _quality_gate(spec, base_dir, ds)
    if ds.in_place:
        return _in_place_dataset(spec, base_dir, ds)
    mismatch = tokenizer_problem(spec, ds.manifest.tokenizer, base_dir, f"dataset {ds.name}@{ds.version[:12]}")
    if mismatch is not None:  # every scheme, lakeFS and remote catalogs too: validate saw only the local ones
        raise JobRejected(str(SpecError([mismatch], spec.name)))
    license_ = ds.license
    warnings = []
    if spec.dataset.license and spec.dataset.license != ds.license:
        warnings.append(f"spec says license {spec.dataset.license!r} but the dataset version records "
                        f"{ds.license!r}; the dataset's own license is recorded")
    out = {"ref": spec.dataset.ref, "pinned_ref": ds.ref, "name": ds.name, "version": ds.version, "license": license_,
           "path": str(ds.path), "num_samples": ds.manifest.num_samples, "sample_len": ds.manifest.sample_len,
           "vocab_size": ds.manifest.vocab_size, "eval_fraction": spec.dataset.eval_fraction, "warnings": warnings}
    if spec.dataset.transforms or spec.dataset.num_workers:  # online preprocessing (absent: read in the trainer)
        out.update(transforms=list(spec.dataset.transforms), num_workers=spec.dataset.num_workers)
    return out


def _quality_gate(spec: JobSpec, base_dir: Path, ds: Any) -> None:
    """Before anything is allocated: the version's stored report passed, or (an s3:// prefix, a team suite not
    run on it yet) the gate runs now and passes (datasets/gate.py). A failure refuses the job, with the failures."""
    if not (ds.in_place or spec.dataset.expectations) or not ds.ref.startswith(("s3://", "catalog://")):
        return  # catalog refs were gated while resolving; file:// and lakeFS versions have no report store here
    from trainforge.datasets.catalog import CatalogError
    from trainforge.datasets.gate import gate_for_submit, load_suite
    from trainforge.datasets.inplace import DataFormatError, DatasetChangedError
    from trainforge.datasets.quality import SuiteError
    from trainforge.infra.storage import PermissionDeniedError, StorageError

    field = "dataset.expectations" if spec.dataset.expectations else "dataset.ref"
    try:
        gate_for_submit(ds, load_suite(spec.dataset.expectations, base_dir))
    except (CatalogError, SuiteError, DataFormatError, DatasetChangedError, PermissionDeniedError,
            StorageError) as exc:
        raise JobRejected(str(SpecError([Problem(field, str(exc), spec.dataset.expectations or spec.dataset.ref,
                                                 "fix the data (or the suite) and resubmit; the stored report lists "
                                                 "every failed expectation")], spec.name))) from None


def _in_place_dataset(spec: JobSpec, base_dir: Path, ds: Any) -> dict[str, Any]:
    """The record of a pinned s3:// prefix: read in place with the spec's tokenizer (byte-level by default, or
    its tokenizer.json, kept beside the version by content digest) in samples of seq_len + 1 tokens."""
    from trainforge.datasets import tokenizer
    from trainforge.datasets.tokenizer_match import wanted_file
    from trainforge.datasets.training_data import save_in_place_tokenizer

    file = wanted_file(spec, base_dir)
    if file is None:
        name, vocab = tokenizer.NAME, tokenizer.VOCAB_SIZE
    else:
        text = tokenizer.read_tokenizer_json(file)
        name, vocab = save_in_place_tokenizer(ds.path, text), tokenizer.JsonTokenizer(text).vocab_size
    out = {"ref": spec.dataset.ref, "pinned_ref": f"catalog://{ds.name}@{ds.version}", "name": ds.name,
           "version": ds.version, "license": ds.license, "path": str(ds.path), "num_samples": 0,
           "sample_len": spec.training.seq_len + 1, "vocab_size": vocab, "eval_fraction": spec.dataset.eval_fraction,
           "tokenizer": name, "warnings": []}
    if spec.dataset.transforms or spec.dataset.num_workers:
        out.update(transforms=list(spec.dataset.transforms), num_workers=spec.dataset.num_workers)
    return out


def check_dataset_fits(spec: JobSpec, dataset: dict[str, Any], plan: dict[str, Any]) -> None:
    problems = []
    if dataset["sample_len"] < spec.training.seq_len + 1:
        problems.append(Problem("training.seq_len", f"the dataset's samples hold {dataset['sample_len']} tokens, "
                                f"fewer than seq_len + 1 = {spec.training.seq_len + 1}", spec.training.seq_len,
                                f"use seq_len <= {dataset['sample_len'] - 1}"))
    if dataset["vocab_size"] > plan["model"]["vocab"]:
        problems.append(Problem("model.vocab", f"the dataset's tokenizer has {dataset['vocab_size']} ids, more "
                                "than the model's vocabulary", plan["model"]["vocab"],
                                f"set model.vocab >= {dataset['vocab_size']}"))
    if problems:
        raise JobRejected(str(SpecError(problems, spec.name)))


def code_commit(repo: Path, pinned: str | None) -> str:
    """The commit that runs: the pinned one, else the repository's HEAD (+ '-dirty' with local changes)."""
    if pinned:
        return pinned
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unversioned"


def code_dir(spec: JobSpec, base_dir: Path) -> Path:
    return (base_dir / spec.code.repo).resolve() if "://" not in spec.code.repo else base_dir


def storage_url() -> str:
    return os.environ.get("TRAINFORGE_STORAGE_URL") or (home() / "store").as_uri()


def check_store_reaches_nodes(url: str, launcher: LauncherSpec) -> None:
    """A gang on other machines (`hosts`) reads and writes everything through the store (checkpoints, the channel,
    its inputs): one that is a folder on this host (a file:// URL or a plain path) is out of their reach, unless
    every host mounts it."""
    if launcher.backend != "hosts" or url.startswith("s3://") or launcher.shared_filesystem:
        return
    raise JobRejected(
        f"the object store {url} is a folder on the flow's host, which the cluster's other machines cannot reach "
        "(launcher.backend: hosts). Fix: set TRAINFORGE_STORAGE_URL to an s3:// bucket every host reaches "
        "(docs/production.md, \"Running on your machines\"), or set launcher.shared_filesystem: true if every host "
        "mounts that folder at the same path")


def worker_config(spec: JobSpec, job_id: str, run_dir: Path, base_dir: Path, dataset: dict[str, Any],
                  plan: dict[str, Any], commit: str, init_weights: str | None = None,
                  code_path: str | None = None) -> SegmentConfig:
    """The job's SegmentConfig from what the flow resolved once (the validated spec, the dataset, the plan)."""
    interval = spec.checkpoint.interval_steps
    if interval == "auto":
        interval = auto_checkpoint_interval(spec, plan)
    return SegmentConfig.build(spec, ResolvedDataset.from_resolution(dataset), plan, job_id=job_id,
                               run_dir=str(run_dir), storage_url=storage_url(),
                               staging_dir=str(home() / "staging" / job_id),
                               code_dir=code_path or str(code_dir(spec, base_dir)), code_commit=commit,
                               checkpoint_interval=int(interval), init_weights=init_weights)


class InitWeightsError(JobRejected):
    """`init_from` names weights that cannot be found or read (nothing was allocated)."""


@dataclass(frozen=True)
class InitWeights:
    path: str
    """One safetensors file of the parent's weights in trainforge's names, loaded by every worker before step 0."""
    parent: str
    """The lineage node the job is fine-tuned from (checkpoint, model version, or outside weights)."""


def resolve_init_weights(spec: JobSpec, run_dir: Path, base_dir: Path | None = None,
                         dataset: dict[str, Any] | None = None) -> InitWeights | None:
    """Fine-tuning: materialise the parent's weights as one safetensors file the workers load before step 0.

    `JOB@STEP` exports that committed checkpoint of an earlier job (verified against its manifest);
    `models:/team.name/3` (or `team.name/3`) downloads the registered model version's safetensors from MLflow;
    a Hugging Face Llama folder (a path, relative to the spec's folder, or an `s3://` prefix) is checked against
    the model section (and, where it ships a tokenizer.json, against the tokenizer of `dataset`, the flow's
    resolved dataset), converted, and recorded in lineage as outside weights (tasks/init_folder.py)."""
    if not spec.init_from:
        return None
    from trainforge.registry.lineage import LineageStore, parse_target

    out = run_dir / "init"
    if is_weights_folder(spec.init_from):
        from trainforge.tasks import init_folder

        try:
            path, weights = init_folder.materialise(spec, base_dir or run_dir, out, _data_tokenizer(dataset))
        except init_folder.FolderError as exc:
            raise InitWeightsError(f"init_from {spec.init_from!r}: {exc}") from None
        store = LineageStore()
        node = store.record_weights(weights.source, weights.sha256, license=weights.license,
                                    file_list=[(f"{weights.source.rstrip('/')}/{n}", h) for n, h in weights.files])
        return InitWeights(str(path), node)
    target = parse_target(spec.init_from)
    if target.startswith("checkpoint:"):
        job, _, step = target.removeprefix("checkpoint:").rpartition("@")
        try:
            parent = JobStore().get(job)
        except LookupError as exc:
            raise InitWeightsError(f"init_from {spec.init_from!r}: {exc}") from None
        config_path = parent.folder / "worker-config.json"
        if not config_path.is_file():
            raise InitWeightsError(f"init_from {spec.init_from!r}: job {job} never trained, it has no checkpoints")
        try:
            export_safetensors(config_path, json.loads(config_path.read_text()), int(step), out)
        except Exception as exc:
            raise InitWeightsError(f"init_from {spec.init_from!r}: cannot export step {step} of {job}: {exc}") from None
        return InitWeights(str(out / "model.safetensors"), target)
    if target.startswith("model:"):
        name, _, version = target.removeprefix("model:").rpartition("/")
        try:
            source = Tracker().model_version(name, version).source
            import mlflow.artifacts

            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(out)))
        except Exception as exc:
            raise InitWeightsError(f"init_from {spec.init_from!r}: model version not readable: {exc}") from None
        # trainforge's own names: the top-level file, not the Hugging Face copy under hf/
        found = sorted(local.rglob("model.safetensors"), key=lambda p: (len(p.parts), str(p))) \
            if local.is_dir() else [local]
        if not found:
            raise InitWeightsError(f"init_from {spec.init_from!r}: the model version has no model.safetensors")
        return InitWeights(str(found[0]), target)
    raise InitWeightsError(f"init_from {spec.init_from!r} names a {target.split(':')[0]}, not a checkpoint "
                           "(JOB@STEP) or a model version (models:/name/N)")


def _data_tokenizer(dataset: dict[str, Any] | None) -> tuple[str, str] | None:
    """(tokenizer id, name for messages) of a resolved dataset, from its version folder's manifest."""
    if not dataset or not dataset.get("path"):
        return None
    manifest = Path(dataset["path"]) / "manifest.json"
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text())["tokenizer"], f"dataset {dataset['name']}@{str(dataset['version'])[:12]}"
