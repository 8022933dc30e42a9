"""SegmentConfig (trainforge/contract/config.py), the typed config every worker receives.

Covers: built from the validated spec, the resolved dataset and the plan, it round-trips through its JSON; each
attempt gets a copy with its health policy, skip list and layout; its parts are typed all the way down (no dict
of Any anywhere) and it imports without torch; an unknown field, at the top or in a part, is refused with its
name; each backend's rendering loads with the worker's own class: the local backend's attempt file and the
Kubernetes ConfigMap (`manifests_for_spec` and `trainforge render --backend kubernetes`); a submit validates the
spec once, parses its file once and resolves the layout once.

Run: .venv/bin/python -m pytest tests/unit/test_segment_config.py -q
"""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from trainforge.contract.config import ENV_VAR, EngineConfig, ResolvedDataset, SegmentConfig
from trainforge.contract.health import HealthPolicy
from trainforge.plan.layout import Layout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def built(tmp_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any], SegmentConfig]:
    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.tasks import prepare

    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    spec = prepare.validate_spec(doc, "tiny-cpu.yaml", EXAMPLES)
    dataset = prepare.resolve_dataset(spec, EXAMPLES)
    plan = prepare.make_plan(spec)
    config = prepare.worker_config(spec, "tiny-1", tmp_path / "run", EXAMPLES, dataset, plan, "abc123")
    return spec, dataset, plan, config


def test_built_once_from_spec_dataset_and_plan(built) -> None:
    spec, dataset, plan, cfg = built
    assert cfg.training == spec.training and cfg.code == spec.code
    assert cfg.layout == Layout(**plan["layout"]) and cfg.model.name == spec.name
    assert cfg.model_args() == plan["model"]  # what the entrypoint's factory and the manifests receive
    assert cfg.dataset.version == dataset["version"] and cfg.dataset.num_samples == dataset["num_samples"]
    assert cfg.engine == EngineConfig(kind=spec.parallelism.engine)
    assert cfg.storage_prefix == f"teams/{spec.team}/jobs/tiny-1" and cfg.code_commit == "abc123"
    assert cfg.total_steps == spec.training.total_steps and cfg.checkpoint_interval >= 1
    assert SegmentConfig.model_validate_json(cfg.dump_json()) == cfg


def test_each_attempt_gets_its_own_copy(built) -> None:
    cfg = built[3]
    policy = HealthPolicy(heartbeat_timeout_s=3.0, divergence_action="stop")
    small = Layout(dp=1, micro_batch_size=cfg.layout.micro_batch_size)
    second = cfg.for_attempt(2, policy, [17, 3, 9], small)
    assert (second.attempt, second.health, second.skip_samples, second.layout) == (2, policy, (3, 9, 17), small)
    assert (cfg.attempt, cfg.health, cfg.skip_samples) == (None, HealthPolicy(), ())  # the job's base is untouched
    assert cfg.for_attempt(3, policy).layout == cfg.layout  # no resize: the plan's layout
    again = SegmentConfig.model_validate_json(second.dump_json())
    assert again == second and isinstance(again.health, HealthPolicy)
    with pytest.raises(pydantic.ValidationError):
        cfg.job_id = "other"  # type: ignore[misc]  # frozen: a worker never edits its config


def test_a_checkpoint_manifest_names_the_attempt_that_commits_it(built) -> None:
    """The control plane books from the store a commit of its attempt whose report never arrived (tasks/supervisor.py
    `report_unreported_commits`): the manifest says which attempt wrote it."""
    from trainforge.trainer.segment import manifest_fields

    cfg = built[3]
    assert manifest_fields(cfg.for_attempt(2, HealthPolicy()), 1, 8, None)["segment_attempt"] == 2
    assert manifest_fields(cfg, 1, 8, None)["segment_attempt"] is None  # the job's base config is no attempt's


def _annotations(tp: Any, seen: set[Any]) -> list[Any]:
    """Every type reachable from `tp` through pydantic models, dataclasses and generic arguments."""
    import dataclasses

    if tp in seen:
        return []
    seen.add(tp)
    out = [tp]
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        for f in tp.model_fields.values():
            out += _annotations(f.annotation, seen)
    elif dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            out += _annotations(hints[f.name], seen)
    for arg in typing.get_args(tp):
        out += _annotations(arg, seen)
    return out


def test_typed_all_the_way_down_and_importable_without_torch() -> None:
    kinds = _annotations(SegmentConfig, set())
    assert not [t for t in kinds if t is dict or typing.get_origin(t) is dict or t is Any], \
        "a part of SegmentConfig is a bag of keys"
    assert SegmentConfig.model_config["extra"] == "forbid" and SegmentConfig.model_config["frozen"]
    code = ("import sys; import trainforge.contract.config, trainforge.contract.health; "
            "assert 'torch' not in sys.modules, 'the contract pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("path,value", [
    (("extra",), {"engine": "deepspeed"}),  # the old bag
    (("layout", "hsdp_degree"), 2),
    (("training", "optimizer", "learning_rate"), 0.1),
    (("dataset", "folder"), "/data"),
    (("health", "heartbeat_timeout"), 1.0),
])
def test_an_unknown_field_is_refused_by_name(built, path: tuple[str, ...], value: Any) -> None:
    import json

    doc = json.loads(built[3].for_attempt(0, HealthPolicy()).dump_json())
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(pydantic.ValidationError) as info:
        SegmentConfig.model_validate_json(json.dumps(doc))
    assert ".".join(path) in str(info.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "worker-config.json"
    bad.write_text('{"job_id": "j", "model": {}, "extra": {}}')
    with pytest.raises(ValueError, match=r"(?s)worker-config.json is not a valid segment config.*extra\n  Extra inputs are not permitted"):
        SegmentConfig.load(bad)


def test_the_local_backends_attempt_file_loads_with_the_workers_class(built, tmp_path: Path) -> None:
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.segment import segment_config

    cfg = built[3]
    record = JobStore(tmp_path / "jobs").create("tiny-1")
    record.update(skip_samples=[5, 1])
    path = segment_config(record, cfg, 1, HealthPolicy(heartbeat_timeout_s=2.0),
                          {**built[2]["layout"], "dp": 1})
    loaded = SegmentConfig.load(path)
    assert loaded == cfg.for_attempt(1, HealthPolicy(heartbeat_timeout_s=2.0), [1, 5],
                                     Layout(**{**built[2]["layout"], "dp": 1}))


def _config_map(manifests: list[dict[str, Any]]) -> str:
    (cm,) = [m for m in manifests if m["kind"] == "ConfigMap"]
    return cm["data"]["worker-config.json"]


def test_the_kubernetes_config_map_loads_with_the_workers_class(built) -> None:
    from trainforge.infra.k8s.job import manifests_for_spec
    from trainforge.infra.k8s.render import RUN_DIR
    from trainforge.plan.cluster import default_cluster

    spec, dataset, _, _ = built
    resolved = ResolvedDataset.from_resolution(dataset)
    cfg = SegmentConfig.model_validate_json(_config_map(
        manifests_for_spec(spec, "tiny-k8s-1", default_cluster(), dataset=resolved)))
    assert cfg.job_id == "tiny-k8s-1" and cfg.run_dir == RUN_DIR and cfg.dataset == resolved
    preview = SegmentConfig.model_validate_json(_config_map(manifests_for_spec(spec, "tiny-k8s-2", default_cluster())))
    with pytest.raises(ValueError, match="not resolved to a version"):  # a render preview pins nothing
        preview.dataset.require_pinned()


def test_trainforge_render_config_map_loads_with_the_workers_class() -> None:
    from typer.testing import CliRunner

    from trainforge.cli import app

    result = CliRunner().invoke(app, ["render", str(EXAMPLES / "llama-7b-finetune.yaml"), "--backend", "kubernetes",
                                      "--cluster", str(EXAMPLES / "clusters" / "fleet-10k.yaml"), "--job-id", "ft-1"])
    assert result.exit_code == 0, result.output
    cfg = SegmentConfig.model_validate_json(_config_map(list(yaml.safe_load_all(result.stdout))))
    assert cfg.job_id == "ft-1" and cfg.layout.world_size == cfg.layout.dp * cfg.layout.tp * cfg.layout.pp
    assert ENV_VAR == "TRAINFORGE_JOB_CONFIG"


class _Stop(Exception):
    """Ends the flow right after its one validation and plan (before anything is provisioned)."""


@pytest.mark.slow
@pytest.mark.slow
def test_a_submit_validates_parses_and_resolves_the_layout_once(prefect_api, monkeypatch, tmp_path) -> None:
    import trainforge.commands.jobs as jobs
    import trainforge.flows.train_job as flow
    import trainforge.plan.job as plan_job
    import trainforge.plan.resolve as resolve
    import trainforge.spec as spec_module
    import trainforge.tasks.prepare as prepare
    import trainforge.validate as validate
    from trainforge.datasets.demo import ensure_demo_dataset

    ensure_demo_dataset()
    calls = {"validate": 0, "parse": 0, "resolve": 0}

    def counting(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    validate_document = counting("validate", validate.validate_document)
    for module in (validate, prepare):
        monkeypatch.setattr(module, "validate_document", validate_document)
    read_document = counting("parse", spec_module.read_document)
    for module in (spec_module, validate):  # the CLI reads the file through the SDK (sdk.prepare)
        monkeypatch.setattr(module, "read_document", read_document)
    resolve_layout = counting("resolve", resolve.resolve_layout)
    for module in (resolve, plan_job):  # validate imports it from plan.resolve; make_plan from plan/job.py
        monkeypatch.setattr(module, "resolve_layout", resolve_layout)

    def stop(*args: Any, **kwargs: Any) -> Any:
        raise _Stop

    monkeypatch.setattr(flow, "_provision", stop)
    monkeypatch.setattr(flow, "_start_tracking", lambda *a, **k: "run-1")  # no MLflow run for a stopped job
    spec_file = tmp_path / "tiny.yaml"
    spec_file.write_text((EXAMPLES / "tiny-cpu.yaml").read_text())
    with pytest.raises(_Stop):
        jobs.run_job(spec_file, show_progress=False)
    assert calls == {"validate": 1, "parse": 1, "resolve": 1}
