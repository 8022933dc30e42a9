"""Dry-run validation: every check that can fail a job, run before any process starts or GPU is taken.

`validate_document` returns a `ValidationReport` listing every problem at once (schema, layout, memory, code,
dataset, cluster, combinations). Checks that need a system this machine cannot reach are reported as
"not-checked" with the reason, never passed silently; `strict=True` turns them into errors.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.plan.cluster import ClusterSpec, default_cluster
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout, layout_problems
from trainforge.plan.model import ModelShape, shape_from_spec
from trainforge.plan.support import engine_choice_problems
from trainforge.spec import (
    JobSpec,
    PipelineSchedule,
    Problem,
    SpecError,
    is_remote_repo,
    is_weights_folder,
    parse_spec,
    read_document,
    weights_folder_location,
)
from trainforge.trainer.models.hf_config import (
    HF_CONFIG,
    HFFormatError,
    folder_problems,
    read_hf_config,
    shape_numbers,
)

GiB = 2**30

# A dataset checker returns None when the reference resolves, else a Problem (error or not-checked).
DatasetChecker = Callable[[JobSpec, Path], "Problem | None"]


@dataclass
class ValidationReport:
    source: str
    spec: JobSpec | None = None
    problems: list[Problem] = field(default_factory=list)
    layout: Layout | None = None
    memory_per_gpu_bytes: int | None = None
    unreadable: bool = False

    def errors(self, strict: bool = False) -> list[Problem]:
        bad = {"error", "not-checked"} if strict else {"error"}
        return [p for p in self.problems if p.severity in bad]

    def ok(self, strict: bool = False) -> bool:
        return not self.unreadable and not self.errors(strict)

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        return {
            "source": self.source,
            "valid": self.ok(strict),
            "unreadable": self.unreadable,
            "strict": strict,
            "counts": {sev: sum(p.severity == sev for p in self.problems)
                       for sev in ("error", "not-checked", "warning")},
            "job": self.spec.name if self.spec else None,
            "layout": None if self.layout is None else self.layout.describe(),
            "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
            "problems": [p.to_dict() for p in self.problems],
        }


def validate_file(
    path: str | Path,
    cluster: ClusterSpec | None = None,
    dataset_checker: DatasetChecker | None = None,
) -> ValidationReport:
    try:
        doc = read_document(path)
    except SpecError as exc:
        return ValidationReport(str(path), problems=exc.problems, unreadable=True)
    return validate_document(doc, str(path), Path(path).resolve().parent, cluster, dataset_checker)


def validate_document(
    doc: Any,
    source: str = "<spec>",
    base_dir: Path | None = None,
    cluster: ClusterSpec | None = None,
    dataset_checker: DatasetChecker | None = None,
) -> ValidationReport:
    report = ValidationReport(source)
    try:
        spec = parse_spec(doc, source)
    except SpecError as exc:
        report.problems = exc.problems
        return report
    report.spec = spec
    report.problems = semantic_problems(
        spec, base_dir or Path.cwd(), cluster or default_cluster(), dataset_checker or default_dataset_checker(), report
    )
    return report


def semantic_problems(
    spec: JobSpec, base_dir: Path, cluster: ClusterSpec, dataset_checker: DatasetChecker, report: ValidationReport
) -> list[Problem]:
    problems: list[Problem] = []
    problems += _cluster_problems(spec, cluster)
    problems += _combination_problems(spec)
    problems += _code_problems(spec, base_dir)
    problems += _dataset_problems(spec, base_dir, dataset_checker)
    shape = None
    if spec.code.mode == "managed":
        try:
            shape = shape_from_spec(spec.model, spec.name)
        except ValueError as exc:
            problems.append(Problem("model", str(exc), None,
                                    "set model.preset (e.g. llama-7b) or layers/hidden/heads/vocab"))
    if shape is not None and spec.init_from and is_weights_folder(spec.init_from):
        problems += _init_folder_problems(spec.init_from, shape, spec.model.experts, base_dir)
    if shape is not None:
        shape_problems = _shape_problems(shape)
        problems += shape_problems
        if not shape_problems:
            problems += _layout_and_memory_problems(spec, shape, cluster, report)
    else:
        problems += _script_layout_problems(spec)
    problems += _schedule_problems(spec)
    problems += _checkpoint_and_eval_problems(spec)
    return problems


def _dataset_problems(spec: JobSpec, base_dir: Path, dataset_checker: DatasetChecker) -> list[Problem]:
    from trainforge.datasets.tokenizer_match import spec_tokenizer_problems

    try:
        found = dataset_checker(spec, base_dir)
    except (OSError, ValueError) as exc:  # e.g. a file:// path the OS refuses (too long, NUL byte)
        found = Problem("dataset.ref", f"cannot be resolved: {exc}", spec.dataset.ref,
                        "give a catalog:// name or a file:// path to a dataset version folder")
    return (spec_tokenizer_problems(spec, base_dir) + _expectations_problems(spec, base_dir)
            + ([] if found is None else [found]))


def _expectations_problems(spec: JobSpec, base_dir: Path) -> list[Problem]:
    """`dataset.expectations` names a readable great-expectations suite whose every expectation is known."""
    if not spec.dataset.expectations:
        return []
    from trainforge.datasets.gate import load_suite
    from trainforge.datasets.quality import SuiteError

    try:
        load_suite(spec.dataset.expectations, base_dir)
    except SuiteError as exc:
        return [Problem("dataset.expectations", str(exc), spec.dataset.expectations,
                        'write a JSON suite: {"name": "team", "expectations": [{"type": '
                        '"expect_column_values_to_be_in_set", "kwargs": {"column": "lang", "value_set": ["en"]}}]}')]
    except ImportError as exc:  # the quality extra is not installed here
        return [Problem("dataset.expectations", f"cannot be checked: {exc}", spec.dataset.expectations,
                        "pip install 'trainforge[quality]'")]
    return []


def _init_folder_problems(init_from: str, shape: ModelShape, experts: int, base_dir: Path) -> list[Problem]:
    """A local Hugging Face folder is read here (config.json only); a remote prefix is read at submit, still before
    the gang is provisioned (tasks/init_folder.py)."""
    location = weights_folder_location(init_from, base_dir)
    if location.startswith("s3://"):
        return [Problem("init_from", "a remote Hugging Face folder is read at submit time; its config.json was not "
                        "checked here", init_from, "use --strict only where the prefix is readable", "not-checked")]
    folder = Path(location)
    if not (folder / HF_CONFIG).is_file():
        return [Problem("init_from", f"{folder} has no {HF_CONFIG}: not a Hugging Face model folder", init_from,
                        "point init_from at the folder holding config.json and model.safetensors (relative to "
                        "the spec file), or at JOB@STEP / models:/NAME/VERSION")]
    try:
        config = read_hf_config(folder)
    except HFFormatError as exc:
        return [Problem("init_from", str(exc), init_from, "start from a Llama model folder")]
    fix = "set the model section to the folder's numbers, or start from another folder"
    return [Problem("init_from", p, init_from, fix) for p in folder_problems(config, shape_numbers(shape), experts)]


def _shape_problems(shape: ModelShape) -> list[Problem]:
    """The resolved shape (preset + overrides) must be a consistent model; the spec only checks given fields."""
    out: list[Problem] = []
    if shape.hidden % shape.heads:
        out.append(Problem("model.heads", f"hidden ({shape.hidden}) is not divisible by heads ({shape.heads})",
                           shape.heads, "use a head count that divides hidden"))
    if shape.heads % shape.kv_heads:
        out.append(Problem("model.kv_heads", f"heads ({shape.heads}) is not a multiple of kv_heads "
                           f"({shape.kv_heads})", shape.kv_heads, "use a kv_heads that divides heads"))
    return out


def _script_layout_problems(spec: JobSpec) -> list[Problem]:
    """Script mode has no model shape, but explicit degrees must still multiply to the world size."""
    par, world = spec.parallelism, spec.resources.world_size
    tp, pp = par.tp or 1, par.pp or 1
    if par.dp is None and world % (tp * pp):
        return [Problem("parallelism", f"world size ({world}) is not divisible by tp ({tp}) * pp ({pp})", None,
                        f"choose degrees whose product divides {world}, or change resources.min_gpus")]
    dp = par.dp if par.dp is not None else world // (tp * pp)
    if dp * tp * pp != world:
        return [Problem("parallelism", f"dp({dp}) * tp({tp}) * pp({pp}) = {dp * tp * pp} != world size ({world})",
                        None, "make the product of the degrees equal resources.min_gpus, or leave dp unset")]
    per_step = dp * (par.micro_batch_size or 1)
    if spec.training.global_batch_size % per_step:
        return [Problem("training.global_batch_size", f"global batch ({spec.training.global_batch_size}) is not a "
                        f"multiple of dp ({dp}) * micro-batch ({par.micro_batch_size or 1}) = {per_step}",
                        spec.training.global_batch_size, f"use a multiple of {per_step}")]
    return []


def _schedule_problems(spec: JobSpec) -> list[Problem]:
    par = spec.parallelism
    pp = par.pp or 1
    out: list[Problem] = []
    if par.pipeline_schedule == PipelineSchedule.INTERLEAVED_1F1B and par.virtual_stages < 2:
        out.append(Problem("parallelism.virtual_stages", "interleaved-1f1b needs at least 2 virtual stages per "
                           "pipeline rank", par.virtual_stages,
                           "set virtual_stages: 2 (or more), or use pipeline_schedule: 1f1b"))
    if par.virtual_stages > 1 and par.pp is not None and pp < 2:
        out.append(Problem("parallelism.virtual_stages", f"virtual stages ({par.virtual_stages}) need pipeline "
                           f"parallelism, but pp is {pp}", par.virtual_stages,
                           "set pp >= 2, or remove virtual_stages and pipeline_schedule"))
    elif par.pipeline_schedule != PipelineSchedule.ONE_F_ONE_B and par.pp is not None and pp < 2:
        out.append(Problem("parallelism.pipeline_schedule", f"is ignored without pipeline parallelism (pp is {pp})",
                           par.pipeline_schedule.value, "remove pipeline_schedule or set pp >= 2", "warning"))
    return out


def _checkpoint_and_eval_problems(spec: JobSpec) -> list[Problem]:
    ckpt, total = spec.checkpoint, spec.training.total_steps
    out: list[Problem] = []
    if isinstance(ckpt.interval_steps, int) and ckpt.interval_steps > total:
        out.append(Problem("checkpoint.interval_steps",
                           f"is larger than the run ({total} steps): only the final checkpoint will be written",
                           ckpt.interval_steps, "lower it to get intermediate checkpoints", "warning"))
    if ckpt.keep_every and isinstance(ckpt.interval_steps, int) and ckpt.keep_every % ckpt.interval_steps:
        out.append(Problem("checkpoint.keep_every", f"is not a multiple of interval_steps ({ckpt.interval_steps}), "
                           "so few checkpoints land on it", ckpt.keep_every,
                           f"use a multiple of {ckpt.interval_steps}", "warning"))
    if ckpt.keep_best is not None and not spec.evaluation.enabled:
        out.append(Problem("checkpoint.keep_best", f"ranks checkpoints by {ckpt.keep_best.metric!r}, but evaluation "
                           "is disabled", ckpt.keep_best.metric,
                           "set evaluation.enabled: true, or remove keep_best"))
    if spec.evaluation.enabled and spec.dataset.eval_fraction == 0:
        out.append(Problem("dataset.eval_fraction", "is 0, so there is no held-out split to evaluate on", 0,
                           "set eval_fraction (e.g. 0.01), or evaluation.enabled: false"))
    warmup = spec.training.lr_schedule.warmup_steps
    if warmup >= total:
        out.append(Problem("training.lr_schedule.warmup_steps", f"is not shorter than the run ({total} steps): the "
                           "learning rate never reaches its peak", warmup,
                           f"use fewer than {total} warm-up steps", "warning"))
    return out


def _cluster_problems(spec: JobSpec, cluster: ClusterSpec) -> list[Problem]:
    res = spec.resources
    gpu = res.gpu_type.value
    available = cluster.total_gpus(gpu)
    if available == 0:
        return [Problem("resources.gpu_type", f"cluster {cluster.name!r} has no {gpu} GPUs", gpu,
                        f"use one of: {', '.join(cluster.gpu_types())}, or pass --cluster for another cluster")]
    out: list[Problem] = []
    wanted = res.max_gpus or res.min_gpus
    if res.min_gpus > available:
        out.append(Problem("resources.min_gpus", f"cluster {cluster.name!r} has only {available} {gpu} GPUs",
                           res.min_gpus, f"ask for at most {available}"))
    elif wanted > available:
        out.append(Problem("resources.max_gpus", f"cluster {cluster.name!r} has only {available} {gpu} GPUs",
                           wanted, f"lower max_gpus to {available}"))
    node = cluster.max_gpus_per_node(gpu)
    # A job smaller than a node uses min_gpus of one node, whatever gpus_per_node says (its default is 8).
    if min(res.gpus_per_node, wanted) > node:
        out.append(Problem("resources.gpus_per_node", f"{gpu} nodes of cluster {cluster.name!r} have {node} GPUs",
                           res.gpus_per_node, f"use gpus_per_node <= {node}"))
    if res.min_gpus > res.gpus_per_node and res.min_gpus % res.gpus_per_node:
        out.append(Problem("resources.min_gpus", f"a multi-node job must use whole nodes of {res.gpus_per_node} GPUs",
                           res.min_gpus, f"use a multiple of {res.gpus_per_node}"))
    if res.memory_per_node_gb is not None:
        biggest = max(g.memory_per_node_gb for g in cluster.groups_of(gpu))
        if res.memory_per_node_gb > biggest:
            out.append(Problem("resources.memory_per_node_gb", f"the largest {gpu} node has {biggest:g} GiB",
                               res.memory_per_node_gb, f"ask for at most {biggest:g}"))
    return out


def _combination_problems(spec: JobSpec) -> list[Problem]:
    out: list[Problem] = []
    par, code = spec.parallelism, spec.code
    if code.mode == "script" and code.framework != "pytorch" and (par.pp or 1) > 1:
        out.append(Problem("parallelism.pp", f"pipeline parallelism is applied by the platform only to PyTorch; "
                           f"a {code.framework} script must implement it itself", par.pp,
                           "remove parallelism.pp or use mode: managed with framework: pytorch"))
    if code.mode == "script" and ((par.tp or 1) > 1 or (par.ep or 1) > 1):
        out.append(Problem("parallelism", "tp/ep are applied by the platform in managed mode only; a script "
                           "builds its own model", {"tp": par.tp, "ep": par.ep},
                           "remove tp/ep or switch code.mode to managed"))
    if code.framework != "pytorch" and code.mode == "managed":
        out.append(Problem("code.framework", "managed mode runs the platform's PyTorch loop", code.framework,
                           "use mode: script for JAX or TensorFlow code"))
    sharding = par.sharding.value if par.sharding else None
    # What the engine cannot run, from the rules the advisor and the engine use (plan/support.py).
    for lp in engine_choice_problems(par.engine, sharding=sharding, tp=par.tp or 1, pp=par.pp or 1, ep=par.ep or 1):
        out.append(Problem(lp.field, lp.message, sharding if lp.field == "parallelism.sharding" else par.engine,
                           lp.fix))
    if par.engine == "deepspeed" and code.framework != "pytorch":
        out.append(Problem("parallelism.engine", f"DeepSpeed runs PyTorch only, not {code.framework}", "deepspeed",
                           "use engine: native, or framework: pytorch"))
    if spec.resources.gpu_type.value == "cpu" and spec.training.precision.value == "fp16":
        out.append(Problem("training.precision", "fp16 autocast is not supported on CPU workers", "fp16",
                           "use bf16 or fp32"))
    if code.mode == "script":
        ignored = [name for name in ("sharding", "activation_checkpointing") if getattr(par, name) is not None]
        if ignored:
            out.append(Problem(f"parallelism.{ignored[0]}", "is applied by the platform in managed mode only; a "
                               "script applies its own", getattr(par, ignored[0]).value,
                               "remove it, or use mode: managed", "warning"))
    if spec.model.experts and code.mode == "script":
        out.append(Problem("model.experts", "model architecture numbers only apply in managed mode",
                           spec.model.experts, "remove the model section or use mode: managed", "warning"))
    return out


def _code_problems(spec: JobSpec, base_dir: Path) -> list[Problem]:
    code = spec.code
    module, sep, func = code.entrypoint.partition(":")
    if code.mode == "managed" and (
        not sep or not func.isidentifier() or not all(p.isidentifier() for p in module.split("."))
    ):
        return [Problem("code.entrypoint", "managed mode needs `package.module:function`", code.entrypoint,
                        "e.g. trainforge.trainer.models.llama:build_model (or use mode: script for a script)")]
    if is_remote_repo(code.repo):
        return [Problem("code.repo", "a remote repository is fetched at submit time; its entrypoint was not "
                        "checked here", code.repo, "use --strict only where the repository is reachable",
                        "not-checked")]
    try:
        return _local_code_problems(code.entrypoint, code.mode, (base_dir / code.repo).resolve(), module)
    except (OSError, ValueError) as exc:  # a path the OS refuses (too long, NUL byte)
        return [Problem("code.repo", f"cannot be read: {exc}", code.repo, "give a readable local directory")]


def local_code_problems(entrypoint: str, mode: str, repo: Path) -> list[Problem]:
    """The entrypoint's checks against a tree on disk (a local repository, or a fetched commit's tree)."""
    return _local_code_problems(entrypoint, mode, repo, entrypoint.partition(":")[0])


def _local_code_problems(entrypoint: str, mode: str, repo: Path, module: str) -> list[Problem]:
    if not repo.is_dir():
        return [Problem("code.repo", "local repository path does not exist", str(repo),
                        "point code.repo at the directory holding your code (relative to the spec file)")]
    if mode == "script":
        script = (repo / entrypoint).resolve()
        if not script.is_relative_to(repo):
            return [Problem("code.entrypoint", f"script path leaves the repository {repo}", entrypoint,
                            "give the script's path inside code.repo")]
        if not script.is_file():
            return [Problem("code.entrypoint", f"script not found in {repo}", entrypoint,
                            "give the script's path relative to code.repo")]
        return []
    if _module_file(module, repo) is None:
        return [Problem("code.entrypoint", f"module {module!r} not found in {repo} nor installed", entrypoint,
                        "check the module path and that the file exists")]
    return []


def _module_file(module: str, repo: Path) -> Path | None:
    """Locate a module's source without importing it (importing user code could run anything)."""
    parts = module.split(".")
    for root in [repo, *_installed_roots(parts[0])]:
        candidate = root.joinpath(*parts)
        for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if path.is_file():
                return path
    return None


def _installed_roots(top: str) -> list[Path]:
    try:
        found = importlib.util.find_spec(top)  # top-level only: locates, does not execute the package
    except (ImportError, ValueError):
        return []
    if found is None or found.origin is None:
        return []
    origin = Path(found.origin)
    return [origin.parent.parent] if origin.name == "__init__.py" else [origin.parent]


def _layout_and_memory_problems(
    spec: JobSpec, shape: ModelShape, cluster: ClusterSpec, report: ValidationReport
) -> list[Problem]:
    from trainforge.plan.advisor import layout_memory
    from trainforge.plan.resolve import plan_request, resolve_layout

    out: list[Problem] = []
    try:
        layout = resolve_layout(spec, shape, cluster)
    except ValueError as exc:
        return [Problem("parallelism", str(exc), None, "set the degrees explicitly or change resources.min_gpus")]
    report.layout = layout
    world = spec.resources.world_size
    for lp in layout_problems(layout, shape, global_batch_size=spec.training.global_batch_size, world_size=world,
                              gpus_per_node=min(spec.resources.gpus_per_node, world)):
        out.append(Problem(lp.field, lp.message, None, lp.fix))
    out += _accumulation_problems(spec, layout) if not out else []
    if out:
        return out
    gpu = gpu_spec(spec.resources.gpu_type.value)
    # The advisor's own sizing (node size, the GPU's runtime overhead, the engine): a layout validate passes is one
    # the advisor would call fitting.
    mem = layout_memory(plan_request(spec, shape, cluster), layout)
    report.memory_per_gpu_bytes = mem.total_bytes
    if not mem.fits:
        parts = ", ".join(f"{i.name} {i.bytes / GiB:.1f}" for i in mem.items)
        out.append(Problem(
            "parallelism",
            f"the model does not fit: {mem.total_bytes / GiB:.1f} GiB per GPU needed ({parts} GiB) but one "
            f"{gpu.name} GPU has {gpu.memory_bytes / GiB:.1f} GiB (over by {(mem.total_bytes - mem.capacity_bytes) / GiB:.1f} "
            f"GiB) with layout {layout.describe()}",
            None,
            "use sharding: full-shard, more tp/pp, activation_checkpointing: full, a smaller micro_batch_size, "
            "or a GPU type with more memory (see `trainforge plan`)",
        ))
    return out


def _accumulation_problems(spec: JobSpec, layout: Layout) -> list[Problem]:
    """An explicit gradient_accumulation_steps must agree with batch / (dp * micro-batch)."""
    out: list[Problem] = []
    gbs, per_step = spec.training.global_batch_size, layout.dp * layout.micro_batch_size
    steps = gbs // per_step
    given = spec.training.gradient_accumulation_steps
    if given is not None and given != steps:
        fits = gbs % (layout.dp * given) == 0
        fix = (f"set parallelism.micro_batch_size to {gbs // (layout.dp * given)}" if fits else
               f"use gradient_accumulation_steps: {steps}") + ", or remove gradient_accumulation_steps"
        out.append(Problem("training.gradient_accumulation_steps", f"disagrees with the layout: global batch ({gbs}) "
                           f"/ (dp ({layout.dp}) * micro-batch ({layout.micro_batch_size})) = {steps}", given, fix))
    return out


def default_dataset_checker() -> DatasetChecker:
    def check(spec: JobSpec, base_dir: Path) -> Problem | None:
        """The reference resolves, and (where it did) to data tokenized as the job expects."""
        from trainforge.datasets.refs import check_and_resolve
        from trainforge.datasets.tokenizer_match import tokenizer_problem

        found, ds = check_and_resolve(spec.dataset.ref, base_dir, spec.dataset)
        if ds is None or ds.in_place:  # an in-place version is tokenized by each job with the spec's tokenizer
            return found
        return tokenizer_problem(spec, ds.manifest.tokenizer, base_dir, f"dataset {ds.name}@{ds.version[:12]}")

    return check


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
