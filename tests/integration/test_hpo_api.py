"""The metrics API of HPO drivers on a real finished run: examples/hpo/optuna_trials.py runs one Optuna trial as
a trainforge job (submitted with the SDK, detached: its own process) and reads the objective through
`job_metric`; the API's latest/min/max values equal what the job's workers reported, it finds the run from the
MLflow tag alone (a driver on another host), and `trainforge metric` prints the same. One trial, not two: each
tiny trial costs about a minute here.

Run: .venv/bin/python -m pytest tests/integration/test_hpo_api.py -q
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from trainforge.registry.jobs import JobStore
from trainforge.registry.tracking import job_metric, run_id_for_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hpo" / "optuna_trials.py"


def load_example():
    spec = importlib.util.spec_from_file_location("optuna_trials", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_optuna_trial_reads_its_objective_through_the_metrics_api(prefect_api, monkeypatch, tmp_path, capsys):
    from prefect.settings import PREFECT_API_URL
    from typer.testing import CliRunner

    from trainforge.cli import app
    from trainforge.events import read_events

    monkeypatch.setenv("PREFECT_API_URL", PREFECT_API_URL.value())  # the trial's process uses this test's server
    study = load_example().main(["--trials", "1", "--steps", "4", "--study-name", "hpo-test"])
    trial = study.best_trial
    job_id = trial.user_attrs["job_id"]
    assert job_id.startswith("hpo-test-t0-")
    record = JobStore().get(job_id)
    assert record.data["state"] == "completed"
    assert record.data["spec"]["training"]["optimizer"]["lr"] == trial.params["lr"]
    assert "trial 0: lr=" in capsys.readouterr().out

    # The objective is the best eval loss the flow recorded for the job's checkpoints (steps 2 and 4).
    evals = {int(s): c["eval_loss"] for s, c in record.data["checkpoints"].items()}
    assert set(evals) == {2, 4}
    assert trial.value == pytest.approx(min(evals.values()), rel=1e-12)
    best = job_metric(job_id, "eval_loss", "min")
    assert (best.step, best.value) == (min(evals, key=evals.get), trial.value)
    assert best.run_status == "FINISHED" and best.run_id == record.data["mlflow_run_id"]
    worst = job_metric(job_id, "eval_loss", "max")
    assert worst.value == max(evals.values())

    events, _ = read_events(record.events_path)
    steps = [e for e in events if e["type"] == "metrics"]
    latest = job_metric(job_id, "loss")
    assert (latest.step, latest.value) == (4, steps[-1]["loss"])
    assert job_metric(job_id, "loss", "min").value == min(e["loss"] for e in steps)

    with pytest.raises(LookupError, match="has no metric 'accuracy'; it has: .*eval_loss"):
        job_metric(job_id, "accuracy")
    with pytest.raises(ValueError, match="use one of latest, min, max"):
        job_metric(job_id, "loss", "best")

    out = CliRunner().invoke(app, ["metric", job_id, "eval_loss", "--mode", "min", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["value"] == trial.value

    # A driver on another host has no job record: the run is found by its trainforge.job_id tag in MLflow.
    other_home = tmp_path / "elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{JobStore().root.parent / 'mlflow.db'}")
    monkeypatch.setenv("TRAINFORGE_HOME", str(other_home))
    assert run_id_for_job(job_id) == record.data["mlflow_run_id"]
    assert job_metric(job_id, "eval_loss", "min").value == trial.value
    with pytest.raises(LookupError, match="no MLflow run for job 'hpo-test-t9'"):
        run_id_for_job("hpo-test-t9")
