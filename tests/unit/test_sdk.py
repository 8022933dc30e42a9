"""The SDK's pure parts and its light import: overrides (validated like the file, errors naming the key), the
per-rank log files of a job folder, `import trainforge` loading neither torch nor prefect, `__version__`, and a
Job read from a job folder written by hand (no flow, no workers).

Run: .venv/bin/python -m pytest tests/unit/test_sdk.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.specs.cases import EXAMPLES, build_demo_dataset
from trainforge.spec import SpecError


def test_import_trainforge_is_light_and_exports_lazily():
    code = ("import sys, trainforge; heavy = [m for m in ('torch', 'prefect', 'trainforge.sdk', 'mlflow') "
            "if m in sys.modules]; from trainforge import JobSpec, submit, get_job, __version__; "
            "print(heavy, 'torch' in sys.modules, 'prefect' in sys.modules, __version__, JobSpec.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]", "False", "False", _pyproject_version(), "JobSpec"], out.stdout


def _pyproject_version() -> str:
    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]


def test_unknown_attribute_is_an_attribute_error():
    import trainforge

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        trainforge.nope  # noqa: B018


def test_overrides_parse_values_as_yaml_and_create_nothing_in_place():
    from trainforge.sdk import apply_overrides, parse_overrides

    assert parse_overrides(["training.max_steps=20", "a.b=true", "c=[1, 2]", "d=x=y", "e="]) == [
        ("training.max_steps", 20), ("a.b", True), ("c", [1, 2]), ("d", "x=y"), ("e", "")]
    doc = {"training": {"max_steps": 60, "optimizer": {"lr": 0.1}}, "name": "n", "list": [{"k": 1}]}
    out = apply_overrides(doc, {"training.optimizer.lr": 0.5, "labels.x": "y", "list.0.k": 2})
    assert out["training"]["optimizer"]["lr"] == 0.5 and out["labels"] == {"x": "y"} and out["list"] == [{"k": 2}]
    assert doc["training"]["optimizer"]["lr"] == 0.1 and "labels" not in doc  # the caller's document is kept


@pytest.mark.parametrize(("override", "key", "says"), [
    ("oops", "oops", "KEY=VALUE"),
    ("name.x=1", "name.x", "not a mapping"),
    ("list.5=1", "list.5", "not an index"),
    ("a=[1", "a", "not valid YAML"),
])
def test_bad_overrides_name_the_key(override, key, says):
    from trainforge.sdk import apply_overrides

    with pytest.raises(SpecError) as info:
        apply_overrides({"name": "n", "list": [1]}, [override])
    (problem,) = info.value.problems
    assert problem.path == key and says in problem.message


def test_overridden_spec_is_validated_like_the_file():
    from trainforge.sdk import prepare

    build_demo_dataset()
    sub = prepare(EXAMPLES / "tiny-cpu.yaml", overrides=["training.max_steps=7"], job_id="j-1")
    assert sub.spec.training.max_steps == 7 and sub.job_id == "j-1" and sub.source == str(EXAMPLES / "tiny-cpu.yaml")
    assert sub.doc["training"]["max_steps"] == 7
    from_model = prepare(sub.spec, overrides={"training.max_steps": 5})  # a JobSpec is submitted as its document
    assert from_model.spec.training.max_steps == 5 and from_model.spec.name == "tiny-cpu"
    with pytest.raises(SpecError) as info:
        prepare(EXAMPLES / "tiny-cpu.yaml", overrides={"training.max_steps": "abc", "training.max_stepz": 3})
    assert {p.path for p in info.value.problems} == {"training.max_steps", "training.max_stepz"}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_rank_log_files_in_order_single_and_multi_node(tmp_path):
    from trainforge.sdk import rank_log_files

    for seg, attempts in ((0, (0, 1)), (1, (0,))):
        for attempt in attempts:
            for rank in (1, 0):
                for name in ("stderr.log", "stdout.log"):
                    _write(tmp_path / f"segment-{seg}" / "none_x" / f"attempt_{attempt}" / str(rank) / name,
                           f"s{seg} a{attempt} r{rank} {name}\n")
    for node in (1, 0):  # a one-agent-per-node segment: global rank = node * 2 + local
        for local in (0, 1):
            _write(tmp_path / "segment-2" / f"node-{node}" / "run_y" / "attempt_0" / str(local) / "stderr.log", "x")
    files = rank_log_files(tmp_path)
    named = [(r, str(p.relative_to(tmp_path))) for r, p in files]
    assert named[:4] == [(0, "segment-0/none_x/attempt_0/0/stdout.log"), (0, "segment-0/none_x/attempt_0/0/stderr.log"),
                         (1, "segment-0/none_x/attempt_0/1/stdout.log"), (1, "segment-0/none_x/attempt_0/1/stderr.log")]
    assert [r for r, p in files if "segment-2" in str(p)] == [0, 1, 2, 3]
    assert [str(p.relative_to(tmp_path)) for _, p in rank_log_files(tmp_path, rank=3)] == [
        "segment-2/node-1/run_y/attempt_0/1/stderr.log"]
    assert rank_log_files(tmp_path / "missing") == []


def fake_job(job_id: str = "tiny-20260101-000000-abcd", state: str = "completed", team: str = "demo",
             created: float | None = None) -> Path:
    """A job folder as the flow leaves it: job.json, two metrics events and a rank's logs."""
    from trainforge.registry.jobs import JobStore

    record = JobStore().create(job_id, name="tiny", team=team)
    record.update(state=state, **({"created_at": created} if created is not None else {}))
    events = [{"type": "metrics", "v": 1, "time": time.time(), "step": s, "loss": 5.0 - s, "tokens_per_s": 100.0}
              for s in (1, 2)]
    (record.folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for rank in (0, 1):
        _write(record.folder / "logs" / "segment-0" / "none_x" / "attempt_0" / str(rank) / "stdout.log",
               f"hello from {rank}\nbye from {rank}\n")
    return record.folder


def test_job_reads_state_metrics_and_logs_from_the_folder():
    from trainforge.sdk import JobNotFound, get_job

    fake_job()
    job = get_job("tiny-20260101-000000-abcd")
    assert job.status == "completed" and job.done and job.wait(timeout=1) == "completed"
    assert [(m.step, m.loss) for m in job.metrics()] == [(1, 4.0), (2, 3.0)]
    assert job.logs() == ("[rank 0] hello from 0\n[rank 0] bye from 0\n"
                          "[rank 1] hello from 1\n[rank 1] bye from 1\n")
    assert job.logs(rank=1) == "hello from 1\nbye from 1\n"
    assert list(job.follow_logs(rank=0)) == ["hello from 0\n", "bye from 0\n"]  # ended: what is there, then stop
    assert job.cancel() == "completed"  # an ended job keeps its state
    with pytest.raises(JobNotFound):
        get_job("no-such-job")


@pytest.mark.slow
def test_a_detached_job_whose_controller_died_is_failed(tmp_path):
    from trainforge.sdk import Job, detached_dir

    fake_job("dead-20260101-000000-abcd", state="running")
    folder = detached_dir("dead-20260101-000000-abcd")
    folder.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (folder / "process.json").write_text(json.dumps({"pid": proc.pid, "create_time": 1.0}))
    (folder / "controller.log").write_text("Traceback ...\nRuntimeError: boom\n")
    job = Job("dead-20260101-000000-abcd")
    assert job.status == "failed"
    (folder.parent / "early").mkdir()
    (folder.parent / "early" / "process.json").write_text(json.dumps({"pid": proc.pid, "create_time": 1.0}))
    (folder.parent / "early" / "controller.log").write_text("RuntimeError: no dataset\n")
    early = Job("early")  # died before the flow created the job's record
    assert early.status == "failed" and "no dataset" in (early.error or "")


def test_submit_refuses_an_unknown_backend_and_a_bad_spec(tmp_path):
    from trainforge import submit

    with pytest.raises(ValueError, match="backend='slurm'"):
        submit(EXAMPLES / "tiny-cpu.yaml", backend="slurm")  # type: ignore[arg-type]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x"}))
    with pytest.raises(SpecError):
        submit(bad)


def test_resume_runs_the_stored_document_overrides_included():
    from trainforge.registry.jobs import JobStore
    from trainforge.sdk import prepare

    build_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"]["max_steps"] = 7  # as `--set training.max_steps=7` left it
    JobStore().create("tiny-cpu-20260101-000000-beef", name="tiny-cpu", team="demo", spec=doc,
                      source=str(EXAMPLES / "tiny-cpu.yaml"))
    sub = prepare(None, resume="tiny-cpu-20260101-000000-beef")
    assert sub.resume and sub.job_id == "tiny-cpu-20260101-000000-beef" and sub.spec.training.max_steps == 7
    assert sub.base_dir == str(EXAMPLES)
