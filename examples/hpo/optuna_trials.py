"""Hyper-parameter search with Optuna, each trial a separate trainforge job.

Optuna proposes a learning rate and a warm-up length. Each trial submits the base job spec (the tiny CPU demo)
with the SDK, the trial's values as overrides (`trainforge.submit(SPEC, overrides={...})`, what `trainforge submit
SPEC --set KEY=VALUE` does): its own job, validated, planned, scheduled, checkpointed and tracked in MLflow like any
other. It then reads the trial's objective back through the metrics API, `trainforge.registry.tracking.job_metric`:
by default the best (min) `eval_loss` of that job's MLflow run. A job that fails is a failed trial, and the search
goes on. Each trial's job id and MLflow run id are kept as the trial's user attributes, so `trainforge compare JOB
JOB...` and `trainforge report JOB` work on the trials afterwards.

Run it from the repository root (the demo dataset is built on first use):

    .venv/bin/python examples/hpo/optuna_trials.py --trials 4 --steps 20

Each tiny trial takes about a minute on a 2-core machine. Optuna's study lives in memory unless you give
`--storage sqlite:///hpo.db` (then `--study-name` resumes it). Each trial's job runs in a background process
(`detach=True`), so a trial past `--trial-timeout` is cancelled (`job.cancel()`) and the search goes on. Point
PREFECT_API_URL at a running Prefect server (`trainforge up`) so that the trials do not each start Prefect's
temporary one. An orchestrator on another host reads the same numbers with MLFLOW_TRACKING_URI set and
`trainforge metric JOB eval_loss --mode min --json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import optuna

from trainforge import submit
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.registry.tracking import job_metric

REPO = Path(__file__).resolve().parents[2]


class TrialJobFailed(RuntimeError):
    """The trial's trainforge job failed: Optuna records the trial as failed and goes on."""


def trial_overrides(trial: optuna.Trial, study: str, steps: int) -> dict[str, Any]:
    """The trial's changes to the base spec, by dotted key (validated with the spec, like `--set`)."""
    return {
        "name": f"{study}-t{trial.number}"[:63].strip("-"),
        "labels.hpo-study": study,
        "labels.hpo-trial": str(trial.number),
        "training.max_steps": steps,
        "training.optimizer.lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
        "training.lr_schedule.warmup_steps": trial.suggest_int("warmup_steps", 0, max(1, steps // 4)),
        "checkpoint.interval_steps": max(1, steps // 2),  # eval_loss at half-way and at the end
    }


def run_trial(spec: Path, overrides: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Submit one job with the SDK and wait for it; its result (job id, state, MLflow run)."""
    job = submit(spec, overrides=overrides, detach=True)
    try:
        state = job.wait(timeout=timeout_s)
    except TimeoutError:
        job.cancel()
        raise TrialJobFailed(f"job {job.id} did not finish in {timeout_s:.0f} s: cancelled") from None
    if state != "completed":
        raise TrialJobFailed(f"job {job.id} {state}: {(job.error or '')[-800:]}")
    return job.result


def main(argv: list[str] | None = None) -> optuna.Study:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="Training steps per trial.")
    ap.add_argument("--spec", type=Path, default=REPO / "examples" / "tiny-cpu.yaml", help="Base job spec.")
    ap.add_argument("--metric", default="eval_loss", help="The objective: a metric the jobs log to MLflow.")
    ap.add_argument("--mode", choices=("min", "max", "latest"), default="min",
                    help="Which value of the metric a trial reports (min/max over the run, or the latest).")
    ap.add_argument("--direction", choices=("minimize", "maximize"), default="minimize")
    ap.add_argument("--study-name", default="hpo-tiny")
    ap.add_argument("--storage", default=None, help="Optuna storage URL (default: in memory).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trial-timeout", type=float, default=1800.0, help="Seconds before a trial's job is abandoned.")
    args = ap.parse_args(argv)

    ensure_demo_dataset()  # the catalog://demo-text dataset of the tiny spec; built once, shared by the trials

    def objective(trial: optuna.Trial) -> float:
        result = run_trial(args.spec, trial_overrides(trial, args.study_name, args.steps), args.trial_timeout)
        trial.set_user_attr("job_id", result["job_id"])
        trial.set_user_attr("mlflow_run_id", result["mlflow_run_id"])
        value = job_metric(result["job_id"], args.metric, args.mode)  # read back from MLflow
        trial.set_user_attr("step", value.step)
        print(f"trial {trial.number}: lr={trial.params['lr']:.2e} warmup={trial.params['warmup_steps']} -> "
              f"{args.metric} ({args.mode}) {value.value:.4f} at step {value.step} [job {value.job_id}]",
              flush=True)
        return value.value

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=args.study_name, storage=args.storage, direction=args.direction,
                                sampler=optuna.samplers.TPESampler(seed=args.seed), load_if_exists=True)
    study.optimize(objective, n_trials=args.trials, catch=(TrialJobFailed,))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    failed = len(study.trials) - len(done)
    if not done:
        print(f"no trial completed ({failed} failed)", file=sys.stderr)
        raise SystemExit(1)
    best = study.best_trial
    print(f"best trial {best.number}: {args.metric}={best.value:.4f} with {best.params} "
          f"(job {best.user_attrs['job_id']}); {len(done)} completed, {failed} failed")
    print(f"compare them: trainforge compare {' '.join(t.user_attrs['job_id'] for t in done)}")
    return study


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    main()
