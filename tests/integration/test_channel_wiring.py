"""Every message between the control plane and its workers goes through the channel, not the flow host's disk.

The workers get a run_dir that is not the job's folder (as a worker on another machine would have its own disk):
the control plane still receives every event (in the job's events.jsonl, which only it writes), every rank's
heartbeats (journalled as the last beat per rank) and a failing rank's report, all through the segment attempt's
channel in the job's object store; the workers' folder gets none of them. About 1 minute on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainforge.contract.channel import ChannelLayout
from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.trainer.health import read_heartbeats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6


def _job(job_id: str, worker_dir: Path):  # type: ignore[no-untyped-def]
    from tests.chaos.harness import make_job

    job = make_job(job_id, steps=STEPS, interval=3)
    config = job.config.model_copy(update={"run_dir": str(worker_dir)})
    return job, config


def _run(job, config, fault: str = ""):  # type: ignore[no-untyped-def]
    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.chaos import FAST_HEALTH
    from trainforge.tasks.segment import run_segment

    env = {"TRAINFORGE_FAULT": fault, "TRAINFORGE_HEALTH": json.dumps(FAST_HEALTH), "OMP_NUM_THREADS": "1"}
    fresh = JobStore(job.record.folder.parent).get(job.record.job_id)
    return run_segment(fresh, job.config_path, config, nproc=2, max_restarts=0, extra_env=env)


def test_a_segment_whose_workers_do_not_share_the_flow_folder(tmp_path: Path) -> None:
    worker_dir = tmp_path / "worker-disk"
    worker_dir.mkdir()
    job, config = _job("wired-clean", worker_dir)
    result = _run(job, config)
    assert (result.last_step, result.reason) == (STEPS, "finished")

    events, _ = read_events(job.record.events_path)
    types = [e["type"] for e in events]
    assert types.count("segment_start") == 1 and types.count("segment_end") == 1
    assert sorted(e["step"] for e in events if e["type"] == "metrics") == list(range(1, STEPS + 1))
    assert {e["step"] for e in events if e["type"] == "checkpoint"} == {3, 6}
    assert all(e["src"]["rank"] == 0 for e in events if e["type"] == "metrics")
    # the heartbeats came through the channel: the control plane journals each rank's last one
    beats = read_heartbeats(job.record.folder, 0)
    assert sorted(beats) == [0, 1] and all(b["phase"] == "done" and b["step"] == STEPS for b in beats.values())
    # nothing of it went to the workers' own disk
    assert not (worker_dir / "events.jsonl").exists()
    assert not (worker_dir / "health").exists() and not (worker_dir / "failures").exists()
    # one publisher for the node, batching both ranks, closed cleanly, in the job's store
    store = open_store(config.storage_url)
    root = f"{config.storage_prefix}/channel/segment-0"
    layout = ChannelLayout(root)
    batches = sorted((p[2], k) for k in store.list(layout.up_prefix)
                     if (p := ChannelLayout.parse_batch_key(k)) and p[1] == "node-0")  # (seq, key)
    assert batches and store.list(f"{root}/nodes/") == [f"{root}/nodes/node-0.json"]
    last = store.get_bytes(batches[-1][1]).decode().splitlines()[0]
    assert json.loads(last)["closing"] is True


def test_a_failure_report_reaches_the_flow_through_the_channel(tmp_path: Path) -> None:
    from trainforge.tasks.segment import SegmentFailed

    worker_dir = tmp_path / "worker-disk"
    worker_dir.mkdir()
    job, config = _job("wired-fail", worker_dir)
    with pytest.raises(SegmentFailed) as err:
        _run(job, config, fault="raise:rank=1:step=2")
    assert err.value.rank == 1 and "InjectedFault" in str(err.value)
    # rank 1's report (its peer may report the broken connection too)
    report = json.loads((job.record.folder / "failures" / "segment-0-rank-00001.json").read_text())
    assert report["rank"] == 1 and report["kind"] == "user" and "InjectedFault" in report["traceback"]
    assert not (worker_dir / "failures").exists()
