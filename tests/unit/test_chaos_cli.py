"""`trainforge chaos JOB.yaml --scenario NAME`: bad names and shapes give a clear error (no job started, no
traceback); a real drill (kill -9 of a rank of a 2-worker tiny job) completes and prints detection, MTTR and lost
steps from the records.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/unit/test_chaos_cli.py -q   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.unit.test_cli import run  # the CLI runner every CLI test uses: no traceback, clean exit
from trainforge.commands.chaos import SCENARIO_NAMES
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.home import home
from trainforge.tasks.chaos import SCENARIOS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def tiny_spec(tmp_path: Path, **resources) -> Path:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": 16, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = 4
    doc["resources"].update(resources)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_cli_lists_every_scenario_of_the_drill_machinery():
    assert tuple(SCENARIOS) == SCENARIO_NAMES


def test_unknown_scenario_is_a_clear_error_and_starts_nothing(tmp_path):
    result, out = run("chaos", tiny_spec(tmp_path), "--scenario", "meteor")
    assert result.exit_code == 2  # a value outside an option's choices is a usage error (docs/cli.md)
    assert "--scenario" in out and "'meteor' is not one of" in out and "'kill'" in out and "'node'" in out
    assert not (home() / "jobs").exists()


def test_node_scenario_on_a_single_node_job_says_how_to_fix_the_spec(tmp_path):
    ensure_demo_dataset()
    result, out = run("chaos", tiny_spec(tmp_path), "-s", "node")
    assert result.exit_code == 1
    assert "needs a gang of at least 2 nodes" in out and "min_gpus" in out


def test_step_outside_the_job_is_rejected(tmp_path):
    ensure_demo_dataset()
    result, out = run("chaos", tiny_spec(tmp_path), "-s", "kill", "--step", "99")
    assert result.exit_code == 1 and "outside the job's 16 steps" in out


def test_unreadable_spec_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    result, _ = run("chaos", bad, "-s", "kill")
    assert result.exit_code == 2


@pytest.mark.timing
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_drill_runs_the_job_and_prints_detection_mttr_and_lost_steps(tmp_path, monkeypatch):
    ensure_demo_dataset()
    monkeypatch.setenv("COLUMNS", "250")  # the table on one line per row
    spec = tiny_spec(tmp_path)
    result, out = run("chaos", spec, "--scenario", "kill", "--step", "6")
    assert result.exit_code == 0, out
    assert "kill" in out and "rank_lost" in out and "in-segment restart" in out and "completed step 16/16" in out
    result, out = run("chaos", spec, "-s", "kill", "--step", "6", "--json")  # a second drill: a new job
    [row] = json.loads(out[out.index("["):])
    assert row["state"] == "completed" and row["final_step"] == 16 and row["detected"] == "rank_lost"
    assert row["detection_s"] is not None and 0 <= row["detection_s"] < 5
    assert row["mttr_s"] > 0 and row["lost_steps"] is not None and 0 <= row["lost_steps"] <= 4
    assert row["fault"] == "kill:rank=1:step=6"
    assert len(list((home() / "jobs").glob("chaos-tiny-cpu-kill-*"))) == 2
