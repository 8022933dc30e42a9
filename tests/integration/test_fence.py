"""A stale segment attempt can never commit, refused by the S3 server itself (SeaweedFS, a 412 on the fence's
If-Match): the race alone, then two real gangs. Attempt 0's rank 0 is paused between reading the fence and its
conditional write for step 4 (its training goes on to the end); the control plane starts attempt 1, which resumes
from step 2 and commits step 4 itself; then attempt 0 is let go: the server refuses its commit, no manifest of it is
ever visible, and attempt 1 ends with the weights of a fault-free run, bit for bit.

Run: .venv/bin/python -m pytest tests/integration/test_fence.py -q   (about a minute)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import ROOT, free_port, run_torchrun
from trainforge.registry.fence import StaleAttemptError, advance_attempt, commit, read_fence
from trainforge.registry.manifest import list_committed, manifest_steps, read_manifest, step_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = "teams/t/jobs/restore"  # tests/distributed/restore_worker.py's
WORLD = 2


def test_the_server_refuses_a_commit_after_a_newer_attempt_began(s3_store):
    advance_attempt(s3_store, JOB, 0, lambda: manifest_steps(s3_store, JOB))
    written = []
    with pytest.raises(StaleAttemptError) as refused:
        commit(s3_store, JOB, 4, 0, lambda: written.append(4), manifest_steps=lambda: manifest_steps(s3_store, JOB),
               before_write=lambda: advance_attempt(s3_store, JOB, 1, lambda: manifest_steps(s3_store, JOB)))
    assert refused.value.status == 412  # SeaweedFS's Precondition Failed on the fence's If-Match
    assert written == [] and read_fence(s3_store, JOB).attempt == 1


def _config(out: Path, store: str, phases: list[str]) -> dict:
    return {"out": str(out), "store": store, "layout": "fsdp", "width": 128, "layers": 3, "steps": 6, "interval": 2,
            "phases": phases}


def test_a_paused_stale_gang_is_refused_and_the_new_attempt_ends_bitwise(s3_server, tmp_path):
    bucket = s3_server.make_bucket()
    store_url = f"s3://{bucket}/platform"
    store = s3_server.store(bucket, "platform")
    env = s3_server.env() | {"TRAINFORGE_REPLICA_DIR": str(tmp_path / "shm")}
    try:
        # the fault-free reference, in a store of its own
        run_torchrun(WORLD, "tests.distributed.restore_worker", [],
                     env={"RESTORE_CONFIG": json.dumps(_config(tmp_path / "clean", str(tmp_path / "clean-store"),
                                                               ["train"]))})
        reference = [json.loads((tmp_path / "clean" / f"train-0-rank{r}.json").read_text())["digest"]
                     for r in range(WORLD)]

        advance_attempt(store, JOB, 0, lambda: manifest_steps(store, JOB))  # what the flow does before a gang
        gate = tmp_path / "gate"
        gate.mkdir()
        old_out = tmp_path / "attempt-0"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "tests.distributed.restore_worker"]
        old_env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                   "TRAINFORGE_SEGMENT_ATTEMPT": "0", "TRAINFORGE_TEST_FENCE_PAUSE": f"4:{gate}",
                   "RESTORE_CONFIG": json.dumps(_config(old_out, store_url, ["train"]))}
        old = subprocess.Popen(cmd, cwd=ROOT, env=old_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while not (gate / "paused").exists():
                assert old.poll() is None, old.communicate()[0][-4000:]
                assert time.monotonic() < deadline, "attempt 0 never reached its step-4 commit"
                time.sleep(0.1)
            assert [r.step for r in list_committed(store, JOB)] == [2]

            # the control plane gives up on attempt 0 and starts attempt 1 (attempt 0 still runs, paused)
            advance_attempt(store, JOB, 1, lambda: manifest_steps(store, JOB))
            new_out = tmp_path / "attempt-1"
            run_torchrun(WORLD, "tests.distributed.restore_worker", [],
                         env=env | {"TRAINFORGE_SEGMENT_ATTEMPT": "1",
                                    "RESTORE_CONFIG": json.dumps(_config(new_out, store_url, ["resume"]))})
            new = [json.loads((new_out / f"resume-0-rank{r}.json").read_text()) for r in range(WORLD)]
            assert [r["start"] for r in new] == [2] * WORLD

            (gate / "resume").write_text("go")  # attempt 0 wakes up and tries to commit step 4
            output, _ = old.communicate(timeout=120)
        finally:
            if old.poll() is None:
                os.killpg(old.pid, signal.SIGKILL)
                old.communicate()
        assert old.returncode != 0  # its newest checkpoint did not commit: the segment ends failed
        assert "refused by the store (HTTP 412)" in output, output[-4000:]

        manifest = read_manifest(store, step_prefix(JOB, 4))
        assert manifest["segment_attempt"] == 1  # the only manifest of step 4 is attempt 1's
        assert [(r.step, r.manifest["segment_attempt"]) for r in list_committed(store, JOB)] == [(2, 0), (4, 1)]
        assert [r["digest"] for r in new] == reference
    finally:
        s3_server.delete_bucket(bucket)
