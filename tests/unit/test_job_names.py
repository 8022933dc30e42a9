"""What a JOB argument means, everywhere (registry/jobs.py `JobStore.get`, commands/common.py `resolve_job`):
an exact job id wins; else a job name (the spec's `name`) is that name's newest job by its record's created_at;
else an error, listing the jobs whose ids or names start with the argument (id, name, created, state) and saying to
pass a full id, or saying no job has it and how to list jobs. No traceback for any of it.

The store here is the temp TRAINFORGE_HOME of tests/conftest.py, with records written by hand: after the demo
(`tiny-cpu`, submitted twice) and a fine-tune (`tiny-cpu-finetune`) every id of the fine-tune starts with
`tiny-cpu-`, which a prefix match took for the demo's. One command per family through click's runner: status /
watch / logs, checkpoints / metric / report / profile, cancel / promote / submit --resume / lineage datasets-of.

Run: .venv/bin/python -m pytest tests/unit/test_job_names.py -q
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.commands.common import EXIT_INVALID
from trainforge.registry.jobs import AmbiguousJobError, JobLookupError, JobNotFoundError, JobRecord, JobStore

runner = CliRunner()
T0 = datetime(2026, 1, 1, tzinfo=UTC).timestamp()

# Submitted in this order: the demo, a fine-tune of it, the demo again. The newer demo's id sorts *before* the
# older one's (its random suffix), so only created_at can say which is newest.
OLD_DEMO = "tiny-cpu-20260101-000000-ffff"
FINETUNE = "tiny-cpu-finetune-20260101-000100-1234"
NEW_DEMO = "tiny-cpu-20260101-000000-0000"


def make_job(job_id: str, name: str | None, created: float, state: str = "completed") -> JobRecord:
    """A job record as the flow writes it (job.json), a metrics event and one rank's log."""
    fields: dict[str, Any] = {"team": "demo"} | ({"name": name} if name is not None else {})
    record = JobStore().create(job_id, **fields)
    record.update(state=state, created_at=created)
    event = {"type": "metrics", "v": 1, "time": created, "step": 1, "loss": 2.5, "tokens_per_s": 10.0}
    record.events_path.write_text(json.dumps(event) + "\n")
    log = record.folder / "logs" / "segment-0" / "none_x" / "attempt_0" / "0" / "stdout.log"
    log.parent.mkdir(parents=True)
    log.write_text(f"hello from {job_id}\n")
    return record


@pytest.fixture
def demo_and_finetune() -> None:
    make_job(OLD_DEMO, "tiny-cpu", T0 + 1)
    make_job(FINETUNE, "tiny-cpu-finetune", T0 + 2, state="failed")
    make_job(NEW_DEMO, "tiny-cpu", T0 + 3)


def run(*args: str) -> tuple[Any, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result, output


def assert_lists_candidates(out: str, *job_ids: str) -> None:
    for job_id in job_ids:
        assert job_id in out, out
    assert "neither a job id nor a job name" in out and "full job id" in out, out


# ---- the resolver ------------------------------------------------------------------------------------------------

def test_a_name_is_its_newest_job_and_a_longer_name_is_not_it(demo_and_finetune):
    store = JobStore()
    assert store.get("tiny-cpu").job_id == NEW_DEMO  # not the fine-tune, whose id starts with "tiny-cpu-"
    assert store.get("tiny-cpu-finetune").job_id == FINETUNE
    assert [r.job_id for r in store.find("tiny-cpu")] == [OLD_DEMO, NEW_DEMO]
    from trainforge.sdk import get_job  # the SDK agrees: it asks the same resolver

    assert get_job("tiny-cpu").id == NEW_DEMO


def test_an_exact_id_wins_even_over_a_name():
    make_job("tiny-cpu-20260101-000000-aaaa", "tiny-cpu", T0 + 1)
    make_job("tiny-cpu", "other", T0 + 0)  # a job given the id `tiny-cpu` explicitly, older than the named one
    store = JobStore()
    assert store.get("tiny-cpu").job_id == "tiny-cpu"
    assert store.get("tiny-cpu-20260101-000000-aaaa").name == "tiny-cpu"


def test_newest_is_by_created_at_not_by_id():
    make_job("a-20260101-000000-0001", "a", T0 + 5)
    make_job("a-20260101-000000-0002", "a", T0 + 1)
    assert JobStore().get("a").job_id == "a-20260101-000000-0001"


def test_a_prefix_of_ids_or_names_is_an_error_listing_the_candidates(demo_and_finetune):
    with pytest.raises(AmbiguousJobError) as caught:
        JobStore().get("tiny")
    exc = caught.value
    assert [r.job_id for r in exc.candidates] == [OLD_DEMO, FINETUNE, NEW_DEMO]  # newest last
    message = str(exc)
    assert message.startswith("'tiny' is neither a job id nor a job name; 3 job(s) start with it:")
    # each candidate: id, name, created, state
    assert f"  {FINETUNE}  (name tiny-cpu-finetune, created 2026-01-01 00:00:02 UTC, failed)" in message
    assert "pass its full job id" in message and "tiny-cpu, tiny-cpu-finetune" in message
    # a strict prefix of one id only is no id either: it is listed, not guessed
    with pytest.raises(AmbiguousJobError) as caught:
        JobStore().get("tiny-cpu-finetune-2026")
    assert [r.job_id for r in caught.value.candidates] == [FINETUNE]


def test_many_candidates_list_the_newest_ten():
    for i in range(12):
        make_job(f"sweep-{i:02d}-20260101-000000-000{i % 10}", f"sweep-{i:02d}", T0 + i)
    with pytest.raises(AmbiguousJobError) as caught:
        JobStore().get("sweep")
    assert len(caught.value.candidates) == 12
    message = str(caught.value)
    assert "12 job(s) start with it (the newest 10 here)" in message
    assert "sweep-11-" in message and "sweep-01-" not in message


@pytest.mark.parametrize("text", ["nope", "", "  ", "..", ".", "../jobs", "a/b", "bad\0name"])
def test_an_unknown_or_malformed_argument_says_so(demo_and_finetune, text):
    with pytest.raises(JobNotFoundError) as caught:
        JobStore().get(text)
    message = str(caught.value)
    assert "trainforge status" in message
    if text.strip():
        assert f"no job {text!r}: no job id or job name is {text!r}" in message and NEW_DEMO in message


def test_a_record_without_a_name_is_named_by_its_id():
    make_job("legacy-20250101-000000-abcd", None, T0)
    record = JobStore().get("legacy")
    assert record.job_id == "legacy-20250101-000000-abcd" and record.name == "legacy"
    assert record.created_at == T0 and record.state == "completed"


def test_an_unreadable_record_is_a_lookup_error():
    folder = JobStore().root / "broken-20260101-000000-abcd"
    folder.mkdir(parents=True)
    (folder / "job.json").write_text("{not json")
    with pytest.raises(JobLookupError, match="cannot be read") as caught:
        JobStore().get("broken-20260101-000000-abcd")
    assert not isinstance(caught.value, JobNotFoundError)  # metric and lineage must not look elsewhere for it
    result, out = run("status", "broken-20260101-000000-abcd")
    assert result.exit_code == EXIT_INVALID and "cannot be read" in out


# ---- status / watch / logs -----------------------------------------------------------------------------------------

def test_status_watch_logs_take_a_name(demo_and_finetune):
    result, out = run("status", "tiny-cpu", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["job_id"] == NEW_DEMO
    result, out = run("status", "tiny-cpu-finetune")
    assert result.exit_code == 0 and FINETUNE in out
    result, _ = run("watch", "tiny-cpu", "--once", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["job_id"] == NEW_DEMO
    result, out = run("logs", "tiny-cpu")
    assert result.exit_code == 0 and out == f"[rank 0] hello from {NEW_DEMO}\n"
    result, out = run("logs", OLD_DEMO)
    assert result.exit_code == 0 and out == f"[rank 0] hello from {OLD_DEMO}\n"


def test_status_watch_logs_errors(demo_and_finetune):
    for command in (["status"], ["watch", "--once"], ["logs"]):
        result, out = run(*command[:1], "tiny", *command[1:])
        assert result.exit_code == EXIT_INVALID, out
        assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)
        result, out = run(*command[:1], "nope", *command[1:])
        assert result.exit_code == EXIT_INVALID and "no job 'nope'" in out and "trainforge status" in out
    result, _ = run("status", "tiny", "--json")
    error = json.loads(result.stdout)
    assert error["exit_code"] == EXIT_INVALID and "neither a job id nor a job name" in error["error"]
    assert [(c["job_id"], c["name"], c["state"]) for c in error["candidates"]] == [
        (OLD_DEMO, "tiny-cpu", "completed"), (FINETUNE, "tiny-cpu-finetune", "failed"),
        (NEW_DEMO, "tiny-cpu", "completed")]
    assert error["candidates"][0]["created_at"] == T0 + 1


# ---- checkpoints / metric / report / profile -----------------------------------------------------------------------

def test_checkpoints_report_profile_take_a_name(demo_and_finetune, monkeypatch):
    import trainforge.registry.report as report_module

    result, out = run("checkpoints", "tiny-cpu")  # the records have no worker config: the error names the job
    assert result.exit_code == EXIT_INVALID and f"job {NEW_DEMO} never started training" in out
    written: list[str] = []

    def fake_report(record: JobRecord, out: Path | None, log_to_mlflow: bool) -> Path:
        written.append(record.job_id)
        return record.folder / "report.html"

    monkeypatch.setattr(report_module, "write_report", fake_report)
    result, _ = run("report", "tiny-cpu-finetune", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["job_id"] == FINETUNE and written == [FINETUNE]
    result, out = run("profile", "tiny-cpu", "--steps", "1:2")
    assert result.exit_code == EXIT_INVALID and f"job {NEW_DEMO} is completed" in out
    for command in (["checkpoints", "tiny"], ["report", "tiny"], ["profile", "tiny", "--steps", "1:2"]):
        result, out = run(*command)
        assert result.exit_code == EXIT_INVALID
        assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)


def test_metric_resolves_a_name_here_and_passes_an_unknown_id_to_mlflow(demo_and_finetune, monkeypatch):
    import trainforge.registry.tracking as tracking
    from trainforge.registry.tracking import MetricValue

    asked: list[str] = []

    def fake_metric(job_id: str, metric: str, mode: str = "latest") -> MetricValue:
        asked.append(job_id)
        if not job_id.startswith("tiny-cpu-"):
            raise LookupError(f"no MLflow run for job {job_id!r}")
        return MetricValue(job_id, "run-1", metric, mode, 1.5, 3, 0, "FINISHED")

    monkeypatch.setattr(tracking, "job_metric", fake_metric)
    result, _ = run("metric", "tiny-cpu", "loss", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["job_id"] == NEW_DEMO
    result, out = run("metric", "tiny-cpu-finetune", "eval_loss")
    assert result.exit_code == 0 and f"eval_loss (latest) of {FINETUNE}: 1.5 at step 3" in out
    # a job of another host: its id goes to MLflow as typed
    result, out = run("metric", "remote-20260101-000000-abcd")
    assert result.exit_code == EXIT_INVALID and "no MLflow run for job 'remote-20260101-000000-abcd'" in out
    assert asked == [NEW_DEMO, FINETUNE, "remote-20260101-000000-abcd"]
    result, out = run("metric", "tiny")
    assert result.exit_code == EXIT_INVALID and len(asked) == 3
    assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)


# ---- cancel / promote / submit --resume / lineage ----------------------------------------------------------------

def test_cancel_and_promote_take_a_name(demo_and_finetune, monkeypatch):
    import trainforge.registry.promotion as promotion

    result, out = run("cancel", "tiny-cpu-finetune")
    assert result.exit_code == 0 and f"job {FINETUNE} had already ended: failed" in out
    result, _ = run("cancel", "tiny-cpu", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["job_id"] == NEW_DEMO
    promoted: list[str] = []

    def fake_promote(job: str, **kw: Any) -> dict[str, Any]:
        promoted.append(job)
        return {"job_id": job}

    monkeypatch.setattr(promotion, "promote", fake_promote)
    result, _ = run("promote", "tiny-cpu", "--best", "--json")
    assert result.exit_code == 0 and promoted == [NEW_DEMO]
    for command in (["cancel", "tiny"], ["promote", "tiny", "--best"]):
        result, out = run(*command)
        assert result.exit_code == EXIT_INVALID
        assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)
    result, out = run("promote", "nope", "--best")
    assert result.exit_code == EXIT_INVALID and "no job 'nope'" in out and promoted == [NEW_DEMO]


def test_submit_resume_and_lineage_take_a_name(demo_and_finetune, monkeypatch):
    import trainforge.commands.jobs as jobs_commands
    import trainforge.registry.lineage as lineage
    from trainforge.commands.common import fail

    resumed: list[str | None] = []

    def fake_prepare(spec_file: Path | None, *, resume: str | None = None, **kw: Any) -> Any:
        resumed.append(resume)
        fail("stopped here")

    monkeypatch.setattr(jobs_commands, "_prepare", fake_prepare)
    result, out = run("submit", "--resume", "tiny-cpu")
    assert "stopped here" in out and resumed == [NEW_DEMO]
    result, out = run("submit", "--resume", "tiny")
    assert result.exit_code == EXIT_INVALID and resumed == [NEW_DEMO]
    assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)

    targets: list[str] = []

    class FakeLineage:
        def datasets_of(self, target: str) -> list[Any]:
            targets.append(target)
            return []

    monkeypatch.setattr(lineage, "LineageStore", FakeLineage)
    for target in ("tiny-cpu", "tiny-cpu@20", "models:/demo.tiny-cpu/1", "remote-job"):
        result, out = run("lineage", "datasets-of", target, "--json")
        assert result.exit_code == 0, out
    assert targets == [f"job:{NEW_DEMO}", f"checkpoint:{NEW_DEMO}@20", "models:/demo.tiny-cpu/1", "remote-job"]
    result, out = run("lineage", "datasets-of", "tiny@20")
    assert result.exit_code == EXIT_INVALID and len(targets) == 4
    assert_lists_candidates(out, OLD_DEMO, FINETUNE, NEW_DEMO)
