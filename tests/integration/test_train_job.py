"""The spine, end to end: the train-job Prefect flow with real torchrun workers (gloo), real checkpoints on disk,
a real MLflow store and model registry.

Covers: a job completes with falling loss, committed checkpoints and a registered model whose safetensors load
alone; a worker killed mid-run is retried from the last committed checkpoint and ends bit-identical to a clean
run, ignoring an uncommitted checkpoint folder; the killed-and-resumed job's HTML report (report.html in the job
folder and as the MLflow run's artifact) draws the replayed steps as their own line, lists the failure and the
recovery in its timeline, and its cost equals the cost model's; user-code failures are reported with rank and log
lines and not retried; an invalid spec starts nothing and writes nothing.

Registry + lineage through real flow runs: the train-job flow records the dataset version (license, files), the
job, every committed checkpoint and the model version as they happen; `trainforge promote JOB --step N` registers
an intermediate checkpoint with full metadata, alias and stage, protects it from retention and links the run's
logs and evaluation results; a second job fine-tuned from the first model (on another dataset) is found through
its ancestry; withdrawing the first dataset with --quarantine blocks promotion of both jobs' checkpoints; the
`lineage-query` Prefect flow answers the same question as the CLI.

Each real job is trained once per module and read by every test that checks it: `clean_run` (small_spec(),
uninterrupted: the registered job, the reference the resumed job must equal bit for bit, and the lineage test's
first job) and `resumed_run` (small_spec(), rank 1 killed at step 21: the resume and the report). Each trains in
a TRAINFORGE_HOME of its own (tests/conftest.py's per-test home is function-scoped); a test reads a job through
its home (the `clean_job` / `resumed_job` fixtures point TRAINFORGE_HOME there). Only the lineage test writes to
`clean_run`'s home (a promotion, a retention pass, a fine-tuned job, a withdrawal), none of which changes what
the other readers of that job check: the same model version under `candidate`, its files, events and run.

Run: .venv/bin/python -m pytest tests/integration/test_train_job.py   (about 3-4 minutes on 2 cores)
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from tests.fixtures.suite import make_test_home
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


@dataclass(frozen=True)
class TrainedJob:
    """A job a module-scoped fixture trained once, in a TRAINFORGE_HOME of its own."""

    home: Path
    result: dict  # what the train-job flow returned
    dataset: Any  # the demo dataset as ensure_demo_dataset() resolved it in `home`, before the job ran

    def events(self) -> list[dict]:
        """The job's events, read through its own home (whatever TRAINFORGE_HOME the reading test has)."""
        events, _ = read_events(JobStore(self.home / "jobs").get(self.result["job_id"]).events_path)
        return events


@contextlib.contextmanager
def _job_home(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[pytest.MonkeyPatch, Path]]:
    """What tests/conftest.py's `_isolated_home` gives a test, for a module-scoped job (the same helper)."""
    with pytest.MonkeyPatch.context() as mp, make_test_home(tmp_path_factory, mp, name, tracking=True) as home:
        yield mp, home


@pytest.fixture(scope="module")
def clean_run(prefect_api, tmp_path_factory) -> TrainedJob:
    """small_spec(), trained once without a fault."""
    with _job_home(tmp_path_factory, "clean-run") as (_, home):
        dataset = ensure_demo_dataset()
        return TrainedJob(home, run_flow(small_spec()), dataset)


RESUMED_JOB_ID = "tiny-cpu-faulty"


@pytest.fixture(scope="module")
def resumed_run(prefect_api, tmp_path_factory) -> TrainedJob:
    """small_spec() again, its rank 1 killed at step 21, with an uncommitted (manifest-less) checkpoint folder
    newer than the last committed one in its store, which the resume must ignore. A home of its own: its model
    registers under the same name as `clean_run`'s and would take the `candidate` alias off it."""
    with _job_home(tmp_path_factory, "resumed-run") as (mp, home):
        dataset = ensure_demo_dataset()
        store_root = Path(JobStore().root.parent / "store")
        junk = store_root / "teams/demo/jobs" / RESUMED_JOB_ID / "checkpoints/step-0000000020"
        junk.mkdir(parents=True)
        (junk / "__0_0.distcp").write_bytes(b"half-written garbage")
        # durable=1: the kill comes once the checkpoint of step 16 is committed, however slowly a loaded host
        # uploads it (without it, a save still in flight at step 21 dies with rank 1 and the resume rightly falls
        # back to step 8: trainer/faults.py)
        mp.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=21:durable=1")
        return TrainedJob(home, run_flow(small_spec(), job_id=RESUMED_JOB_ID), dataset)


@pytest.fixture
def clean_job(clean_run, _isolated_home, monkeypatch) -> TrainedJob:
    """`clean_run`, with this test's TRAINFORGE_HOME pointed at its home."""
    monkeypatch.setenv("TRAINFORGE_HOME", str(clean_run.home))
    return clean_run


@pytest.fixture
def resumed_job(resumed_run, _isolated_home, monkeypatch) -> TrainedJob:
    """`resumed_run`, with this test's TRAINFORGE_HOME pointed at its home."""
    monkeypatch.setenv("TRAINFORGE_HOME", str(resumed_run.home))
    return resumed_run


def test_job_trains_commits_evaluates_and_registers(clean_job):
    result = clean_job.result
    demo_data = clean_job.dataset
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


def test_killed_worker_resumes_exactly_from_last_committed_checkpoint(clean_run, resumed_job):
    # The kill, and the uncommitted step-20 folder the resume must ignore: the `resumed_run` fixture.
    clean, faulty = clean_run.result, resumed_job.result
    job_id = faulty["job_id"]
    # Two homes, one dataset: the bit-for-bit comparison below is of the same data.
    assert resumed_job.dataset.version == clean_run.dataset.version

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
    clean_losses = {e["step"]: e["loss"] for e in clean_run.events() if e["type"] == "metrics"}
    resumed = [e for e in metrics(job_id) if e["type"] == "metrics"]
    for e in resumed:
        assert e["loss"] == clean_losses[e["step"]]


def test_report_of_a_job_that_failed_and_recovered(resumed_job, tmp_path):
    """The flow wrote report.html into the job folder and logged it as the MLflow run's artifact: the replayed
    steps as their own line, the failure and the recovery in its timeline, its cost the cost model's."""
    from trainforge.events import typed
    from trainforge.infra.cost import job_cost

    result = resumed_job.result
    assert result["state"] == "completed"
    record = JobStore().get(result["job_id"])
    assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
    page = (record.folder / "report.html").read_text()

    # The artifact in MLflow is the same page.
    tracker = Tracker()
    assert "report.html" in tracker.list_artifacts(result["mlflow_run_id"])
    local = tracker.client.download_artifacts(result["mlflow_run_id"], "report.html", str(tmp_path))
    with open(local) as f:
        assert f.read() == page

    events, _ = read_events(record.events_path)
    runs: list[list[int]] = []  # metrics steps per launch of the gang, as the report splits them
    for e in events:
        if e["type"] == "segment_start":
            runs.append([])
            resumed = e["resumed_from"]  # the last committed checkpoint, or None when none was before the kill
        elif e["type"] == "metrics":
            runs[-1].append(e["step"])
    assert len(runs) == 2 and runs[1][0] == (resumed or 0) + 1 and runs[1][0] <= runs[0][-1]  # steps replayed
    for i, steps in enumerate(runs):  # each launch is its own line, with one vertex per step it ran
        path = re.search(rf'<g id="loss-train-{i}">\s*<path d="([^"]+)"', page)
        assert path and len(re.findall(r"[ML]", path.group(1))) == len(steps)
    if resumed:
        assert f"resumed from committed checkpoint {resumed}" in page
    for text in ("segment #0 failed", "fault: ", "recovered (segment retry)",
                 "id='chart-mfu'><svg", 'id="checkpoint-table"', "id='job-state'>completed<"):
        assert text in page, text
    cost = job_cost(record.data, typed(events))
    assert cost.lost_hours > 0  # the replayed steps
    assert f"<td>lost</td><td>{cost.lost_hours:.4f}</td>" in page
    assert f"<td>GPU-hours (allocated)</td><td>{cost.gpu_hours:.4f}</td>" in page


def cli(*args: str) -> dict:
    from typer.testing import CliRunner

    from trainforge.cli import app

    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def ids(rows: list[dict]) -> set[str]:
    return {r["id"] for r in rows}


def test_lineage_promotion_fine_tune_withdrawal(clean_job):
    from typer.testing import CliRunner

    from trainforge.cli import app
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.demo import tiny_dataset
    from trainforge.registry.lineage import LineageStore
    from trainforge.registry.manifest import list_committed
    from trainforge.spec import JobSpec

    demo = clean_job.dataset
    first = clean_job.result
    job_a, model_a = first["job_id"], first["model"]
    store = LineageStore()

    # --- written by the flow as it ran
    a_ckpts = {f"checkpoint:{job_a}@{s}" for s in first["checkpoints"]}
    name_a, version_a = model_a["model_name"], model_a["version"]
    deps = cli("lineage", "datasets-of", f"models:/{name_a}/{version_a}")["datasets"]
    assert [(d["name"], d["version"], d["license"], d["license_class"]) for d in deps] == [
        ("demo-text", demo.version, "PSF-2.0", "permissive")]
    assert deps[0]["attrs"]["provenance"]["source"] == "python-stdlib"
    affected = cli("lineage", "trained-on", f"demo-text@{demo.version[:12]}")["affected"]
    assert a_ckpts | {f"model:{name_a}/{version_a}"} <= ids(affected)
    shard = f"{demo.path}/shard-00000.arrow"
    assert ids(cli("lineage", "trained-on", "--file", shard)["affected"]) == ids(affected)

    # --- promote an intermediate checkpoint: metadata, alias, stage, protection, run artifacts
    promoted = cli("promote", job_a, "--step", "8", "--alias", "champion", "--stage", "Staging")
    tracker = Tracker()
    version = tracker.model_version(promoted["model_name"], promoted["version"])
    assert version.current_stage == "Staging" and version.tags["trainforge.step"] == "8"
    assert version.tags["trainforge.parent_checkpoint"].endswith("step-0000000008")
    assert version.tags["trainforge.dataset_license"] == "PSF-2.0" and "metric.eval_loss" in version.tags
    assert tracker.aliases(promoted["model_name"]) == {"champion": promoted["version"], "candidate": version_a}
    record = JobStore().get(job_a)
    assert 8 in record.data["protected_steps"]
    assert record.data["iam"]["policy"]["Statement"][0]["Resource"][0].endswith(f"/jobs/{job_a}/*")
    artifacts = tracker.list_artifacts(record.data["mlflow_run_id"])
    assert {"logs", "evaluation", "model", "models"} <= set(artifacts)
    assert "evaluation/results.json" in tracker.list_artifacts(record.data["mlflow_run_id"], "evaluation")
    # protected from GC: a retention pass that keeps only the newest leaves step 8 in place
    from trainforge.tasks.checkpoints import apply_retention, job_store

    config = json.loads((record.folder / "worker-config.json").read_text())
    spec = JobSpec.model_validate({**record.data["spec"], "checkpoint": {
        **record.data["spec"]["checkpoint"], "keep_last": 1, "keep_best": None}})
    apply_retention(spec, config, record.data["protected_steps"])
    assert {r.step for r in list_committed(job_store(config), config["storage_prefix"])} >= {8, 24}
    bad = CliRunner().invoke(app, ["promote", job_a, "--step", "9"])
    assert bad.exit_code == 1 and "no committed checkpoint at step 9" in bad.output

    # --- a job fine-tuned from model A, on another dataset (CC0)
    other = tiny_dataset(EmbeddedCatalog(), "rand-cc0", num_samples=256, sample_len=65, seed=3)
    doc = small_spec(max_steps=8)
    doc.update(name="tiny-ft", init_from=f"models:/{name_a}/{version_a}")
    doc["dataset"] = {**doc["dataset"], "ref": "catalog://rand-cc0@main", "license": "CC0-1.0"}
    second = run_flow(doc)
    name_b, version_b = second["model"]["model_name"], second["model"]["version"]
    # the workers started from model A's weights: the registered safetensors, byte for byte
    config_b = json.loads((JobStore().get(second["job_id"]).folder / "worker-config.json").read_text())
    init = Path(config_b["init_weights"])
    assert init.read_bytes() == Path(first["model"]["path"]).read_bytes()
    deps_b = {(d["name"], d["license_class"]) for d in
              cli("lineage", "datasets-of", f"{name_b}/{version_b}")["datasets"]}
    assert deps_b == {("demo-text", "permissive"), ("rand-cc0", "public-domain")}
    assert f"model:{name_b}/{version_b}" in ids(cli("lineage", "trained-on", "demo-text")["affected"])
    assert f"model:{name_b}/{version_b}" not in ids(
        cli("lineage", "trained-on", f"rand-cc0@{other.version}")["affected"]) - {f"model:{name_b}/{version_b}"}
    assert {j["name"] for j in cli("lineage", "license", "public-domain")["jobs"]} == {second["job_id"]}

    # --- the legal team's flow gives the CLI's answer
    from trainforge.flows.lineage_query import lineage_query

    by_flow = lineage_query(query="trained-on", dataset="demo-text")
    assert ids(by_flow["affected"]) == ids(cli("lineage", "trained-on", "demo-text")["affected"])

    # --- withdrawal + quarantine: both jobs' checkpoints and models are blocked, with who and why
    out = cli("lineage", "withdraw", f"demo-text@{demo.version}", "--why", "takedown request 7", "--quarantine",
              "--who", "legal@example")
    assert {r["status"] for r in out["affected"]} == {"quarantined"}
    refused = CliRunner().invoke(app, ["promote", second["job_id"], "--step", "8"])
    assert refused.exit_code == 1 and "takedown request 7" in refused.output, refused.output
    refused = CliRunner().invoke(app, ["model", "alias", name_a, version_a, "champion"])
    assert refused.exit_code == 1 and "quarantined" in refused.output
    assert store.history(f"model:{name_b}/{version_b}")[-1]["who"] == "legal@example"
    # a new job may not start from a quarantined parent
    with pytest.raises(Exception, match="quarantined"):
        run_flow({**doc, "name": "tiny-ft2"})


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
    # Each file with its size and modification time: a file already in the home (the suite seeds a migrated
    # mlflow.db) that the rejected job wrote to counts as written.
    def files() -> dict[Path, tuple[int, int]]:
        return {p.relative_to(_isolated_home): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in _isolated_home.rglob("*") if p.is_file()} | {
                p.relative_to(_isolated_home): (0, 0) for p in _isolated_home.rglob("*") if p.is_dir()}

    before = files()
    with pytest.raises(JobRejected) as info:
        run_flow(doc)
    assert "parallelism" in str(info.value)
    after = files()
    assert [p for p, seen in after.items() if before.get(p) != seen and not str(p).startswith("datasets")] == []
    assert not (Path(_isolated_home) / "store").exists()
    jobs = Path(_isolated_home) / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir())
