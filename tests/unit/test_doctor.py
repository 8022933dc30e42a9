"""`trainforge doctor`: the embedded defaults pass; a setting that points at a dead server, and a stack whose
servers are gone, are each reported with a fix, and exit 1. No server is started (fast).

Run: .venv/bin/python -m pytest tests/unit/test_doctor.py -q
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.infra.backends.local import free_port
from trainforge.infra.servers import COMPONENTS, ServerStack

runner = CliRunner()


def _doctor(*args: str):
    result = runner.invoke(app, ["doctor", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_embedded_defaults_are_healthy(monkeypatch):
    for var in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "TRAINFORGE_STORAGE_URL", "TRAINFORGE_LINEAGE_URL",
                "TRAINFORGE_SCHEDULER_URL"):
        monkeypatch.delenv(var, raising=False)
    code, report = _doctor()
    assert code == 0 and report["mode"] == "embedded" and report["ok"]
    assert {"home", "storage", "mlflow", "prefect"} <= {c["name"] for c in report["checks"]}


def test_a_dead_server_in_the_settings_is_reported_with_a_fix(monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("PREFECT_API_URL", f"{dead}/api")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    code, report = _doctor()
    assert code == 1 and not report["ok"]
    bad = {c["name"]: c for c in report["checks"] if not c["ok"]}
    assert set(bad) == {"prefect", "mlflow"}
    assert "unset PREFECT_API_URL" in bad["prefect"]["fix"] and "servers up" in bad["mlflow"]["fix"]


def test_a_stack_whose_servers_died_is_reported_per_server(tmp_path):
    stack = ServerStack(tmp_path / "stack")
    dead_pid = 2 ** 22 + 7  # above the default pid_max: never a live process
    port = free_port()
    state = {"started_at": 0.0,
             "postgres": {"pid": dead_pid, "port": port, "dir": str(tmp_path), "bin": "/bin", "log": "pg.log"},
             "seaweedfs": {"pid": dead_pid, "endpoint": f"http://127.0.0.1:{port}", "access_key": "a",
                           "secret_key": "b", "log": "weed.log"},
             "mlflow": {"pid": dead_pid, "url": f"http://127.0.0.1:{port}", "log": "mlflow.log"},
             "prefect": {"pid": dead_pid, "url": f"http://127.0.0.1:{port}", "log": "prefect.log"},
             "worker": {"pid": dead_pid, "pool": "trainforge", "log": "worker.log"}}
    stack._save(state)
    code, report = _doctor("--root", str(stack.root))
    assert code == 1 and report["mode"] == "stack"
    bad = {c["name"]: c for c in report["checks"] if not c["ok"]}
    assert set(COMPONENTS) <= set(bad) and "env file" in bad
    assert "worker.log" in bad["worker"]["fix"] and "servers up" in bad["worker"]["fix"]
    assert "process gone" in bad["postgres"]["detail"]


def test_a_stopped_stack_falls_back_to_the_embedded_checks(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    stack = ServerStack(tmp_path / "stack")
    stack._save({"started_at": 0.0, **{name: {"pid": None} for name in COMPONENTS}})
    code, report = _doctor("--root", str(stack.root))
    assert report["mode"] == "embedded" and code == 0
