"""The day-2 job commands as a user runs them, on job folders written by hand (no flow, no workers): `status`
filters and whole ids, `logs`, `cancel` of an ended job, `submit --set` errors naming the key (also as JSON),
`--version`, and the exit statuses defined in commands/common.py.

Run: .venv/bin/python -m pytest tests/unit/test_cli_jobs.py -q
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from tests.specs.cases import EXAMPLES, build_demo_dataset
from tests.unit.test_sdk import fake_job
from trainforge.cli import app
from trainforge.commands.common import EXIT_CANCELLED, EXIT_INVALID, EXIT_JOB_FAILED, EXIT_UNREADABLE

runner = CliRunner()


def run(*args: str, columns: int = 80):
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result, output


def test_exit_statuses_are_distinct():
    assert len({0, EXIT_INVALID, EXIT_UNREADABLE, EXIT_JOB_FAILED, EXIT_CANCELLED}) == 5


def test_version():
    import trainforge

    result, out = run("--version")
    assert result.exit_code == 0 and out.strip() == f"trainforge {trainforge.__version__}"


def test_status_filters_and_prints_whole_ids_at_80_columns():
    long_id = "a-rather-long-job-name-for-the-nlp-team-20260101-000000-abcd"
    fake_job(long_id, team="nlp", state="failed", created=3.0)
    fake_job("tiny-20260101-000000-0001", team="demo", state="completed", created=1.0)
    fake_job("tiny-20260101-000000-0002", team="demo", state="running", created=2.0)
    result, out = run("status")
    assert result.exit_code == 0 and long_id in out and "tiny-20260101-000000-0001" in out
    _, out = run("status", "--team", "demo", "--json")
    assert [r["job_id"] for r in json.loads(out)] == ["tiny-20260101-000000-0001", "tiny-20260101-000000-0002"]
    _, out = run("status", "--state", "failed", "--json")
    assert [r["job_id"] for r in json.loads(out)] == [long_id]
    _, out = run("status", "--limit", "1", "--json")
    assert [(r["job_id"], r["step"], r["loss"]) for r in json.loads(out)] == [(long_id, 2, 3.0)]
    result, out = run("status", "--state", "lost")
    assert result.exit_code == 2 and "completed" in out  # the choices are listed
    result, out = run("status", "no-such-job", "--json")
    assert result.exit_code == EXIT_INVALID and "no job 'no-such-job'" in json.loads(result.stdout)["error"]


def test_logs_and_cancel_of_an_ended_job():
    fake_job()
    result, out = run("logs", "tiny-20260101-000000-abcd")
    assert result.exit_code == 0 and "[rank 0] hello from 0" in out and "[rank 1] bye from 1" in out
    result, out = run("logs", "tiny-20260101-000000-abcd", "--rank", "1", "-f")
    assert result.exit_code == 0 and out == "hello from 1\nbye from 1\n"
    result, _ = run("logs", "tiny-20260101-000000-abcd", "--rank", "0", "--json")
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        {"job_id": "tiny-20260101-000000-abcd", "rank": 0, "line": "hello from 0"},
        {"job_id": "tiny-20260101-000000-abcd", "rank": 0, "line": "bye from 0"}]
    result, out = run("cancel", "tiny-20260101-000000-abcd")
    assert result.exit_code == 0 and "already ended: completed" in out
    result, out = run("cancel", "nope")
    assert result.exit_code == EXIT_INVALID and "no job 'nope'" in out


def test_submit_set_is_validated_like_the_file():
    build_demo_dataset()
    result, out = run("submit", EXAMPLES / "tiny-cpu.yaml", "--set", "training.max_steps=abc",
                      "--set", "training.max_stepz=3")
    assert result.exit_code == EXIT_INVALID
    assert "training.max_steps: must be a whole number" in out and "training.max_stepz: unknown field" in out
    result, _ = run("submit", EXAMPLES / "tiny-cpu.yaml", "--set", "name.x=1", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == EXIT_INVALID and report["exit_code"] == EXIT_INVALID
    assert [p["path"] for p in report["problems"]] == ["name.x"]
    result, _ = run("submit", EXAMPLES / "missing.yaml", "--json")
    assert result.exit_code == EXIT_UNREADABLE and json.loads(result.stdout)["problems"][0]["path"] == "<file>"


def test_help_keeps_brackets_and_lists_choices():
    _, out = run("datasets", "build", "--help", columns=200)
    assert "catalog://NAME[@BRANCH]" in out  # rich markup once read [@BRANCH] as a tag and dropped it
    _, out = run("logs", "--help", columns=200)
    assert "prefixed [rank N]" in out
    _, out = run("status", "--help", columns=200)
    assert "pending|running|completed|failed|cancelled" in out
