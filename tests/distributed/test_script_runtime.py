"""Script mode with trainforge.runtime: the user's own PyTorch script (examples/script_mode/train_torch.py, DDP,
its own model and loop) runs as a real 2-rank job through the platform's segment launcher (`run_segment`: torchrun,
supervisor, heartbeats) with the platform's checkpoints, data order and metrics.

A job cut into two segments (fault_tolerance.segment_max_steps = 6 of 12 steps) resumes from its committed step-6
checkpoint and ends with bitwise the losses and weights of the same job run in one segment. About 1-2 minutes on
2 cores. Run: `.venv/bin/python -m pytest tests/distributed/test_script_runtime.py -q`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.registry.manifest import list_committed, materialize, verify

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "script_mode"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _job(name: str, segment_max_steps: int | None, spec_file: str = "train_torch.yaml",
         workers: int = 2) -> dict[str, Any]:
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks import prepare
    from trainforge.tasks.segment import run_segment

    doc = yaml.safe_load((EXAMPLE / spec_file).read_text())
    doc["name"] = name
    if segment_max_steps:
        doc["fault_tolerance"]["segment_max_steps"] = segment_max_steps
    if workers != 2:
        doc["resources"].update(min_gpus=workers, gpus_per_node=workers)
        doc["parallelism"]["dp"] = workers
    spec = prepare.validate_spec(doc, spec_file, EXAMPLE)
    dataset = prepare.resolve_dataset(spec, EXAMPLE)
    plan = prepare.make_plan(spec)
    record = JobStore().create(name, name=spec.name, team=spec.team, spec=doc, source="train_torch.yaml")
    record.update(plan=plan, dataset=dataset)
    config = prepare.worker_config(spec, name, record.folder, EXAMPLE, dataset, plan, "test")
    path = config.write(record.folder / "worker-config.json")
    results = []
    for _ in range(3):  # segments until the job is done, like the train-job flow
        fresh = JobStore().get(name)
        results.append(run_segment(fresh, path, config, nproc=workers, max_restarts=0,
                                   extra_env={"OMP_NUM_THREADS": "1"}))
        if results[-1].last_step is not None and results[-1].last_step >= config.total_steps:
            break
    return {"config": config, "record": record, "results": results}


@contextlib.contextmanager
def _home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A module-wide TRAINFORGE_HOME (the autouse per-test home is function-scoped) with the demo dataset."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRAINFORGE_HOME", str(tmp_path_factory.mktemp("script-home")))
        mp.delenv("TRAINFORGE_CLUSTER", raising=False)
        from trainforge.datasets.demo import ensure_demo_dataset

        ensure_demo_dataset()
        yield


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    with _home(tmp_path_factory):
        yield {"clean": _job("script-clean", None), "resumed": _job("script-resumed", 6)}


def events(job: dict[str, Any]) -> list[dict[str, Any]]:
    return read_events(Path(job["config"].run_dir) / "events.jsonl")[0]


def losses(job: dict[str, Any]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events(job) if e["type"] == "metrics"}


def committed(job: dict[str, Any]) -> dict[int, Any]:
    cfg = job["config"]
    return {r.step: r for r in list_committed(open_store(cfg.storage_url), cfg.storage_prefix)}


def _model_class() -> Any:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from train_torch import TinyCausalLM
    finally:
        sys.path.remove(str(EXAMPLE))
    return TinyCausalLM


def final_weights(job: dict[str, Any], scratch: Path) -> dict[str, torch.Tensor]:
    """The last committed checkpoint read back single-process into the script's own (unwrapped) model."""
    from trainforge.trainer.checkpoint import load_model_weights

    TinyCausalLM = _model_class()
    cfg = job["config"]
    ref = committed(job)[cfg.total_steps]
    folder = scratch / f"{cfg.job_id}-{ref.step}"
    assert materialize(open_store(cfg.storage_url), ref, folder) == []  # every file sha256-checked
    m = cfg.model
    torch.manual_seed(99)  # not the job's seed: every weight must come from the checkpoint
    model = TinyCausalLM(m.vocab, m.hidden, m.heads, m.layers, cfg.training.seq_len)
    load_model_weights(folder, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_segments_end_and_resume_from_the_committed_checkpoint(jobs: dict[str, dict[str, Any]]) -> None:
    clean, resumed = jobs["clean"], jobs["resumed"]
    assert [(r.last_step, r.reason) for r in clean["results"]] == [(12, "finished")]
    assert [(r.last_step, r.reason) for r in resumed["results"]] == [(6, "segment_max_steps"), (12, "finished")]
    starts = [(e["step"], e["resumed_from"]) for e in events(resumed) if e["type"] == "segment_start"]
    assert starts == [(0, None), (6, 6)]
    assert sorted(committed(resumed)) == [4, 6, 8, 12]  # interval 4, plus each segment's end
    assert sorted(committed(clean)) == [4, 8, 12]


def test_resumed_job_equals_uninterrupted_bitwise(jobs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    a, b = losses(jobs["clean"]), losses(jobs["resumed"])
    assert sorted(a) == list(range(1, 13))
    assert b == a  # every step's global loss, the resumed segment's steps 7-12 included
    wa, wb = final_weights(jobs["clean"], tmp_path), final_weights(jobs["resumed"], tmp_path)
    assert wa.keys() == wb.keys() and len(wa) > 4
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    cfg = jobs["clean"]["config"]
    torch.manual_seed(cfg.training.seed)  # the script's initial weights: training changed them
    init = _model_class()(cfg.model.vocab, cfg.model.hidden, cfg.model.heads, cfg.model.layers,
                          cfg.training.seq_len).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in wa.items())


def test_checkpoints_are_platform_commits(jobs: dict[str, dict[str, Any]]) -> None:
    job = jobs["resumed"]
    cfg = job["config"]
    refs = committed(job)
    store = open_store(cfg.storage_url)
    assert all(verify(store, r) == [] for r in refs.values())
    m = refs[6].manifest
    assert m["mode"] == "script" and m["framework"] == "pytorch" and m["world_size"] == 2
    assert m["sampler"]["position"] == 6 * cfg.training.global_batch_size
    assert m["dataset"]["version"] == cfg.dataset.version
    assert m["metrics"]["train_loss"] == losses(job)[6]
    names = {f["name"] for f in m["files"]}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "rng-rank00000.safetensors",
            "rng-rank00001.safetensors"} <= names
    # the flow's checkpoint events: one per commit, rank 0 only
    ckpt_events = sorted(e["step"] for e in events(job) if e["type"] == "checkpoint")
    assert ckpt_events == sorted(refs)
    staged = [e["step"] for e in events(job) if e["type"] == "checkpoint_staged"]
    assert staged == sorted(refs)  # each save's blocked time, reported once its host copy completed


def test_metrics_heartbeats_and_lr_from_the_script(jobs: dict[str, dict[str, Any]]) -> None:
    job = jobs["clean"]
    metrics = [e for e in events(job) if e["type"] == "metrics"]
    assert len(metrics) == 12  # rank 0 writes; not one line per rank
    assert all({"loss", "grad_norm", "lr", "step_time_s"} <= set(e) for e in metrics)
    assert metrics[0]["lr"] == pytest.approx(0.003 * 1 / 2)  # warm-up step 1 of 2 (the script's own schedule)
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learns
    from trainforge.trainer.health import read_heartbeats

    beats = read_heartbeats(job["config"].run_dir, 0)
    assert sorted(beats) == [0, 1] and all(b["phase"] == "done" and b["step"] == 12 for b in beats.values())
    segment = job["record"].folder / "worker-config-segment-0.json"
    assert json.loads(segment.read_text())["code"]["mode"] == "script"
    assert job["config"].code.entrypoint == "train_torch.py"



@pytest.mark.parametrize("framework,spec_file", [("jax", "train_jax.yaml"), ("tensorflow", "train_tf.yaml")])
def test_framework_script_two_processes_equal_one(tmp_path_factory: pytest.TempPathFactory, framework: str,
                                                  spec_file: str) -> None:
    """examples/script_mode/train_jax.py (jax.distributed, started by runtime.init() from the injected JAX_*
    variables; gloo collectives on CPU) and train_tf.py (MultiWorkerMirroredStrategy from the injected TF_CONFIG)
    train on the global batch across 2 processes: their per-step losses equal the same script on 1 process (a
    process that trained on its own rows only would see other data). Each runs only where its framework is
    installed."""
    pytest.importorskip("jax" if framework == "jax" else "tensorflow")
    with _home(tmp_path_factory):
        two = _job(f"{framework}-two", None, spec_file, workers=2)
        one = _job(f"{framework}-one", None, spec_file, workers=1)
    assert [(r.last_step, r.reason) for r in two["results"]] == [(12, "finished")]
    a, b = losses(two), losses(one)
    assert sorted(a) == list(range(1, 13)) and sorted(b) == sorted(a)
    # fp32; only the order of the cross-process reduction differs
    torch.testing.assert_close(torch.tensor([a[k] for k in sorted(a)]), torch.tensor([b[k] for k in sorted(b)]),
                               rtol=1e-5, atol=0.0)
    assert a[12] < a[1]
    from trainforge.trainer.health import read_heartbeats

    beats = read_heartbeats(two["config"].run_dir, 0)
    assert sorted(beats) == [0, 1] and all(b["phase"] == "done" and b["step"] == 12 for b in beats.values())
