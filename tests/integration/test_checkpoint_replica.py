"""In-memory replicas: a rank SIGKILLed mid-run under torchrun --max-restarts=1 is restarted, and the gang restores
from host memory (its own shard, or a peer's copy when its node lost it) without object storage, ending with the
same weights as an uninterrupted run.

Run: .venv/bin/python -m pytest tests/integration/test_checkpoint_replica.py -q   (about 1 minute)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("checkpoint_replica_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def torchrun(out: Path, **env: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "--monitor-interval=0.5", str(WORKER), str(out)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                "TRAINFORGE_REPLICA_DIR": str(out / "shm"), **env}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(2)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return torchrun(tmp_path_factory.mktemp("clean"))


@pytest.mark.parametrize("drop_own", [False, True], ids=["own-memory", "peer-memory"])
def test_restart_restores_from_memory(tmp_path, clean, drop_own):
    env = {"KILL_AT_STEP": "5"} | ({"DROP_OWN_SHARD": "1"} if drop_own else {})
    results = torchrun(tmp_path, **env)
    for r in results:
        assert r["restart"] == 1
        assert r["restored_from"] == "memory"
        assert r["start"] == 4
    assert [r["digest"] for r in results] == [c["digest"] for c in clean]
