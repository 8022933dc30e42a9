"""The spine, end to end: the train-job Prefect flow with real torchrun workers (gloo), real checkpoints on disk,
a real MLflow store and model registry.

Covers: a job completes with falling loss, committed checkpoints and a registered model whose safetensors load
alone; a worker killed mid-run is retried from the last committed checkpoint and ends bit-identical to a clean
run, ignoring an uncommitted checkpoint folder; user-code failures are reported with rank and log lines and not
retried; an invalid spec starts nothing and writes nothing.

Run: .venv/bin/python -m pytest tests/integration/test_train_job.py   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import read_events
from trainforge.registry.jobs import JobStore
from trainforge.registry.tracking import LINEAGE_TAGS, Tracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def small_spec(**training) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": 24, "global_batch_size": 8, "seq_len": 64, **training})
    doc["parallelism"]["micro_batch_size"] = 2  # 2 micro-batches per rank: exercises no_sync accumulation
    doc["checkpoint"]["interval_steps"] = 8
    doc["evaluation"]["batches"] = 2
    return doc


def run_flow(doc: dict, base_dir: Path = EXAMPLES, job_id: str | None = None, resume: bool = False) -> dict:
    from trainforge.flows.train_job import train_job

    return train_job(copy.deepcopy(doc), "test-spec.yaml", str(base_dir), job_id, resume)


def metrics(job_id: str) -> list[dict]:
    record = JobStore().get(job_id)
    events, _ = read_events(record.events_path)
    return events


@pytest.fixture
def demo_data():
    return ensure_demo_dataset()


def test_job_trains_commits_evaluates_and_registers(prefect_api, demo_data):
    result = run_flow(small_spec())
    assert result["state"] == "completed"
    events = metrics(result["job_id"])
    losses = [e["loss"] for e in events if e["type"] == "metrics"]
    assert len(losses) == 24
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses
    assert sorted(result["checkpoints"]) == [8, 16, 24]

    record = JobStore().get(result["job_id"])
    assert record.data["state"] == "completed"
    assert all("eval_loss" in c for c in record.data["checkpoints"].values())

    model = result["model"]
    version = Tracker().model_version(model["model_name"], model["version"])
    for tag in LINEAGE_TAGS:
        assert version.tags.get(tag), f"model version lacks lineage tag {tag}"
    assert version.tags["trainforge.dataset_version"] == demo_data.version
    assert version.tags["trainforge.dataset_license"] == "PSF-2.0"
    assert "metric.eval_loss" in version.tags

    tensors = load_file(model["path"])  # safetensors alone, no torch, no pickle
    assert sum(t.size for t in tensors.values()) == model["parameters"] > 1_000_000
    _registered_model_loads_in_mlflow_and_transformers(model)

    run = Tracker().client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert len(Tracker().client.get_metric_history(run.info.run_id, "loss")) == 24
    assert "eval_loss" in run.data.metrics
    assert not any("secret" in k.lower() and v for k, v in run.data.params.items() if "name" not in k)
    _tensorboard_files_are_the_runs_metrics(record, run.info.run_id, losses)


def _tensorboard_files_are_the_runs_metrics(record, run_id: str, losses: list[float]) -> None:
    """The flow wrote TensorBoard files of the job's scalars, logged them to its run and named them in its report."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    board = record.folder / "tensorboard"
    acc = EventAccumulator(str(board), size_guidance={SCALARS: 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(1, 25))
    np.testing.assert_allclose([e.value for e in acc.Scalars("loss")], losses, rtol=1e-6)
    assert {"lr", "grad_norm", "tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert sorted(e.step for e in acc.Scalars("eval_loss")) == [8, 16, 24]
    logged = [a.path for a in Tracker().client.list_artifacts(run_id, "tensorboard")]
    assert [p.rsplit("/", 1)[-1] for p in logged] == sorted(f.name for f in board.iterdir())
    assert f"tensorboard --logdir {board}" in (record.folder / "report.html").read_text()


def _registered_model_loads_in_mlflow_and_transformers(model: dict) -> None:
    """The registered version is a real MLflow model (pyfunc through its alias, no pickle) and carries a Hugging
    Face folder that transformers loads with the same logits."""
    import mlflow.artifacts
    import mlflow.pyfunc

    uri = f"models:/{model['model_name']}@candidate"
    import os

    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    tracker_uri = Tracker().uri
    mlflow.set_tracking_uri(tracker_uri)  # what a user of the registry does (or MLFLOW_TRACKING_URI)
    mlflow.set_registry_uri(tracker_uri)
    try:
        _load_and_compare(uri, model, mlflow)
    finally:  # mlflow keeps the URIs in the environment too: put back what the session had
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _load_and_compare(uri: str, model: dict, mlflow) -> None:
    import json

    import torch
    from transformers import LlamaForCausalLM

    from trainforge.trainer.models.llama import build_model

    pyfunc = mlflow.pyfunc.load_model(uri)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int64)
    got = pyfunc.predict(tokens)
    meta = json.loads((Path(model["path"]).parent / "config.json").read_text())
    reference = build_model({**meta["model"], "max_seq_len": meta["seq_len"]})
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(model["path"]).items()})
    with torch.no_grad():
        expected = reference.eval()(torch.from_numpy(tokens))[:, -1, :].numpy()
    assert got.shape == (2, meta["model"]["vocab"]) and np.array_equal(got, expected)

    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    assert (folder / "MLmodel").is_file() and "loader_module: trainforge.trainer.mlflow_model" in (
        folder / "MLmodel").read_text()
    assert not list(folder.rglob("*.pkl")) and not list(folder.rglob("*.pt"))
    hf = LlamaForCausalLM.from_pretrained(folder / "hf").eval()
    with torch.no_grad():
        hf_logits = hf(torch.from_numpy(tokens)).logits[:, -1, :].numpy()
    # The same math in another implementation (attention kernels, op order): equal to float32 rounding.
    np.testing.assert_allclose(hf_logits, expected, rtol=0, atol=1e-4)


def test_killed_worker_resumes_exactly_from_last_committed_checkpoint(prefect_api, demo_data, monkeypatch,
                                                                        tmp_path):
    clean = run_flow(small_spec())

    # An uncommitted (manifest-less) checkpoint newer than the last committed one must be ignored on resume.
    job_id = "tiny-cpu-faulty"
    store_root = Path(JobStore().root.parent / "store")
    junk = store_root / "teams/demo/jobs" / job_id / "checkpoints/step-0000000020"
    junk.mkdir(parents=True)
    (junk / "__0_0.distcp").write_bytes(b"half-written garbage")
    monkeypatch.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=21")
    faulty = run_flow(small_spec(), job_id=job_id)

    assert faulty["state"] == "completed"
    record = JobStore().get(job_id)
    assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
    starts = [e for e in metrics(job_id) if e["type"] == "segment_start"]
    assert [s["resumed_from"] for s in starts] == [None, 16]

    a = load_file(clean["model"]["path"])
    b = load_file(faulty["model"]["path"])
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{name} differs after resume"
    # The per-step losses after the resume match the clean run's bit for bit too.
    clean_losses = {e["step"]: e["loss"] for e in metrics(clean["job_id"]) if e["type"] == "metrics"}
    resumed = [e for e in metrics(job_id) if e["type"] == "metrics"]
    for e in resumed:
        assert e["loss"] == clean_losses[e["step"]]


USER_MODEL = """
import torch
from trainforge.trainer.models.llama import build_model as reference


class Flaky(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > {fail_after}:
            raise ValueError("user bug: shapes do not line up in my_model.forward")
        return self.inner(x)


def build_model(config):
    return Flaky(reference(config))
"""


def test_user_error_is_reported_with_rank_and_log_and_not_retried(prefect_api, demo_data, tmp_path):
    (tmp_path / "my_model.py").write_text(textwrap.dedent(USER_MODEL.format(fail_after=5)))
    doc = small_spec()
    doc["code"] = {"entrypoint": "my_model:build_model", "repo": str(tmp_path)}
    doc["fault_tolerance"]["max_segment_retries"] = 3
    with pytest.raises(Exception) as info:
        run_flow(doc, job_id="tiny-cpu-userbug")
    message = str(info.value)
    assert "rank " in message and "user error" in message
    assert "user bug: shapes do not line up" in message
    assert "last lines of rank" in message and "my_model.py" in message
    record = JobStore().get("tiny-cpu-userbug")
    assert record.data["state"] == "failed"
    assert len(record.data["segments"]) == 1, "a user error must not be retried"


def test_entrypoint_that_does_not_import_fails_fast(prefect_api, demo_data, tmp_path):
    (tmp_path / "broken_model.py").write_text("import torch\nraise ImportError('no module named flash_attn_9')\n")
    doc = small_spec()
    doc["code"] = {"entrypoint": "broken_model:build_model", "repo": str(tmp_path)}
    with pytest.raises(Exception) as info:
        run_flow(doc, job_id="tiny-cpu-noimport")
    assert "cannot load entrypoint 'broken_model:build_model'" in str(info.value)
    assert "flash_attn_9" in str(info.value)
    assert len(JobStore().get("tiny-cpu-noimport").data["segments"]) == 1


def test_invalid_spec_starts_nothing_and_writes_nothing(prefect_api, demo_data, _isolated_home):
    from trainforge.tasks.prepare import JobRejected

    doc = small_spec()
    doc["parallelism"]["dp"] = 3  # 3 * 1 * 1 != 2 workers
    before = sorted(p.relative_to(_isolated_home) for p in _isolated_home.rglob("*"))
    with pytest.raises(JobRejected) as info:
        run_flow(doc)
    assert "parallelism" in str(info.value)
    after = sorted(p.relative_to(_isolated_home) for p in _isolated_home.rglob("*"))
    assert [p for p in after if p not in before and not str(p).startswith("datasets")] == []
    assert not (Path(_isolated_home) / "store").exists()
    jobs = Path(_isolated_home) / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir())
