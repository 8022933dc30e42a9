"""The JobSpec: the one declarative contract between an ML team and the platform.

A spec is loaded from YAML or JSON with :func:`load_spec` (or :func:`parse_spec` for an in-memory document).
Every user mistake becomes a :class:`SpecError` listing each problem with its field path, the bad value, why it
is wrong and how to fix it; nothing else escapes the loader. Model code never sees this object's topology: the
platform turns it into a resolved job config for the workers.

This module imports nothing else from trainforge (the layering test checks it).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


class FieldProblem(ValueError):
    """Raised by validators: names the field (below the validated model) and how to fix it, so the user sees
    `training.max_steps: ...` rather than `training: ...`."""

    def __init__(self, message: str, field: str | None = None, fix: str = "", value: Any = None):
        super().__init__(message)
        self.field = field
        self.fix = fix
        self.value = value


def _no_bool(value: Any) -> Any:
    # pydantic's lax mode reads `true` as 1; in a spec that is always a slip (`min_gpus: yes`).
    if isinstance(value, bool):
        raise FieldProblem("must be a number, not a boolean", fix="write a number (YAML reads yes/no/on/off "
                           "as booleans)")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]


class _Model(BaseModel):
    """Strict base: unknown keys are errors, so a typo never silently does nothing; NaN and infinity are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


class Priority(StrEnum):
    """Scheduling priority class. It orders a team's own work (and which of its jobs yield to its others);
    between teams fair share decides. `critical`, within the team's critical quota, is the one class that goes
    ahead of other teams' work; `preemptible` work is anyone's to take (docs/scheduler.md)."""

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
    """Accelerator type from the hardware catalog; `cpu` runs workers as CPU processes (gloo)."""

    A100_40GB = "a100-40gb"
    A100_80GB = "a100-80gb"
    H100 = "h100"
    H200 = "h200"
    CPU = "cpu"


class Precision(StrEnum):
    """Compute precision of the training step."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class PipelineSchedule(StrEnum):
    """Pipeline-parallel schedule."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"


class Sharding(StrEnum):
    """FSDP sharding strategy (ZeRO stage in brackets)."""

    NONE = "none"  # replicate everything: DDP (ZeRO-0)
    SHARD_OPTIMIZER = "shard-optimizer"  # shard optimizer states only (ZeRO-1, Megatron's distributed optimizer)
    SHARD_GRAD_OP = "shard-grad-op"  # shard gradients + optimizer states (ZeRO-2)
    FULL_SHARD = "full-shard"  # shard parameters too (ZeRO-3)
    HYBRID_SHARD = "hybrid-shard"  # full shard within a group, replicate across groups (HSDP)


class Engine(StrEnum):
    """The parallelism engine (`parallelism.engine`; plan/support.py says what each runs)."""

    NATIVE = "native"  # PyTorch DDP / FSDP2 / TP / PP / EP
    DEEPSPEED = "deepspeed"  # DeepSpeed ZeRO 0-3, data parallel only


class ActivationCheckpointing(StrEnum):
    """Activation recomputation in backward: none, selective (attention) or full (whole layers)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


# --------------------------------------------------------------------------------------------- code


REMOTE_REPO = re.compile(r"^(https?://|ssh://|git://|file://|[\w.-]+@[\w.-]+:)")


def is_remote_repo(repo: str) -> bool:
    """A repository fetched at submit (a URL, or scp-like `git@host:path`), as opposed to a local path."""
    return bool(REMOTE_REPO.match(repo))


WEIGHTS_FOLDER_PREFIXES = ("s3://", "file://", "/", "./", "../", "~")


def is_weights_folder(init_from: str) -> bool:
    """`init_from` names a Hugging Face folder (a path or an `s3://` prefix), not a checkpoint (`JOB@STEP`) or a
    registered model version (`models:/team.name/3`)."""
    return init_from.startswith(WEIGHTS_FOLDER_PREFIXES) or init_from.endswith("/")


def weights_folder_location(init_from: str, base_dir: Path) -> str:
    """Where a weights folder is: an `s3://` prefix (ending in `/`), or an absolute path with a relative one taken
    against the spec's folder. The one reading of `init_from` for validation and for the fetch at submit."""
    if init_from.startswith("s3://"):
        return init_from.rstrip("/") + "/"
    path = Path(os.path.expanduser(init_from.removeprefix("file://")))
    return str((path if path.is_absolute() else base_dir / path).resolve())


class CodeSpec(_Model):
    """The user's code: where it lives, which commit, how it is run."""

    entrypoint: str
    """Managed mode: `package.module:function` returning the model (`torch.nn.Module`) from its config.
    Script mode: the script path inside the repository (e.g. `train.py`), run under the platform's launcher."""
    repo: str = "."
    """Git repository URL (https://, ssh://, git@) or a local path; `.` is the directory of the spec file."""
    commit: str | None = None
    """Git commit to run. Omitted: pinned to the repository's HEAD at submit time, and recorded."""
    auth: str | None = None
    """Name of the secret for a private repository: a token for https (`token` or `user:token`), a private key for
    ssh. Its value is handed to git only, never logged or recorded."""
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
            raise FieldProblem(f"commit {_short(v)} is not a git commit id",
                               fix="give 7-40 lowercase hex digits (`git rev-parse HEAD`), or omit it to pin HEAD "
                               "at submit time")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, v: str) -> str:
        if not v.strip():
            raise FieldProblem("entrypoint is empty",
                               fix="give `package.module:function` (managed mode) or a script path (script mode)")
        return v


# ------------------------------------------------------------------------------------------ dataset

DATASET_SCHEMES = ("lakefs", "s3", "gs", "catalog", "file")


class DatasetSpec(_Model):
    """The training data: a reference resolved to an immutable version at submit time."""

    ref: str
    """Where the data is: `catalog://name[@version]`, `lakefs://repo/ref/path`, `s3://bucket/prefix`,
    `gs://bucket/prefix` or `file:///abs/path` (relative `file://` paths are relative to the spec file)."""
    format: Literal["arrow", "parquet", "jsonl", "text"] = "arrow"
    """Storage format. Catalog, file and lakeFS versions hold tokenized Arrow shards. An `s3://` prefix is read in
    place, so its format says how: `jsonl` (one JSON object per line, the text in `text_field`), `text` (each
    non-blank line a document) or `parquet` (the text in column `text_field`)."""
    text_field: str = "text"
    """The JSON field (jsonl) or column (parquet) that holds a document's text, for an `s3://` prefix."""
    chunk_mb: Float = Field(default=4.0, gt=0.0, le=1024.0)
    """An `s3://` prefix's objects are read in chunks of about this many MiB (the unit of sampling; each chunk is
    fetched with ranged GETs and tokenized on its own). Part of the pinned version."""
    license: str | None = None
    """SPDX identifier of the data's license (e.g. `CC-BY-4.0`). Omitted: taken from the dataset's manifest.
    Required for an `s3://` prefix, which has no manifest to take it from."""
    expectations: str | None = None
    """The team's own great-expectations suite (a JSON file, relative to the spec's folder): it runs with the
    built-in expectations before anything is allocated, on each record of an `s3://` prefix's sample (its own
    fields, plus `_chars` and `_object`) or each sample of a catalog version (`num_tokens`, `max_token`, ...); a
    failed expectation refuses the version."""
    eval_fraction: Float = Field(default=0.01, ge=0.0, lt=0.5)
    """Fraction of samples held out for evaluation (a deterministic split by sample index)."""
    transforms: tuple[str, ...] = ()
    """Online preprocessing: per-sample transforms, each `"module:function"` called as `fn(sample, index)` on the
    token array of one sample and returning a fixed-length array; applied in order, in DataLoader worker
    processes when `num_workers` > 0. They must be deterministic in (sample, index) so a resumed run sees the
    same data."""
    num_workers: Int = Field(default=0, ge=0, le=32)
    """DataLoader worker processes per rank that read and preprocess each step's batch ahead of the training
    step (pipelined; at most 2 batches per worker wait in memory). 0 = read in the training process."""
    tokenizer: str | None = None
    """The tokenizer the data must have been tokenized with: `byte-level`, or the path (relative to the spec's
    folder) of a Hugging Face `tokenizer.json` or of a model folder holding one. Checked against the dataset
    version's tokenizer by content before anything is allocated (`validate` for the versions it resolves: catalog,
    file, and lakeFS when configured; submit for every version). Omitted: whatever the version used, except that a Hugging Face `init_from` folder shipping a
    `tokenizer.json` must match it (a model reading ids of another vocabulary learns nothing it was taught)."""

    @model_serializer(mode="wrap")
    def _omit_default_pipeline(self, handler: Any) -> Any:
        # absent == default: specs written before online preprocessing (or the tokenizer check) keep their
        # config_hash
        d = handler(self)
        if isinstance(d, dict):
            if not d.get("transforms"):
                d.pop("transforms", None)
            if not d.get("num_workers"):
                d.pop("num_workers", None)
            if d.get("tokenizer") is None:
                d.pop("tokenizer", None)
            if d.get("expectations") is None:
                d.pop("expectations", None)
            if d.get("text_field") == "text":
                d.pop("text_field", None)
            if d.get("chunk_mb") == 4.0:
                d.pop("chunk_mb", None)
        return d

    @model_validator(mode="after")
    def _in_place_needs(self) -> DatasetSpec:
        if not self.ref.startswith("s3://"):
            return self
        if self.format == "arrow":
            raise FieldProblem("an s3:// prefix is read in place, so its format must say how to read the objects",
                               "format", "set dataset.format to jsonl, text or parquet", self.format)
        if not self.license:
            raise FieldProblem("an s3:// prefix has no manifest to take the data's license from", "license",
                               "set dataset.license to the data's SPDX identifier (e.g. CC-BY-4.0); lineage "
                               "records it with every job trained on the prefix")
        if not self.text_field.strip():
            raise FieldProblem("is empty", "text_field", "name the JSON field or Parquet column that holds the text")
        bucket, _, path = self.ref.removeprefix("s3://").partition("/")
        first = next((p for p in path.split("/") if p), "")
        if not first or set(first) & set("*?["):
            raise FieldProblem(f"s3://{bucket} names a whole bucket: a job's identity is granted read access to one "
                               "prefix, never a bucket", "ref", f"move the data under a prefix (s3://{bucket}/"
                               "corpus/...) and name it", self.ref)
        return self

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_name(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise FieldProblem("is empty", fix="write byte-level, or the path of a tokenizer.json")
        if v is not None and "\0" in v:
            raise FieldProblem("holds a NUL byte", fix="write the path of a tokenizer.json, or byte-level")
        if v is not None and "://" in v and not v.startswith("file://"):
            raise FieldProblem(f"tokenizer {_short(v)} is not a local file",
                               fix="name a tokenizer.json on disk (relative to the spec file), or byte-level")
        return v

    @field_validator("transforms")
    @classmethod
    def _transform_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            module, _, func = name.partition(":")
            if not module or not func:
                raise FieldProblem(f"transform {_short(name)} is not 'module:function'",
                                   fix="name an importable function, e.g. mypkg.prep:augment")
        return v

    @field_validator("ref")
    @classmethod
    def _scheme(cls, v: str) -> str:
        scheme, sep, rest = v.partition("://")
        if not sep or scheme not in DATASET_SCHEMES or not rest.strip("/"):
            what = "has no known scheme" if not sep or scheme not in DATASET_SCHEMES else "names no dataset"
            raise FieldProblem(
                f"dataset reference {_short(v)} {what}",
                fix="use one of " + ", ".join(f"{s}://" for s in DATASET_SCHEMES)
                + " followed by the dataset, e.g. catalog://demo-text@main",
            )
        return v


# ---------------------------------------------------------------------------------------- resources


class ResourcesSpec(_Model):
    """Hardware the job needs: one GPU type, a GPU count (elastic between min and max) and the node shape."""

    gpu_type: GpuType
    """Accelerator type; one type per job (`cpu` runs workers as CPU processes with gloo)."""
    min_gpus: Int = Field(ge=1)
    """Smallest number of GPUs the job can run on (its gang size when not elastic)."""
    max_gpus: Int | None = Field(default=None, ge=1)
    """Largest number of GPUs for an elastic job; omitted = min_gpus (not elastic)."""
    gpus_per_node: Int = Field(default=8, ge=1, le=16)
    """GPUs used on each node (the tensor-parallel domain)."""
    memory_per_node_gb: Float | None = Field(default=None, gt=0)
    """Host memory each node must have, in GiB; omitted = any."""

    @model_validator(mode="after")
    def _min_le_max(self) -> ResourcesSpec:
        if self.max_gpus is not None and self.max_gpus < self.min_gpus:
            raise FieldProblem(f"max_gpus ({self.max_gpus}) is below min_gpus ({self.min_gpus})", "max_gpus",
                               "raise max_gpus to at least min_gpus, or omit it for a fixed-size job", self.max_gpus)
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
    layers: Int | None = Field(default=None, ge=1)
    """Number of transformer blocks."""
    hidden: Int | None = Field(default=None, ge=8)
    """Model width (d_model)."""
    heads: Int | None = Field(default=None, ge=1)
    """Attention heads."""
    kv_heads: Int | None = Field(default=None, ge=1)
    """Key/value heads (grouped-query attention); omitted = heads."""
    ffn_hidden: Int | None = Field(default=None, ge=1)
    """Width of the feed-forward layer; omitted = the SwiGLU default (8/3 * hidden, rounded to 256)."""
    vocab: Int | None = Field(default=None, ge=2)
    """Vocabulary size."""
    experts: Int = Field(default=0, ge=0)
    """Mixture-of-experts: experts per MoE layer (0 = dense)."""
    top_k: Int = Field(default=0, ge=0)
    """Mixture-of-experts: experts each token is routed to."""

    @model_validator(mode="after")
    def _moe_consistent(self) -> ModelSpec:
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise FieldProblem(f"top_k ({self.top_k}) must be between 1 and experts ({self.experts}) for an MoE "
                               "model", "top_k", f"set top_k to a value in 1..{self.experts} (2 is common)", self.top_k)
        if self.top_k and not self.experts:
            raise FieldProblem(f"top_k ({self.top_k}) is set but experts is 0", "top_k",
                               "set model.experts for a mixture-of-experts model, or remove top_k", self.top_k)
        if self.heads and self.kv_heads and self.heads % self.kv_heads:
            raise FieldProblem(f"heads ({self.heads}) is not a multiple of kv_heads ({self.kv_heads})", "kv_heads",
                               "use a kv_heads that divides heads", self.kv_heads)
        if self.hidden and self.heads and self.hidden % self.heads:
            raise FieldProblem(f"hidden ({self.hidden}) is not divisible by heads ({self.heads})", "heads",
                               "use a head count that divides hidden", self.heads)
        return self


# ----------------------------------------------------------------------------------------- training


class OptimizerSpec(_Model):
    """Optimizer and its hyper-parameters."""

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: Float = Field(default=3e-4, gt=0, le=10)
    """Peak learning rate."""
    weight_decay: Float = Field(default=0.1, ge=0)
    """Decoupled weight decay."""
    betas: tuple[Float, Float] = (0.9, 0.95)
    """Adam betas."""
    eps: Float = Field(default=1e-8, gt=0)
    """Adam epsilon."""

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise FieldProblem(f"betas {list(v)} must each be in [0, 1)", fix="the usual values are [0.9, 0.95]")
        return v


class LRScheduleSpec(_Model):
    """Learning-rate schedule: linear warm-up, then decay to min_lr_ratio * lr."""

    warmup_steps: Int = Field(default=0, ge=0)
    """Linear warm-up steps from 0 to the peak LR."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warm-up."""
    min_lr_ratio: Float = Field(default=0.1, ge=0, le=1)
    """Final LR as a fraction of the peak."""


class TrainingSpec(_Model):
    """Training length, batch, sequence length, optimizer, schedule, precision and seed."""

    global_batch_size: Int = Field(ge=1)
    """Sequences per optimizer step across all workers."""
    seq_len: Int = Field(ge=8)
    """Tokens per sequence."""
    max_steps: Int | None = Field(default=None, ge=1)
    """Optimizer steps to train. Give this or max_tokens."""
    max_tokens: Int | None = Field(default=None, ge=1)
    """Tokens to train on; converted to steps as ceil(max_tokens / (global_batch_size * seq_len))."""
    gradient_accumulation_steps: Int | None = Field(default=None, ge=1)
    """Micro-steps per optimizer step per data-parallel worker; None = derived from the batch and micro-batch."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer settings."""
    lr_schedule: LRScheduleSpec = Field(default_factory=LRScheduleSpec)
    """Learning-rate schedule."""
    precision: Precision = Precision.BF16
    """Compute precision: bf16 autocast where the device supports it (else fp32 with a warning)."""
    grad_clip: Float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; None = no clipping."""
    seed: Int = Field(default=0, ge=0, lt=2**63)
    """Seed for weights, sample order and dropout: same seed + same dataset version = same run."""
    gradient_reduction: Literal["fixed-order", "fast"] = "fixed-order"
    """How DDP sums the data-parallel gradients. `fixed-order`: every element in rank order, whatever DDP's bucket
    layout (an all-to-all and an all-gather, the bytes of a ring all-reduce), so a run resumed from a checkpoint is
    bitwise the uninterrupted run at its data-parallel degree, whatever it is. `fast`: torch's all-reduce, whose summation order
    follows the bucket layout DDP rebuilds after each (re)start's first step: with more than 2 replicas a resumed
    run drifts from the uninterrupted one by a few ulps. FSDP, DeepSpeed and script mode (the script's own DDP) keep their own reductions."""

    @model_validator(mode="after")
    def _length(self) -> TrainingSpec:
        if self.max_steps is None and self.max_tokens is None:
            raise FieldProblem("the training length is missing: give max_steps or max_tokens", "max_steps",
                               "add `max_steps: N` (optimizer steps) or `max_tokens: N` under training")
        if self.max_steps is not None and self.max_tokens is not None:
            raise FieldProblem(f"both max_steps ({self.max_steps}) and max_tokens ({self.max_tokens}) are given",
                               "max_tokens", "keep exactly one of max_steps or max_tokens", self.max_tokens)
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
    dp: Int | None = Field(default=None, ge=1)
    """Data-parallel degree (replicas, or FSDP shards)."""
    tp: Int | None = Field(default=None, ge=1)
    """Tensor-parallel degree; must divide attention heads and fit within a node."""
    pp: Int | None = Field(default=None, ge=1)
    """Pipeline stages; must divide the number of layers (times virtual_stages)."""
    ep: Int | None = Field(default=None, ge=1)
    """Expert-parallel degree (MoE models); must divide the number of experts."""
    virtual_stages: Int = Field(default=1, ge=1)
    """Model chunks per pipeline rank for interleaved 1F1B."""
    micro_batch_size: Int | None = Field(default=None, ge=1)
    """Sequences per micro-batch per worker."""
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    """Pipeline schedule (only used when pp > 1)."""
    sharding: Sharding | None = None
    """FSDP sharding strategy; None = chosen by the planner (auto) or `none` (explicit)."""
    activation_checkpointing: ActivationCheckpointing | None = None
    """Recompute activations in backward to save memory; None = chosen by the planner (auto) or `none`."""
    engine: Engine = Engine.NATIVE
    """`native`: PyTorch DDP/FSDP2/TP/PP. `deepspeed`: DeepSpeed ZeRO for data parallelism."""

    @model_validator(mode="after")
    def _virtual(self) -> ParallelismSpec:
        if self.virtual_stages > 1 and self.pipeline_schedule != PipelineSchedule.INTERLEAVED_1F1B:
            raise FieldProblem(
                f"virtual_stages ({self.virtual_stages}) needs pipeline_schedule 'interleaved-1f1b' "
                f"(the schedule is {self.pipeline_schedule.value!r})", "virtual_stages",
                "set pipeline_schedule: interleaved-1f1b, or remove virtual_stages", self.virtual_stages,
            )
        return self


# --------------------------------------------------------------------------------------- checkpoint


class KeepBestSpec(_Model):
    """Retention of the best checkpoints by an evaluation metric."""

    metric: str = "eval_loss"
    """Metric that ranks checkpoints."""
    mode: Literal["min", "max"] = "min"
    """Whether lower (min) or higher (max) is better."""
    count: Int = Field(default=1, ge=1)
    """How many of the best checkpoints to keep."""


class CheckpointSpec(_Model):
    """Checkpoint interval and retention policy."""

    interval_steps: Int | Literal["auto"] = "auto"
    """Steps between checkpoints, or `auto` for the Young/Daly optimum from write cost and cluster MTBF."""
    keep_last: Int = Field(default=3, ge=1)
    """Keep the newest N committed checkpoints."""
    keep_best: KeepBestSpec | None = None
    """Also keep the best checkpoints by a metric."""
    keep_every: Int | None = Field(default=None, ge=1)
    """Also keep every checkpoint whose step is a multiple of this."""
    async_save: bool = True
    """Write checkpoints in the background (the loop blocks only while staging to host memory)."""

    @field_validator("interval_steps")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise FieldProblem(f"interval_steps must be >= 1 or 'auto' (got {v})",
                               fix="give a positive number of steps, or `auto`")
        return v


class EvaluationSpec(_Model):
    """Held-out evaluation of each committed checkpoint."""

    enabled: bool = True
    """Evaluate each committed checkpoint on the held-out split."""
    batches: Int = Field(default=4, ge=1)
    """Held-out batches per evaluation."""


class FaultToleranceSpec(_Model):
    """Retry budget and segment length for failure recovery."""

    max_segment_retries: Int = Field(default=3, ge=0, le=100)
    """How many times a failed training segment is retried from the last committed checkpoint."""
    max_restarts: Int = Field(default=0, ge=0, le=100)
    """In-segment restarts of crashed workers by the elastic agent before the segment fails."""
    segment_max_steps: Int | None = Field(default=None, ge=1)
    """End a segment after this many steps (the next segment resumes from the committed checkpoint)."""
    recovery_wait_s: Int = Field(default=1800, ge=1, le=7 * 86400)
    """How long a recovery may wait in the queue for a gang of healthy hosts (that all reach each other) once a
    fault took some away; past it the job fails, naming the fault and what it waited for."""


# ------------------------------------------------------------------------------------------ secrets

# Variables the platform injects into every worker (torchrun, JAX, TF); a spec may not override them.
RESERVED_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                          "MASTER_PORT", "TF_CONFIG"})
RESERVED_ENV_PREFIXES = ("TORCHELASTIC_", "JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

SECRET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,127}$"
ENV_NAME = r"^[A-Z_][A-Z0-9_]*$"


class SecretRef(_Model):
    """A secret referenced by name and injected as an environment variable; never its value."""

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
# Words of a key name that mean "this value is a credential". Matched on whole words of the key (split on `_`,
# `-`, `.` and camelCase) so that HF_TOKEN and apiKey are caught but TOKENIZERS_PARALLELISM and max_tokens are not.
_SECRET_WORDS = frozenset({"secret", "password", "passwd", "pwd", "passphrase", "token", "credential",
                           "credentials", "apikey", "accesskey", "secretkey", "privatekey"})
_SECRET_WORD_PAIRS = frozenset({("api", "key"), ("access", "key"), ("secret", "key"), ("private", "key"),
                                ("auth", "key")})


def secretish_key(key: object) -> bool:
    """Whether a key name says its value is a credential (`HF_TOKEN`, `db_password`, `apiKey`)."""
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower())
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_WORD_PAIRS for pair in zip(words, words[1:], strict=False))


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
    init_from: str | None = Field(default=None, max_length=512)
    """Fine-tune from this model version (`models:/team.name/3`), committed checkpoint (`JOB@STEP`) or Hugging Face
    Llama folder (a path such as `./models/base/`, relative to the spec, or an `s3://bucket/prefix/`; its
    config.json must match the model section). Recorded in lineage as fine-tuned-from (a quarantined parent is
    refused); the workers load the weights before step 0."""

    @field_validator("init_from")
    @classmethod
    def _init_from_scheme(cls, v: str | None) -> str | None:
        if v and "://" in v and not v.startswith(("s3://", "file://")):  # gs://, hf://, https://: not read
            scheme = v.split("://", 1)[0]
            shown = scheme if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,15}", scheme) else _short(scheme)
            raise FieldProblem(f"{shown}:// folders are not read", None,
                               "copy the folder to an s3:// prefix or a local path, or name a committed "
                               "checkpoint (JOB@STEP) or model version (models:/team.name/3)", v)
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not re.fullmatch(ENV_NAME, key):
                raise FieldProblem(f"environment variable name {_short(key)} is not valid", None,
                                   "use upper-case letters, digits and '_', not starting with a digit (e.g. MY_FLAG)",
                                   key)
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise FieldProblem(f"environment variable {key} is set by the platform", key,
                                   "remove it: the platform injects the distributed environment itself")
        return v

    @field_validator("max_runtime")
    @classmethod
    def _runtime_positive(cls, v: str) -> str:
        if float(v[:-1]) <= 0:
            raise FieldProblem(f"max_runtime {v!r} is zero", fix="give a positive duration such as `90m` or `36h`")
        return v

    @model_validator(mode="after")
    def _secret_envs(self) -> JobSpec:
        seen: dict[str, int] = {}
        for i, ref in enumerate(self.secrets):
            if ref.env in seen:
                raise FieldProblem(f"secrets[{seen[ref.env]}] and secrets[{i}] both set {ref.env}",
                                   f"secrets[{i}].env", "give each secret its own environment variable", ref.env)
            if ref.env in self.env:
                raise FieldProblem(f"{ref.env} is both a secret and a plain env variable", f"secrets[{i}].env",
                                   f"remove {ref.env} from `env`", ref.env)
            if ref.env in RESERVED_ENV or ref.env.startswith(RESERVED_ENV_PREFIXES):
                raise FieldProblem(f"environment variable {ref.env} is set by the platform", f"secrets[{i}].env",
                                   "inject the secret under another name", ref.env)
            seen[ref.env] = i
        return self

    @property
    def max_runtime_s(self) -> float:
        value, unit = float(self.max_runtime[:-1]), self.max_runtime[-1]
        return value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the spec: the identity of this configuration."""
        doc = self.model_dump(mode="json")
        if doc["code"].get("auth") is None:  # added later: unset, it keeps the hashes (and resumes) of older jobs
            doc["code"].pop("auth", None)
        if doc["training"].get("gradient_reduction") == "fixed-order":  # added later, as auth; its default
            doc["training"].pop("gradient_reduction", None)
        if doc["fault_tolerance"].get("recovery_wait_s") == FaultToleranceSpec.model_fields["recovery_wait_s"].default:
            doc["fault_tolerance"].pop("recovery_wait_s", None)  # added later, as auth: its default keeps the hash
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
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

    def __post_init__(self) -> None:
        # A NaN never equals itself: a problem carrying one would not equal its copy, nor survive strict JSON.
        if isinstance(self.value, float) and math.isnan(self.value):
            object.__setattr__(self, "value", "nan")

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
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError, RecursionError):
        return _short(value, 200)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


# ------------------------------------------------------------------------ readable validation errors


def _inner_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _inner_models(arg)]


def _model_at(root: type[BaseModel] | None, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class holding the field named by loc[-1] (list indices on the way are skipped)."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        inner = _inner_models(model.model_fields[part].annotation)
        model = inner[0] if inner else None
    return model


def _field_sections(model: type[BaseModel], prefix: str = "") -> dict[str, list[str]]:
    """field name -> the sections (dotted paths) that have a field of that name."""
    out: dict[str, list[str]] = {}
    for name, info in model.model_fields.items():
        out.setdefault(name, []).append(prefix or "<root>")
        for inner in _inner_models(info.annotation):
            for sub, where in _field_sections(inner, f"{prefix}.{name}" if prefix else name).items():
                out.setdefault(sub, []).extend(where)
    return out


def _description(holder: type[BaseModel] | None, name: Any) -> str:
    info = holder.model_fields.get(name) if holder is not None and isinstance(name, str) else None
    text = (info.description or "") if info is not None else ""
    return " ".join(text.split())


def _unknown_field_fix(root: type[BaseModel] | None, loc: tuple[Any, ...]) -> str:
    holder = _model_at(root, loc)
    if holder is None:
        return "remove it or check its spelling against `trainforge schema`"
    key, fields = str(loc[-1]) if loc else "", list(holder.model_fields)
    close = difflib.get_close_matches(key.lower(), fields, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{close[0]}`?"
    here = _loc_to_path(tuple(p for p in loc[:-1] if not isinstance(p, int))) if len(loc) > 1 else "<root>"
    elsewhere = [s for s in _field_sections(root).get(key, []) if s != here] if root is not None else []
    if elsewhere:
        return f"`{key}` belongs under `{elsewhere[0]}`: move it there"
    return f"remove it; the fields here are: {', '.join(fields)}"


def _choices(expected: str) -> list[str]:
    return re.findall(r"'([^']*)'", expected)


def _readable(err: Mapping[str, Any], loc: tuple[Any, ...], root: type[BaseModel] | None) -> tuple[str, str]:
    """(message, fix) for one pydantic error, in the spec's words rather than pydantic's."""
    kind, msg = err["type"], str(err["msg"])
    value = err.get("input")
    holder = _model_at(root, loc) if loc else None
    description = _description(holder, loc[-1]) if loc else ""
    if kind == "missing":
        return "is required but missing", f"add it: {description}" if description else "add this field"
    if kind == "extra_forbidden":
        return "unknown field", _unknown_field_fix(root, loc)
    if kind in ("enum", "literal_error"):
        choices = _choices(str((err.get("ctx") or {}).get("expected", "")))
        close = difflib.get_close_matches(str(value).lower(), choices, n=1, cutoff=0.5) if choices else []
        fix = f"did you mean '{close[0]}'?" if close else "use one of the listed values"
        return f"must be one of: {', '.join(choices)}" if choices else msg, fix
    if kind == "string_pattern_mismatch":
        return "has the wrong format", description or "see `trainforge schema`"
    if kind == "string_type":
        fix = "quote the value (YAML reads yes/no/on/off, numbers and dates as non-text)"
        return "must be text", fix + (f"; expected: {description}" if description else "")
    if kind in ("int_parsing", "int_type") and isinstance(value, str) and re.fullmatch(r"\s*[\d.]+[eE][+-]?\d+\s*",
                                                                                         value):
        try:
            number = float(value)
            written = f"{int(number)}" if number.is_integer() else value
        except (ValueError, OverflowError):
            written = "the digits"
        return "must be a whole number", f"write it out in full, e.g. {written} (YAML reads {value.strip()} as text)"
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return "must be a whole number", "write digits only, e.g. 8" + (f" ({description})" if description else "")
    if kind in ("float_parsing", "float_type"):
        return "must be a number", "write a number such as 0.5" + (f" ({description})" if description else "")
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a mapping of fields (`key: value` lines indented below it)", description
    if kind in ("list_type", "tuple_type"):
        return "must be a list", description
    if msg.startswith("Input should be "):
        msg = "must be " + msg[len("Input should be ") :]
    ctx = err.get("ctx") or {}
    bounds = [f"{sign} {ctx[key]}" for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if key in ctx]
    if bounds:
        return msg, f"use a number {' and '.join(bounds)}" + (f" ({description})" if description else "")
    if kind == "finite_number":
        return msg, "use a finite number (not .nan or .inf)"
    return msg, description or "see `trainforge schema` for this field"


_MISSING = object()


def _document_loc(loc: tuple[Any, ...], doc: Any) -> tuple[Any, ...]:
    """The parts of a pydantic location that are keys or indices of the document. The rest are pydantic's names
    for union branches and validators (`function-before[...]`, `literal['auto']`), which follow a scalar."""
    out: list[Any] = []
    node = doc
    for part in loc:
        if isinstance(node, Mapping):
            out.append(part)
            node = node.get(part, _MISSING)
        elif isinstance(node, list) and isinstance(part, int):
            out.append(part)
            node = node[part] if 0 <= part < len(node) else _MISSING
        # else: a scalar (or missing) value has no children; the part is pydantic's own
    return tuple(out)


def _problems_from_validation(exc: ValidationError, root: type[BaseModel] | None = None,
                              doc: Any = _MISSING) -> list[Problem]:
    """Turn pydantic's errors into Problems with spec paths, plain messages and fixes. `root` (default: JobSpec when
    the error came from it) enables typo suggestions and field descriptions; `doc` (the validated document) lets
    the path keep user keys that look like pydantic's internal location names."""
    if root is None and exc.title == "JobSpec":
        root = JobSpec
    by_path: dict[str, list[Problem]] = {}
    for err in exc.errors(include_url=False):
        if doc is not _MISSING:
            loc = _document_loc(tuple(err["loc"]), doc)
        else:  # drop pydantic's internal location parts (union branches, validator names)
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        cause = (err.get("ctx") or {}).get("error")
        value = err.get("input") if err["type"] != "missing" else None
        if isinstance(cause, FieldProblem):
            if cause.field:
                loc += (cause.field,)
                value = cause.value
            msg, fix = str(cause), cause.fix
        else:
            msg, fix = _readable(err, loc, root)
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, ") :]
        if isinstance(value, Mapping | list) and err["type"] != "extra_forbidden":
            value = None  # a whole sub-document is noise; the path says where
        path = _loc_to_path(loc)
        by_path.setdefault(path, []).append(Problem(path, msg, value, fix))
    problems = []
    for group in by_path.values():
        # A union (`int | None`, `int | 'auto'`) reports one error per branch: say it once.
        group = [p for p in group if p.message != "must be None"] or group[:1]
        if len(group) > 1:
            messages = list(dict.fromkeys(p.message for p in group))
            merged = messages[0] + "".join(" or " + m.removeprefix("must be ") for m in messages[1:])
            group = [Problem(group[0].path, merged, group[0].value, next((p.fix for p in group if p.fix), ""))]
        problems.extend(group)
    return problems


# ---------------------------------------------------------------------------------- document checks


def _normalize(doc: Any, path: str, problems: list[Problem], active: set[int]) -> Any:
    """A copy of the document with text keys (non-text keys are reported), refusing self-referencing YAML."""
    if isinstance(doc, Mapping | list):
        if id(doc) in active:
            raise SpecError([Problem(path or "<root>", "refers to itself through a YAML alias", None,
                                     "expand the alias: a job spec is a tree, not a graph")], unreadable=True)
        active.add(id(doc))
        try:
            if isinstance(doc, list):
                return [_normalize(v, f"{path}[{i}]", problems, active) for i, v in enumerate(doc)]
            out = {}
            for key, value in doc.items():
                sub = f"{path}.{key}" if path else str(key)
                if not isinstance(key, str):
                    problems.append(Problem(sub, f"a field name must be text, not {type(key).__name__}", key,
                                            "quote the key, or check the indentation of the line above"))
                out[str(key)] = _normalize(value, sub, problems, active)
            return out
        finally:
            active.discard(id(doc))
    return doc


def _scan_for_literal_secrets(doc: Any, path: str = "") -> list[Problem]:
    """Refuse credentials written into the spec: secrets are referenced by name, never inlined."""
    problems: list[Problem] = []
    if isinstance(doc, Mapping):
        for key, value in doc.items():
            sub = f"{path}.{key}" if path else str(key)
            scalar = isinstance(value, str | int | float) and not isinstance(value, bool)
            if scalar and value != "" and secretish_key(key):
                problems.append(
                    Problem(sub, f"{key!s} looks like a literal secret value", "<redacted>",
                            "store the value in the secret store and reference it by name under "
                            "`secrets: [{name: ..., env: ...}]`")
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


def _secret_list_problems(doc: Mapping[str, Any]) -> list[Problem]:
    """`secrets` entries carry names only; a `value` key or a credential as a name is refused."""
    problems: list[Problem] = []
    secrets = doc.get("secrets")
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
                name = item.get("name")
                if isinstance(name, str) and looks_like_secret(name):
                    problems.append(Problem(f"secrets[{i}].name", "looks like a credential, not a name",
                                            "<redacted>", "give the secret's name in the store"))
            elif isinstance(item, str) and looks_like_secret(item):
                problems.append(Problem(f"secrets[{i}]", "looks like a credential, not a reference", "<redacted>",
                                        "write `{name: my-secret, env: MY_VAR}`"))
    return problems


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".") or path.startswith(parent + "[")


def _without_secret_values(problems: list[Problem], secret_paths: list[str]) -> list[Problem]:
    """Drop schema problems about a value already reported as a secret, and never echo a secret's value."""
    out = []
    for p in problems:
        if any(_within(p.path, s) for s in secret_paths):
            continue  # the secret problem says it; the schema message could echo the value
        if any(_within(s, p.path) for s in secret_paths):
            p = Problem(p.path, p.message, "<redacted>" if p.value is not None else None, p.fix, p.severity)
        out.append(p)
    return out


def parse_spec(doc: Any, source: str = "<spec>") -> JobSpec:
    """Validate an already-parsed document. Raises SpecError with every problem found."""
    if doc is None:
        raise SpecError([Problem("<root>", "the document is empty", None, "start from examples/tiny-cpu.yaml")],
                        source)
    if not isinstance(doc, Mapping):
        raise SpecError(
            [Problem("<root>", f"a job spec must be a mapping of fields, not a {type(doc).__name__}", None,
                     "start from examples/tiny-cpu.yaml")],
            source,
        )
    key_problems: list[Problem] = []
    try:
        plain = _normalize(doc, "", key_problems, set())
    except SpecError as exc:
        raise SpecError(exc.problems, source, True) from None
    except RecursionError:
        raise SpecError([Problem("<root>", "the document is nested too deeply", None,
                                 "a job spec is a few levels deep; check the structure")], source) from None
    secret_problems = _secret_list_problems(plain) + _scan_for_literal_secrets(
        {k: v for k, v in plain.items() if k != "secrets"}
    )
    try:
        spec = JobSpec.model_validate(plain)
    except ValidationError as exc:
        schema_problems = _problems_from_validation(exc, JobSpec, plain)
    else:
        schema_problems = []
    if not (key_problems or secret_problems or schema_problems):
        return spec
    seen = {p.path for p in key_problems}
    schema_problems = [p for p in schema_problems if p.path not in seen]
    secret_paths = [p.path for p in secret_problems]
    raise SpecError(key_problems + secret_problems + _without_secret_values(schema_problems, secret_paths), source)


# ------------------------------------------------------------------------------------------ reading

MAX_SPEC_BYTES = 4 * 2**20  # a job spec is a few KiB; anything this large is the wrong file
MAX_EXPANDED_VALUES = 100_000  # YAML aliases can expand a small file exponentially ("billion laughs")


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: with plain YAML the second silently wins, hiding a mistake."""


def _construct_mapping(loader: _SpecLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {key!r} appears twice (the second would silently replace the first)", key_node.start_mark,
                )
            seen.add(key)
    loader.flatten_mapping(node)
    return dict(loader.construct_pairs(node, deep=deep))  # type: ignore[no-untyped-call]


_SpecLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


class _DuplicateKey(ValueError):
    pass


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key {key!r} appears twice (the second would silently replace the first)")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _DuplicateKey(f"{name} is not a number a spec can use")


def _expanded_size(doc: Any, memo: dict[int, int]) -> int:
    """Values in the document once YAML aliases are expanded (what validation will walk)."""
    if not isinstance(doc, dict | list):
        return 1
    if id(doc) in memo:
        return memo[id(doc)]
    memo[id(doc)] = 1  # a self-reference counts once here; _normalize reports it
    children = doc.values() if isinstance(doc, dict) else doc
    total = 1 + sum(_expanded_size(v, memo) for v in children)
    memo[id(doc)] = total
    return total


def _unparsable(message: str, source: str, fix: str = "fix the syntax (indentation, quotes, colons)") -> SpecError:
    return SpecError([Problem("<file>", message, None, fix)], source, True)


def _parse_json(text: str, source: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_json_pairs, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise _unparsable(f"not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", source,
                          "fix the JSON syntax (quotes, commas, brackets)") from None
    except _DuplicateKey as exc:
        raise _unparsable(f"not a usable JSON document: {exc}", source, "remove the duplicate") from None
    except RecursionError:
        raise _unparsable("the document is nested too deeply to read", source,
                          "a job spec is a few levels deep; check for runaway brackets") from None


def _parse_yaml(text: str, source: str) -> Any:
    try:
        # safe_load semantics: never constructs Python objects. JSON is (nearly) a subset of YAML.
        return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - _SpecLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = exc.problem or exc.context or "syntax error"
        raise _unparsable(f"not valid YAML at {where}: {problem}", source) from None
    except yaml.reader.ReaderError as exc:
        raise _unparsable(f"not a text document: {exc.reason} at character {exc.position}", source,
                          "give a YAML or JSON text file") from None
    except yaml.YAMLError as exc:
        raise _unparsable(f"not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          source) from None
    except RecursionError:
        raise _unparsable("the document is nested too deeply to read", source,
                          "a job spec is a few levels deep; check for runaway brackets") from None
    except Exception as exc:  # noqa: BLE001 - the YAML library can fail in other ways on adversarial input
        raise _unparsable(f"cannot parse the document ({type(exc).__name__}: {exc})", source) from None


def parse_text(text: str, source: str = "<spec>", *, kind: Literal["auto", "yaml", "json"] = "auto") -> Any:
    """Parse a spec document. JSON is read as JSON (`kind="json"`, or text starting with `{`/`[` that is valid
    JSON), everything else as YAML. Raises SpecError(unreadable=True) with the line and column of a syntax error."""
    stripped = text.lstrip("\ufeff \t\r\n")
    if kind == "json":
        doc = _parse_json(stripped, source)
    else:
        doc = None
        parsed = False
        if kind == "auto" and stripped[:1] in ("{", "["):
            with contextlib.suppress(SpecError):  # flow-style YAML also starts with a bracket
                doc, parsed = _parse_json(stripped, source), True
        if not parsed:
            doc = _parse_yaml(text.lstrip("\ufeff"), source)
    try:
        size = _expanded_size(doc, {})
    except RecursionError:
        raise _unparsable("the document is nested too deeply to read", source) from None
    if size > MAX_EXPANDED_VALUES:
        raise _unparsable(f"the document expands to {size:,} values through YAML aliases (limit "
                          f"{MAX_EXPANDED_VALUES:,})", source, "write the values out instead of nesting aliases")
    return doc


def read_document(path: str | Path) -> Any:
    """Read YAML or JSON from a file; raises SpecError(unreadable=True) if it cannot be read or parsed."""
    p = Path(path)
    source = str(p)

    def unreadable(message: str, fix: str) -> SpecError:
        return SpecError([Problem("<file>", message, source, fix)], source, True)

    try:
        if p.is_dir():
            raise unreadable("is a directory, not a file", "give the path of a YAML or JSON job spec file")
        if not p.exists():
            raise unreadable("file not found", "check the path (relative paths start at the current directory)")
        if not p.is_file():
            raise unreadable("is not a regular file", "give the path of a YAML or JSON job spec file")
        if p.stat().st_size > MAX_SPEC_BYTES:
            raise unreadable(f"is {p.stat().st_size:,} bytes: too large for a job spec",
                             "check that this is the spec file and not data")
        data = p.read_bytes()
    except SpecError:
        raise
    except PermissionError:
        raise unreadable("permission denied", "make the file readable (chmod) or copy it") from None
    except (OSError, ValueError) as exc:
        raise unreadable(f"cannot read the file: {getattr(exc, 'strerror', None) or exc}", "check the path") from None
    if b"\x00" in data:
        raise unreadable("is a binary file, not YAML or JSON text", "give the job spec's YAML or JSON file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise unreadable(f"is not UTF-8 text (byte {exc.start})", "save the file as UTF-8 YAML or JSON") from None
    kind: Literal["auto", "json"] = "json" if p.suffix.lower() == ".json" else "auto"
    return parse_text(text, source, kind=kind)


def load_spec(path: str | Path) -> JobSpec:
    """Load and schema-validate a spec file (YAML or JSON)."""
    return parse_spec(read_document(path), str(path))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of the job spec (`trainforge schema`): every field with its description."""
    return JobSpec.model_json_schema()
