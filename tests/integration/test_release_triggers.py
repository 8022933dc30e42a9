"""A dataset release triggers the training jobs subscribed to it, through a real Prefect automation.

Against the session's real Prefect server: prefect.yaml's deployments are registered with `prefect deploy --all`,
its `dataset_triggers` installed with `trainforge automations install`; releasing `demo-text` to a side branch
triggers nothing, releasing it to `main` makes the server's automation create a `train-job` flow run whose spec is
pinned to exactly the released version. `trainforge doctor`'s Prefect checks see the deployments and the
automation, and report it missing (with the fix) once removed. No worker runs: the flow run stays scheduled.

Run: .venv/bin/python -m pytest tests/integration/test_release_triggers.py -q   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from trainforge.cli import app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
runner = CliRunner()


def _api_url() -> str:
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    assert url, "the prefect_api fixture should have set an API URL"
    return str(url)


@pytest.fixture(scope="module")
def deployed(prefect_api) -> str:
    """prefect.yaml's deployments registered on the session's server (from this checkout)."""
    api = _api_url()
    env = {**os.environ, "PREFECT_API_URL": api, "TRAINFORGE_REPO": str(REPO)}
    pool = subprocess.run([str(BIN / "prefect"), "work-pool", "create", "trainforge", "--type", "process",
                           "--overwrite"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert pool.returncode == 0, pool.stdout[-2000:] + pool.stderr[-2000:]
    deploy = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=240)
    assert deploy.returncode == 0, deploy.stdout[-2000:] + deploy.stderr[-2000:]
    return api


def _corpus(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    words = ["data", "model", "token", "shard", "cache", "graph", "loss", "step", "batch", "rank"]
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 12))}) + "\n" for _ in range(300)))
    return path


def _train_job_runs(deployment_id: Any) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))


def test_release_to_main_runs_the_subscribed_training_job(deployed, tmp_path):
    from prefect.client.orchestration import get_client

    from trainforge.commands.production import prefect_object_checks
    from trainforge.flows.dataset_release import dataset_release

    installed = runner.invoke(app, ["automations", "install", "--api", deployed, "--json"])
    assert installed.exit_code == 0, installed.output
    rows = json.loads(installed.stdout)
    assert [(r["spec"], r["dataset"], r["branch"]) for r in rows] == [("examples/tiny-cpu.yaml", "demo-text", "main")]
    again = runner.invoke(app, ["automations", "install", "--api", deployed, "--json"])  # idempotent: replaced
    assert again.exit_code == 0 and len(json.loads(again.stdout)) == 1
    listed = runner.invoke(app, ["automations", "list", "--api", deployed, "--json"])
    assert [a["name"] for a in json.loads(listed.stdout)] == [rows[0]["name"]]

    with get_client(sync_client=True) as client:
        train_job = client.read_deployment_by_name("train-job/train-job")
    before = {r.id for r in _train_job_runs(train_job.id)}
    try:
        # A release to another branch matches no subscription.
        side = dataset_release(name="demo-text", source=str(_corpus(tmp_path / "a.jsonl", 1)), license="PSF-2.0",
                               branch="staging", seq_len=31, num_workers=1)
        out = dataset_release(name="demo-text", source=str(_corpus(tmp_path / "b.jsonl", 2)), license="PSF-2.0",
                              tag="r2", seq_len=31, num_workers=1)
        assert out["version"] != side["version"]
        released = time.monotonic()
        deadline = released + 90  # the triggers service reacts within seconds; bounded
        new: list[Any] = []
        while time.monotonic() < deadline and not new:
            new = [r for r in _train_job_runs(train_job.id) if r.id not in before]
            time.sleep(0.5)
        assert new, "no train-job flow run was created by the automation within 90 s"
        print(f"\nrelease flow returned -> train-job flow run seen: {time.monotonic() - released:.1f} s")
        time.sleep(3)  # a (wrong) run for the staging release would have been created before the main one's
        new = [r for r in _train_job_runs(train_job.id) if r.id not in before]
        assert len(new) == 1, [r.parameters["spec"]["dataset"]["ref"] for r in new]
        params = new[0].parameters
        assert params["spec"]["dataset"]["ref"] == f"catalog://demo-text@{out['version']}"
        assert params["spec"]["name"] == "tiny-cpu"
        assert params["source"] == "examples/tiny-cpu.yaml" and params["base_dir"] == "examples"
        from trainforge.datasets.refs import resolve_reference

        assert resolve_reference(params["spec"]["dataset"]["ref"]).version == out["version"]  # resolvable as pinned

        checks = {c["name"]: c for c in prefect_object_checks(deployed)}
        assert checks["deployments"]["ok"] and "4/4" in checks["deployments"]["detail"]
        assert checks["automations"]["ok"] and not checks["automations"]["warn"], checks["automations"]
    finally:
        with get_client(sync_client=True) as client:  # the session's server is shared: leave no scheduled run
            for r in _train_job_runs(train_job.id):
                if r.id not in before:
                    client.delete_flow_run(r.id)
        removed = runner.invoke(app, ["automations", "remove", "--api", deployed])
        assert removed.exit_code == 0, removed.output

    checks = {c["name"]: c for c in prefect_object_checks(deployed)}
    assert not checks["automations"]["ok"] and "missing" in checks["automations"]["detail"]
    assert "trainforge automations install" in checks["automations"]["fix"]


def test_up_and_down_are_top_level_commands():
    for cmd in ("up", "down", "doctor"):
        result = runner.invoke(app, [cmd, "--help"])
        assert result.exit_code == 0 and "--root" in result.output, (cmd, result.output)


def test_bad_subscriptions_are_refused_with_the_entry_named(tmp_path):
    config = tmp_path / "prefect.yaml"
    config.write_text("dataset_triggers:\n  - spec: nope.yaml\n")
    result = runner.invoke(app, ["automations", "install", "--config", str(config), "--api", "http://127.0.0.1:9/api"])
    assert result.exit_code == 1 and "dataset_triggers[0]" in result.output and "does not exist" in result.output
    spec = tmp_path / "job.yaml"
    doc = (REPO / "examples" / "tiny-cpu.yaml").read_text().replace("catalog://demo-text@main", "file://data/v1")
    spec.write_text(doc)
    config.write_text("dataset_triggers:\n  - spec: job.yaml\n")
    result = runner.invoke(app, ["automations", "install", "--config", str(config), "--api", "http://127.0.0.1:9/api"])
    assert result.exit_code == 1 and "not a catalog:// dataset" in result.output, result.output
