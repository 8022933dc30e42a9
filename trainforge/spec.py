"""The JobSpec: the one declarative contract between an ML team and the platform.

A spec is loaded from YAML or JSON with :func:`load_spec` (or :func:`parse_spec` for an in-memory document).
Every user mistake becomes a :class:`SpecError` listing each problem with its field path, the bad value, why it
is wrong and how to fix it; nothing else escapes the loader. Model code never sees this object's topology: the
platform turns it into a resolved job config for the workers.

This module imports nothing else from trainforge (the layering test checks it).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


class _Model(BaseModel):
    """Strict base: unknown keys are errors, so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Priority(StrEnum):
    CRITICAL = "critical"
    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"
    PREEMPTIBLE = "preemptible"

    @property
    def rank(self) -> int:
        """Higher is more important (critical=4 ... preemptible=0)."""
        return list(reversed(Priority)).index(self)


class GpuType(StrEnum):
    A100_40GB = "a100-40gb"
    A100_80GB = "a100-80gb"
    H100 = "h100"
    H200 = "h200"
    CPU = "cpu"


class Precision(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class PipelineSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"


class Sharding(StrEnum):
    """FSDP sharding strategy (ZeRO stage in brackets)."""

    NONE = "none"  # replicate everything: DDP (ZeRO-0)
    SHARD_GRAD_OP = "shard-grad-op"  # shard gradients + optimizer states (ZeRO-2)
    FULL_SHARD = "full-shard"  # shard parameters too (ZeRO-3)
    HYBRID_SHARD = "hybrid-shard"  # full shard within a group, replicate across groups (HSDP)


class ActivationCheckpointing(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


# --------------------------------------------------------------------------------------------- code


class CodeSpec(_Model):
    entrypoint: str
    """Managed mode: `package.module:function` returning the model (`torch.nn.Module`) from its config.
    Script mode: the script path inside the repository (e.g. `train.py`), run under the platform's launcher."""
    repo: str = "."
    """Git repository URL (https://, ssh://, git@) or a local path; `.` is the directory of the spec file."""
    commit: str | None = None
    """Git commit to run. Omitted: pinned to the repository's HEAD at submit time, and recorded."""
    mode: Literal["managed", "script"] = "managed"
    """`managed`: the platform runs the training loop on your model. `script`: your own training script runs
    with the distributed environment injected (RANK/WORLD_SIZE/MASTER_ADDR, JAX_* or TF_CONFIG)."""
    framework: Literal["pytorch", "jax", "tensorflow"] = "pytorch"
    """Framework of the user code; selects which distributed environment is injected in script mode."""
    args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed to a script-mode entrypoint."""

    @field_validator("commit")
    @classmethod
    def _commit_is_hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{7,40}", v):
            raise ValueError(f"commit {v!r} is not a git commit id; give 7-40 lowercase hex digits or omit it")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("entrypoint is empty; give `package.module:function` (managed) or a script path")
        return v


# ------------------------------------------------------------------------------------------ dataset

DATASET_SCHEMES = ("lakefs", "s3", "gs", "catalog", "file")


class DatasetSpec(_Model):
    ref: str
    """Where the data is: `catalog://name[@version]`, `lakefs://repo/ref/path`, `s3://bucket/prefix`,
    `gs://bucket/prefix` or `file:///abs/path` (relative `file://` paths are relative to the spec file)."""
    format: Literal["arrow", "parquet", "jsonl", "text"] = "arrow"
    """Storage format of the shards. Training reads tokenized Arrow/Parquet shards."""
    license: str | None = None
    """SPDX identifier of the data's license (e.g. `CC-BY-4.0`). Omitted: taken from the dataset's manifest."""
    eval_fraction: float = Field(default=0.01, ge=0.0, lt=0.5)
    """Fraction of samples held out for evaluation (a deterministic split by sample index)."""

    @field_validator("ref")
    @classmethod
    def _scheme(cls, v: str) -> str:
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in DATASET_SCHEMES or not rest:
            raise ValueError(
                f"dataset reference {v!r} has no known scheme; use one of "
                + ", ".join(f"{s}://" for s in DATASET_SCHEMES)
            )
        return v


# ---------------------------------------------------------------------------------------- resources


class ResourcesSpec(_Model):
    gpu_type: GpuType
    """Accelerator type; one type per job (`cpu` runs workers as CPU processes with gloo)."""
    min_gpus: int = Field(ge=1)
    """Smallest number of GPUs the job can run on (its gang size when not elastic)."""
    max_gpus: int | None = Field(default=None, ge=1)
    """Largest number of GPUs for an elastic job; omitted = min_gpus (not elastic)."""
    gpus_per_node: int = Field(default=8, ge=1, le=16)
    """GPUs used on each node (the tensor-parallel domain)."""
    memory_per_node_gb: float | None = Field(default=None, gt=0)
    """Host memory each node must have, in GiB; omitted = any."""

    @model_validator(mode="after")
    def _min_le_max(self) -> ResourcesSpec:
        if self.max_gpus is not None and self.max_gpus < self.min_gpus:
            raise ValueError(
                f"max_gpus ({self.max_gpus}) is below min_gpus ({self.min_gpus}); raise max_gpus or omit it"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.max_gpus is not None and self.max_gpus > self.min_gpus

    @property
    def world_size(self) -> int:
        """Workers at launch: the gang size."""
        return self.min_gpus


# -------------------------------------------------------------------------------------------- model


class ModelSpec(_Model):
    """Architecture numbers of the model (managed mode), or a preset. Used by the planner and passed to the
    entrypoint as its config."""

    preset: str | None = None
    """A planner preset such as `llama-7b`, `llama-70b`; explicit fields below override it."""
    layers: int | None = Field(default=None, ge=1)
    """Number of transformer blocks."""
    hidden: int | None = Field(default=None, ge=8)
    """Model width (d_model)."""
    heads: int | None = Field(default=None, ge=1)
    """Attention heads."""
    kv_heads: int | None = Field(default=None, ge=1)
    """Key/value heads (grouped-query attention); omitted = heads."""
    ffn_hidden: int | None = Field(default=None, ge=1)
    """Width of the feed-forward layer; omitted = the SwiGLU default (8/3 * hidden, rounded to 256)."""
    vocab: int | None = Field(default=None, ge=2)
    """Vocabulary size."""
    experts: int = Field(default=0, ge=0)
    """Mixture-of-experts: experts per MoE layer (0 = dense)."""
    top_k: int = Field(default=0, ge=0)
    """Mixture-of-experts: experts each token is routed to."""

    @model_validator(mode="after")
    def _moe_consistent(self) -> ModelSpec:
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and experts ({self.experts}) for an MoE model")
        if self.top_k and not self.experts:
            raise ValueError(f"top_k ({self.top_k}) is set but experts is 0; set experts or remove top_k")
        if self.heads and self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads})")
        if self.hidden and self.heads and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) is not divisible by heads ({self.heads})")
        return self


# ----------------------------------------------------------------------------------------- training


class OptimizerSpec(_Model):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: float = Field(default=3e-4, gt=0, le=10)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""


class LRScheduleSpec(_Model):
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps from 0 to the peak LR."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warm-up."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final LR as a fraction of the peak."""


class TrainingSpec(_Model):
    global_batch_size: int = Field(ge=1)
    """Sequences per optimizer step across all workers."""
    seq_len: int = Field(ge=8)
    """Tokens per sequence."""
    max_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps to train. Give this or max_tokens."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens to train on; converted to steps as ceil(max_tokens / (global_batch_size * seq_len))."""
    gradient_accumulation_steps: int | None = Field(default=None, ge=1)
    """Micro-steps per optimizer step per data-parallel worker; None = derived from the batch and micro-batch."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer settings."""
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    """Learning-rate schedule."""
    precision: Precision = Precision.BF16
    """Compute precision: bf16 autocast where the device supports it (else fp32 with a warning)."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; None = no clipping."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seed for weights, sample order and dropout: same seed + same dataset version = same run."""

    @model_validator(mode="after")
    def _length(self) -> TrainingSpec:
        if (self.max_steps is None) == (self.max_tokens is None):
            raise ValueError("give exactly one of max_steps or max_tokens")
        return self

    @property
    def total_steps(self) -> int:
        if self.max_steps is not None:
            return self.max_steps
        assert self.max_tokens is not None
        return math.ceil(self.max_tokens / (self.global_batch_size * self.seq_len))


# -------------------------------------------------------------------------------------- parallelism


class ParallelismSpec(_Model):
    """Parallelism hints. `strategy: auto` lets the planner choose every degree left unset; any degree given
    is respected (expert override)."""

    strategy: Literal["auto", "explicit"] = "auto"
    """`auto`: the planner fills unset degrees. `explicit`: unset degrees are 1 and dp takes the rest."""
    dp: int | None = Field(default=None, ge=1)
    """Data-parallel degree (replicas, or FSDP shards)."""
    tp: int | None = Field(default=None, ge=1)
    """Tensor-parallel degree; must divide attention heads and fit within a node."""
    pp: int | None = Field(default=None, ge=1)
    """Pipeline stages; must divide the number of layers (times virtual_stages)."""
    ep: int | None = Field(default=None, ge=1)
    """Expert-parallel degree (MoE models); must divide the number of experts."""
    virtual_stages: int = Field(default=1, ge=1)
    """Model chunks per pipeline rank for interleaved 1F1B."""
    micro_batch_size: int | None = Field(default=None, ge=1)
    """Sequences per micro-batch per worker."""
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule (only used when pp > 1)."""
    sharding: Sharding | None = None
    """FSDP sharding strategy; None = chosen by the planner (auto) or `none` (explicit)."""
    activation_checkpointing: ActivationCheckpointing | None = None
    """Recompute activations in backward to save memory; None = chosen by the planner (auto) or `none`."""
    engine: Literal["native", "deepspeed"] = "native"
    """`native`: PyTorch DDP/FSDP2/TP/PP. `deepspeed`: DeepSpeed ZeRO for data parallelism."""

    @model_validator(mode="after")
    def _virtual(self) -> ParallelismSpec:
        if self.virtual_stages > 1 and self.pipeline_schedule != PipelineSchedule.INTERLEAVED_1F1B:
            raise ValueError(
                f"virtual_stages ({self.virtual_stages}) needs pipeline_schedule 'interleaved-1f1b' "
                f"(got {self.pipeline_schedule.value!r})"
            )
        return self


# --------------------------------------------------------------------------------------- checkpoint


class KeepBestSpec(_Model):
    metric: str = "eval_loss"
    """Metric that ranks checkpoints."""
    mode: Literal["min", "max"] = "min"
    """Whether lower (min) or higher (max) is better."""
    count: int = Field(default=1, ge=1)
    """How many of the best checkpoints to keep."""


class CheckpointSpec(_Model):
    interval_steps: int | Literal["auto"] = "auto"
    """Steps between checkpoints, or `auto` for the Young/Daly optimum from write cost and cluster MTBF."""
    keep_last: int = Field(default=3, ge=1)
    """Keep the newest N committed checkpoints."""
    keep_best: KeepBestSpec | None = None
    """Also keep the best checkpoints by a metric."""
    keep_every: int | None = Field(default=None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this."""
    async_save: bool = True
    """Write checkpoints in the background (the loop blocks only while staging to host memory)."""

    @field_validator("interval_steps")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"interval_steps must be >= 1 or 'auto' (got {v})")
        return v


class EvaluationSpec(_Model):
    enabled: bool = True
    """Evaluate each committed checkpoint on the held-out split."""
    batches: int = Field(default=4, ge=1)
    """Held-out batches per evaluation."""


class FaultToleranceSpec(_Model):
    max_segment_retries: int = Field(default=3, ge=0, le=100)
    """How many times a failed training segment is retried from the last committed checkpoint."""
    max_restarts: int = Field(default=0, ge=0, le=100)
    """In-segment restarts of crashed workers by the elastic agent before the segment fails."""
    segment_max_steps: int | None = Field(default=None, ge=1)
    """End a segment after this many steps (the next segment resumes from the committed checkpoint)."""


# ------------------------------------------------------------------------------------------ secrets

SECRET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$"
ENV_NAME = r"^[A-Z_][A-Z0-9_]*$"


class SecretRef(_Model):
    name: str = Field(pattern=SECRET_NAME)
    """Name of the secret in the platform's secret store (never its value)."""
    env: str = Field(pattern=ENV_NAME)
    """Environment variable the secret is injected as in the workers."""


# Patterns of credentials that must never appear literally in a spec.
_SECRET_VALUE_PATTERNS = (
    re.compile(r"\bAKIA[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"),  # Hugging Face token
    re.compile(r"\bsk-[A-Za-z0-9_\-]{20,}\b"),  # OpenAI-style key
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}\b"),  # GitHub token
    re.compile(r"\bxox[abpr]-[A-Za-z0-9\-]{10,}\b"),  # Slack token
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"://[^/\s:@]+:[^/\s@]+@"),  # credentials in a URL
)
_SECRETISH_KEY = re.compile(r"(secret|password|passwd|token|api[_-]?key|access[_-]?key|credential)", re.I)


def looks_like_secret(value: str) -> bool:
    return any(p.search(value) for p in _SECRET_VALUE_PATTERNS)


# ---------------------------------------------------------------------------------------------- job


class JobSpec(_Model):
    """One training job: code + dataset + hardware + training config."""

    name: str = Field(pattern=NAME_PATTERN)
    """Job name: lowercase letters, digits and '-', at most 63 characters (a DNS label)."""
    team: str = Field(pattern=NAME_PATTERN)
    """Owning team: quotas, fair share, storage prefix and cost are per team."""
    code: CodeSpec
    """The model code."""
    dataset: DatasetSpec
    """The dataset reference."""
    resources: ResourcesSpec
    """Hardware needs."""
    training: TrainingSpec
    """Training configuration."""
    priority: Priority = Priority.NORMAL
    """Scheduling priority class."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """Architecture numbers (managed mode); used for planning and passed to the entrypoint."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Parallelism hints (`auto` by default)."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpoint interval and retention."""
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    """Held-out evaluation of committed checkpoints."""
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    """Retry budget and segment length."""
    max_runtime: Annotated[str, Field(pattern=r"^\d+(\.\d+)?(s|m|h|d)$")] = "24h"
    """Wall-clock limit of the whole job, e.g. `90m`, `36h`, `7d`."""
    secrets: list[SecretRef] = Field(default_factory=list)
    """Secrets injected into the workers, by name only. A literal secret value anywhere is an error."""
    env: dict[str, str] = Field(default_factory=dict)
    """Plain (non-secret) environment variables for the workers."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Free-form labels recorded with the run (project, experiment, ...)."""

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(ENV_NAME, key):
                raise ValueError(f"environment variable name {key!r} must match {ENV_NAME}")
        return v

    @property
    def max_runtime_s(self) -> float:
        value, unit = float(self.max_runtime[:-1]), self.max_runtime[-1]
        return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the spec: the identity of this configuration."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


# --------------------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a spec: where, what value, why, and how to fix it."""

    path: str
    message: str
    value: Any = None
    fix: str = ""
    severity: Literal["error", "not-checked", "warning"] = "error"

    def render(self) -> str:
        shown = "" if self.value is None else f" (got {_short(self.value)})"
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.path}: {self.message}{shown}.{fix}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "message": self.message,
            "value": _jsonable(self.value),
            "fix": self.fix,
            "severity": self.severity,
        }


class SpecError(ValueError):
    """A spec that cannot be used. `problems` lists every problem found, `source` names the file."""

    def __init__(self, problems: Iterable[Problem], source: str = "<spec>", unreadable: bool = False):
        self.problems = list(problems)
        self.source = source
        self.unreadable = unreadable
        lines = "\n".join(f"  - {p.render()}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


_FIXES = {
    "missing": "add this field",
    "extra_forbidden": "remove it or check its spelling against `trainforge schema`",
    "enum": "use one of the listed values",
    "literal_error": "use one of the listed values",
}


def _problems_from_validation(exc: ValidationError) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        # Drop pydantic's internal location parts (union branches, validator names) from the path.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        value = err.get("input") if err["type"] != "missing" else None
        if isinstance(value, Mapping | list) and err["type"] not in ("extra_forbidden",):
            value = None  # a whole sub-document is noise; the path says where
        problems.append(Problem(_loc_to_path(loc), msg, value, _FIXES.get(err["type"], "")))
    return problems


def _scan_for_literal_secrets(doc: Any, path: str = "") -> list[Problem]:
    """Refuse credentials written into the spec: secrets are referenced by name, never inlined."""
    problems: list[Problem] = []
    if isinstance(doc, Mapping):
        for key, value in doc.items():
            sub = f"{path}.{key}" if path else str(key)
            if path == "secrets" or path.startswith("secrets["):
                continue
            if isinstance(value, str) and value and _SECRETISH_KEY.search(str(key)) and not path.startswith("labels"):
                problems.append(
                    Problem(sub, "looks like a literal secret value", "<redacted>",
                            "reference it by name under `secrets: [{name: ..., env: ...}]` instead")
                )
            else:
                problems.extend(_scan_for_literal_secrets(value, sub))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            problems.extend(_scan_for_literal_secrets(value, f"{path}[{i}]"))
    elif isinstance(doc, str) and looks_like_secret(doc):
        problems.append(
            Problem(path or "<root>", "contains what looks like a credential", "<redacted>",
                    "store it in the secret store and reference it under `secrets:` by name")
        )
    return problems


def _secret_list_problems(doc: Any) -> list[Problem]:
    """`secrets` entries carry names only; a `value` key or a credential as a name is refused."""
    problems: list[Problem] = []
    secrets = doc.get("secrets") if isinstance(doc, Mapping) else None
    if isinstance(secrets, Mapping):
        problems.append(
            Problem("secrets", "must be a list of {name, env} references, not a mapping of values", "<redacted>",
                    "write `secrets: [{name: my-secret, env: MY_VAR}]`")
        )
    elif isinstance(secrets, list):
        for i, item in enumerate(secrets):
            if isinstance(item, Mapping):
                for key in item:
                    if key not in ("name", "env"):
                        problems.append(
                            Problem(f"secrets[{i}].{key}", "a secret reference holds only `name` and `env`; "
                                    "literal secret values are never accepted in a spec", "<redacted>",
                                    "remove the value and store it in the secret store under the secret's name")
                        )
                if isinstance(item.get("name"), str) and looks_like_secret(item["name"]):
                    problems.append(Problem(f"secrets[{i}].name", "looks like a credential, not a name",
                                            "<redacted>", "give the secret's name in the store"))
    return problems


def parse_spec(doc: Any, source: str = "<spec>") -> JobSpec:
    """Validate an already-parsed document. Raises SpecError with every problem found."""
    if not isinstance(doc, Mapping):
        raise SpecError(
            [Problem("<root>", f"a job spec must be a mapping of fields, not {type(doc).__name__}", None,
                     "start from examples/tiny-cpu.yaml")],
            source,
        )
    secret_problems = _secret_list_problems(doc) + _scan_for_literal_secrets(
        {k: v for k, v in doc.items() if k != "secrets"}
    )
    redacted = {k: v for k, v in doc.items() if k != "secrets"} if secret_problems else doc
    try:
        spec = JobSpec.model_validate(dict(redacted))
    except ValidationError as exc:
        raise SpecError(secret_problems + _problems_from_validation(exc), source) from None
    if secret_problems:
        raise SpecError(secret_problems, source)
    return spec


def read_document(path: str | Path) -> Any:
    """Read YAML or JSON from a file; raises SpecError(unreadable=True) if it cannot be read or parsed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([Problem("<file>", "file not found", str(p), "check the path")], str(p), True) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([Problem("<file>", f"cannot read the file: {exc}", str(p), "")], str(p), True) from None
    return parse_text(text, str(p))


def parse_text(text: str, source: str = "<spec>") -> Any:
    try:
        # JSON is a subset of YAML 1.2; safe_load never constructs Python objects.
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(
            [Problem("<file>", f"not valid YAML/JSON at {where}: {problem}", None,
                     "fix the syntax (indentation, quotes, colons)")],
            source,
            True,
        ) from None
    except Exception as exc:  # yaml can raise RecursionError etc. on adversarial input
        raise SpecError([Problem("<file>", f"cannot parse the document: {type(exc).__name__}", None, "")],
                        source, True) from None


def load_spec(path: str | Path) -> JobSpec:
    """Load and schema-validate a spec file (YAML or JSON)."""
    return parse_spec(read_document(path), str(path))


def json_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()
