"""`SegmentConfig`: the typed, complete config one segment attempt of a job hands to every worker.

Built once per submit from the validated `JobSpec`, the resolved dataset and the plan (`SegmentConfig.build`),
copied per attempt with that attempt's health policy, skip list and (elastic jobs) layout (`for_attempt`), and
rendered by every backend the same way (`dump_json`): the local backend writes it to a file named by
$TRAINFORGE_JOB_CONFIG, the Kubernetes backend puts it in the job's ConfigMap. The worker reads it back with
`load` / `model_validate_json`; an unknown or misspelt field is refused with its name, never ignored.

It carries no secrets (environment variables) and no topology (rank and world size come from torchrun).
`run_dir`, `staging_dir`, `code_dir`, `init_weights` and `dataset.path` are paths on the flow's host. A gang on
other machines (the `hosts` backend) never reads them there: the flow publishes the code tree, the initial weights
and a local dataset to the job's prefix in the object store (`ShippedInputs`, tasks/inputs.py), each node gets its
own copy of the config (`for_node`: its own run and staging folders), and every worker fetches the inputs into the
node's folder before anything reads them (trainer/inputs.py `localize`).
Pure: pydantic, the spec and the plan's types; no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainforge.contract.health import HealthPolicy
from trainforge.infra.storage.layout import job_prefix
from trainforge.plan.layout import Layout
from trainforge.plan.model import ModelShape
from trainforge.spec import CodeSpec, Engine, JobSpec, TrainingSpec

ENV_VAR = "TRAINFORGE_JOB_CONFIG"
"""The environment variable naming the config file in every worker."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResolvedDataset(_Part):
    """The dataset version the job pinned (datasets.refs.resolve_reference) and how the trainer reads it."""

    ref: str
    """The reference the spec names (catalog://name@branch, file://..., lakefs://...)."""
    pinned_ref: str | None = None
    """The reference to this exact version."""
    name: str = ""
    version: str | None = None
    """The committed version's id; None only in a preview (`trainforge render`) that could not resolve it."""
    license: str | None = None
    path: str = ""
    """The version's folder (local shards) or URI (streamed through the cache tiers)."""
    num_samples: int = 0
    sample_len: int = 0
    vocab_size: int = 0
    eval_fraction: float = 0.01
    transforms: tuple[str, ...] = ()
    """Online preprocessing (spec dataset.transforms), applied in the data pipeline."""
    num_workers: int = 0
    """Data-loader worker processes (0: read in the training process)."""
    tokenizer: str = ""
    """The tokenizer an in-place version (an s3:// prefix) is read with: byte-level-v1 or hf:sha256:<digest> (kept
    in the version folder); empty for tokenized shards, which name their own."""

    @classmethod
    def from_resolution(cls, resolved: dict[str, Any]) -> ResolvedDataset:
        """From tasks/prepare.py `resolve_dataset`'s record (its `warnings` are the flow's to log, not the worker's)."""
        return cls.model_validate({k: v for k, v in resolved.items() if k != "warnings"})

    @property
    def in_place(self) -> bool:
        """An s3:// prefix read in place (its samples are counted as they are read), not tokenized shards."""
        return bool(self.tokenizer)

    def require_pinned(self) -> str:
        """The pinned version; a worker never trains on an unresolved reference."""
        if self.version is None:
            raise ValueError(f"dataset {self.ref!r} in this segment config is not resolved to a version (a "
                             "`trainforge render` preview); submit the job, which pins the version")
        return self.version


class ShippedInputs(_Part):
    """What the flow resolved on its own disk, published to the job's prefix in the object store for workers on
    other machines (tasks/inputs.py `publish_inputs`). Keys are relative to the job's prefix and content-addressed:
    a later segment, a torchrun restart or another rank on the node finds them fetched already."""

    code: str
    """The code tree as one tar (inputs/code/{sha256}.tar)."""
    code_sha256: str
    init_weights: str | None = None
    """The fine-tuning weights (inputs/init/{sha256}.safetensors)."""
    init_weights_sha256: str | None = None
    dataset_store: str
    """The store holding the dataset version's shards: the catalog's own (a remote catalog, lakeFS) or, for a
    version that lives on the flow's disk, the job's store."""
    dataset_prefix: str
    """The version's prefix in `dataset_store` (manifest.json and the shards)."""


class EngineConfig(_Part):
    """The training engine: the native loop (DDP/FSDP/TP/PP/EP from the layout) or DeepSpeed ZeRO."""

    kind: Engine = Engine.NATIVE
    zero_stage: int | None = Field(default=None, ge=0, le=3)
    """DeepSpeed's ZeRO stage; None derives it from the layout's sharding (parallel/deepspeed_engine.py)."""


class SegmentConfig(BaseModel):
    """Everything a worker of one segment attempt needs (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    team: str
    name: str
    run_dir: str
    """Job folder: events, per-rank logs, failure reports (the flow's own; a node's for a gang on other machines)."""
    storage_url: str
    """Object store root (file:///... or s3://bucket)."""
    storage_prefix: str
    """The job's prefix in the store: teams/{team}/jobs/{job}."""
    staging_dir: str
    """Node-local staging folder for checkpoints before upload."""
    code: CodeSpec
    code_dir: str
    """The resolved code folder the entrypoint is imported from (on the flow's host until `localize`)."""
    code_commit: str = "unknown"
    config_hash: str = ""
    model: ModelShape
    layout: Layout
    engine: EngineConfig = EngineConfig()
    training: TrainingSpec
    total_steps: int = Field(ge=1)
    dataset: ResolvedDataset
    checkpoint_interval: int = Field(ge=1)
    segment_max_steps: int | None = Field(default=None, ge=1)
    collective_timeout_s: float = Field(default=120.0, gt=0)
    init_weights: str | None = None
    """Fine-tuning: a safetensors file of the parent's weights, loaded before step 0 (on the flow's host until
    `localize`)."""
    profile_steps: str | None = None
    """A profiler window (trainer/profiling.py `parse_window`); $TRAINFORGE_PROFILE_STEPS when unset."""
    inputs: ShippedInputs | None = None
    """Set for a gang on other machines: where its workers fetch the code, the dataset and the initial weights
    (None: the paths above are read where they are; also None once a worker has fetched them)."""
    node_dir: str | None = None
    """This node's own folder for the job (fetched inputs, checkpoint staging), set per node by `for_node`."""
    # The segment attempt's part (for_attempt): absent in the job's base config.
    attempt: int | None = Field(default=None, ge=0)
    health: HealthPolicy = HealthPolicy()
    skip_samples: tuple[int, ...] = ()
    """Samples divergence rollbacks skip: the job record keeps them, so every later segment replays one order."""

    @property
    def entrypoint(self) -> str:
        return self.code.entrypoint

    @property
    def script_mode(self) -> bool:
        return self.code.mode == "script"

    def model_args(self) -> dict[str, int]:
        """The model section a managed entrypoint's factory receives (and a checkpoint manifest records)."""
        m = self.model
        return {"layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
                "ffn_hidden": m.ffn_hidden, "vocab": m.vocab, "experts": m.experts, "top_k": m.top_k}

    @classmethod
    def build(cls, spec: JobSpec, dataset: ResolvedDataset, plan: dict[str, Any], *, job_id: str, run_dir: str,
              storage_url: str, staging_dir: str, code_dir: str, code_commit: str, checkpoint_interval: int,
              init_weights: str | None = None, collective_timeout_s: float = 120.0) -> SegmentConfig:
        """The job's config from the validated spec, the resolved dataset and the plan (tasks/prepare.py `make_plan`:
        its `layout` and `model` are the planner's, resolved once per submit)."""
        return cls(
            job_id=job_id, team=spec.team, name=spec.name, run_dir=run_dir, storage_url=storage_url,
            storage_prefix=job_prefix(spec.team, job_id), staging_dir=staging_dir, code=spec.code, code_dir=code_dir,
            code_commit=code_commit, config_hash=spec.config_hash(),
            model=ModelShape(name=spec.name, **plan["model"]), layout=Layout(**plan["layout"]),
            engine=EngineConfig(kind=spec.parallelism.engine), training=spec.training,
            total_steps=spec.training.total_steps, dataset=dataset, checkpoint_interval=checkpoint_interval,
            segment_max_steps=spec.fault_tolerance.segment_max_steps, collective_timeout_s=collective_timeout_s,
            init_weights=init_weights)

    def for_attempt(self, attempt: int, health: HealthPolicy, skip_samples: tuple[int, ...] | list[int] = (),
                    layout: Layout | None = None) -> SegmentConfig:
        """This attempt's copy: its health policy, the samples to skip and, for an elastic job resized to another
        data-parallel degree, that size's layout (tasks/provision.py `layout_for`)."""
        return self.model_copy(update={"attempt": attempt, "health": health,
                                       "skip_samples": tuple(sorted(skip_samples)),
                                       "layout": layout or self.layout})

    def for_node(self, node_dir: str) -> SegmentConfig:
        """One node's copy for a gang on other machines: its folder for the job (fetched inputs, staging, run files
        such as a fault drill's fire-once markers), kept across segments so a later one reuses the fetched inputs
        and the verified checkpoint copy."""
        return self.model_copy(update={"node_dir": node_dir, "staging_dir": f"{node_dir}/staging",
                                       "run_dir": f"{node_dir}/run"})

    def dump_json(self) -> str:
        return self.model_dump_json(indent=1)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.dump_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> SegmentConfig:
        """Read a rendered config; a file that is not one raises naming the file and each bad field."""
        path = Path(path)
        try:
            return cls.model_validate_json(path.read_bytes())
        except ValueError as exc:
            raise ValueError(f"{path} is not a valid segment config (trainforge.contract.config.SegmentConfig); "
                             f"it was written by another trainforge version or edited by hand: {exc}") from exc
