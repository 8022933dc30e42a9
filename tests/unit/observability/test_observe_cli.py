"""`trainforge watch | cost | profile` on synthetic job records (no flow, no MLflow), and compare's helpers.

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.commands.observe import LiveState, config_diff, render, summarize_history
from trainforge.registry.jobs import JobStore

runner = CliRunner()


def make_job(team="research", state="completed", workers=2):
    store = JobStore()
    record = store.create(f"job-{team}-{state}", team=team, state=state,
                          spec={"resources": {"gpu_type": "cpu"}, "training": {"max_steps": 4}},
                          plan={"world_size": workers, "predicted": {"mfu": 0.3, "step_time_s": 0.5}},
                          segments=[{"attempt": 0, "started_at": 0.0, "ended_at": 36.0, "state": "completed"}])
    record.update(state=state)
    lines = [{"type": "metrics_meta", "step": 0, "peak_source": "calibrated-cpu", "peak_flops": 1e10,
              "flops_per_token": 6e6, "world_size": workers, "bubble_fraction": 0.0},
             *({"type": "metrics", "step": s, "time": float(s), "loss": 3.0 - s * 0.1, "grad_norm": 1.0, "lr": 1e-3,
                "step_time_s": 1.0, "tokens_per_s": 512.0, "samples_per_s": 8.0, "mfu": 0.2, "compute_s": 0.6,
                "exposed_comm_s": 0.2, "bubble_s": 0.0, "data_wait_s": 0.1, "optimizer_s": 0.1,
                "peak_mem_bytes": 3e8} for s in range(1, 5)),
             {"type": "rank_metrics", "step": 4, "step_time_s_min": 0.9, "step_time_s_median": 1.0,
              "step_time_s_max": 1.1, "peak_mem_bytes_min": 2e8, "peak_mem_bytes_max": 3e8, "straggler_rank": 1,
              "straggler_ratio": 1.2},
             {"type": "system", "step": 4, "source": "cpu", "cpu_percent": 95.0, "workers_rss_bytes": 6e8},
             {"type": "checkpoint_staged", "step": 4, "blocked_s": 0.05}]
    record.events_path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return record


def test_watch_once_shows_mfu_split_ranks_and_telemetry():
    record = make_job()
    record.update(alerts=[{"rule": "data_wait", "step": 3, "message": "data wait 30% of step time"}])
    result = runner.invoke(app, ["watch", record.job_id, "--once"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("4 / 4", "MFU (plan)", "20.0% (30.0%)", "calibrated peak", "compute 60%", "exposed_comm 20%",
                 "slowest rank 1 (1.20x)", "CPU 95%", "data_wait @ step 3", "0.05 s"):
        assert text in out, (text, out)


def test_render_before_first_step(tmp_path):
    live = LiveState(tmp_path / "none.jsonl")
    live.update()
    assert render({"job_id": "j", "state": "running"}, live).row_count == 1


def test_watch_follows_until_the_job_ends():
    record = make_job()
    result = runner.invoke(app, ["watch", record.job_id, "--interval", "0.05", "--timeout", "5"])
    assert result.exit_code == 0, result.output


def test_cost_table_json_csv_and_team_rollup(tmp_path):
    make_job("research")
    make_job("vision", state="failed")
    result = runner.invoke(app, ["cost", "--json"])
    rows = json.loads(result.output)
    assert {r["team"] for r in rows} == {"research", "vision"}
    research = next(r for r in rows if r["team"] == "research")
    assert research["gpu_hours"] == 36 * 2 / 3600
    assert abs(research["productive_hours"] + research["idle_hours"] + research["lost_hours"]
               - research["gpu_hours"]) < 1e-12
    result = runner.invoke(app, ["cost", "--team", "vision", "--by-team", "--json", "--csv", str(tmp_path / "c.csv")])
    rows = json.loads(result.output)
    assert len(rows) == 1 and rows[0]["failed_hours"] == 36 * 2 / 3600
    assert (tmp_path / "c.csv").read_text().startswith("team,jobs,gpu_hours")
    assert runner.invoke(app, ["cost"]).exit_code == 0
    assert runner.invoke(app, ["cost", "--market", "reserved"]).exit_code != 0


def test_profile_request_goes_down_the_running_segments_channel(tmp_path):
    from trainforge.contract.channel import CommandReader, channel_root
    from trainforge.infra.storage import open_store

    record = make_job(state="running")
    # No segment running yet (being prepared): the user is told what to do, nothing is sent.
    out = runner.invoke(app, ["profile", record.job_id, "--steps", "5:6"])
    assert out.exit_code != 0 and record.job_id in out.output and "no segment running" in out.output
    url, prefix = (tmp_path / "store").as_uri(), f"teams/research/jobs/{record.job_id}"
    (record.folder / "worker-config.json").write_text(json.dumps({"storage_url": url, "storage_prefix": prefix}))
    record.update(segments=[{"attempt": 0, "state": "failed"}, {"attempt": 1, "state": "running"}])
    result = runner.invoke(app, ["profile", record.job_id, "--steps", "5:6"])
    assert result.exit_code == 0, result.output
    [cmd] = CommandReader(open_store(url), f"{channel_root(prefix)}/segment-1", "node-0").poll()
    assert (cmd.kind, cmd.args) == ("profile_window", {"start_step": 5, "end_step": 6})
    assert not (record.folder / "profile-request.json").exists()  # nothing through the flow host's disk
    assert runner.invoke(app, ["profile", record.job_id, "--steps", "6:5"]).exit_code != 0
    done = make_job(team="x", state="completed")
    assert runner.invoke(app, ["profile", done.job_id, "--steps", "1:2"]).exit_code != 0


def test_compare_helpers():
    diff = config_diff({"a": {"lr": "0.1", "seed": "1"}, "b": {"lr": "0.2", "seed": "1", "extra": "x"}})
    assert diff == {"extra": {"a": "—", "b": "x"}, "lr": {"a": "0.1", "b": "0.2"}}
    assert summarize_history([(2, 1.0), (1, 3.0), (3, 2.0)]) == {"final": 2.0, "best": 1.0, "median": 2.0}
    assert summarize_history([]) == {}
