"""Script mode: the worker runs the user's own script under torchrun with the distributed environment injected.
Run: `.venv/bin/python -m pytest tests/distributed/test_script_mode.py -q`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.distributed.conftest import run_torchrun
from tests.segment_configs import segment_config
from trainforge.contract.config import ENV_VAR

pytestmark = pytest.mark.slow  # starts torchrun: `make test`, not `make test-fast`

TORCH_SCRIPT = '''
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "argv": sys.argv[1:]}
open(os.path.join(os.environ["TRAINFORGE_RUN_DIR"], f"out-{dist.get_rank()}.json"), "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
sys.exit(0)
'''

ENV_SCRIPT = '''
import json, os
keys = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "TF_CONFIG"]
rank = os.environ["RANK"]
open(os.path.join(os.environ["TRAINFORGE_RUN_DIR"], f"env-{rank}.json"), "w").write(
    json.dumps({k: os.environ.get(k) for k in keys}))
'''


def launch(tmp: Path, script: str, code: dict, env: dict[str, str] | None = None) -> Path:
    (tmp / "code").mkdir()
    (tmp / "code" / "train.py").write_text(script)
    run_dir = tmp / "run"
    run_dir.mkdir()
    cfg = segment_config(run_dir=str(run_dir), storage_url="", storage_prefix="", staging_dir="",
                         code_dir=str(tmp / "code"), code={"entrypoint": "train.py", "mode": "script", **code})
    cfg.write(tmp / "cfg.json")
    run_torchrun(2, "trainforge.trainer.worker", [], timeout=120, env={ENV_VAR: str(tmp / "cfg.json"), **(env or {})})
    return run_dir


def test_torch_script_gets_process_group_env(tmp_path: Path) -> None:
    run_dir = launch(tmp_path, TORCH_SCRIPT, {"framework": "pytorch", "args": ["--lr", "0.1"]})
    outs = [json.loads((run_dir / f"out-{r}.json").read_text()) for r in range(2)]
    assert [(o["rank"], o["world"], o["sum"], o["argv"]) for o in outs] == [
        (0, 2, 3.0, ["--lr", "0.1"]), (1, 2, 3.0, ["--lr", "0.1"])]


@pytest.mark.parametrize("framework", ["jax", "tensorflow"])
def test_framework_env_injected(tmp_path: Path, framework: str) -> None:
    run_dir = launch(tmp_path, ENV_SCRIPT, {"framework": framework})
    envs = [json.loads((run_dir / f"env-{r}.json").read_text()) for r in range(2)]
    if framework == "jax":
        assert [(e["JAX_NUM_PROCESSES"], e["JAX_PROCESS_ID"]) for e in envs] == [("2", "0"), ("2", "1")]
        assert envs[0]["JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
    else:
        tf = [json.loads(e["TF_CONFIG"]) for e in envs]
        assert [t["task"]["index"] for t in tf] == [0, 1] and len(tf[0]["cluster"]["worker"]) == 2


def test_plain_script_is_never_a_startup_hang_and_ends_done(tmp_path: Path) -> None:
    """A script that does not use trainforge.runtime reports no steps: its heartbeats say `script` while it runs
    (liveness checks only, not the start-up hang timeout) and `done` when it returns."""
    from dataclasses import replace

    from tests.local_channel import LocalChannel
    from trainforge.registry.jobs import JobStore
    from trainforge.trainer.health import HealthPolicy

    # The ranks beat to a real node publisher (as the backend's sidecar runs it) and the supervisor reads them from
    # the channel; a long lease: nobody renews it while torchrun runs.
    channel = LocalChannel(tmp_path / "objects", socket=f"@tf-script-mode-{os.getpid()}", lease_ttl_s=600.0)
    try:
        run_dir = launch(tmp_path, TORCH_SCRIPT, {"framework": "pytorch"},
                         env={"TRAINFORGE_CHANNEL_SOCKET": channel.socket or ""})
        record = JobStore(tmp_path / "jobs").create("plain-script", name="s", team="t", spec={}, source="x")
        supervisor = channel.supervisor(record, 0, HealthPolicy(startup_timeout_s=0.0))
        beats = channel.read_until(supervisor, lambda got: sorted(got) == [0, 1]
                                   and all(b.beat.phase == "done" for b in got.values()))
        assert sorted(beats) == [0, 1] and {b.beat.phase for b in beats.values()} == {"done"}
        assert not (run_dir / "health").exists()
        # While it runs, a script-phase gang that reports no progress is never called hung (start-up budget 0 s).
        running = {r: replace(b, beat=b.beat.model_copy(update={"phase": "script"})) for r, b in beats.items()}
        supervisor._check_progress(running, 1.0)
        supervisor._check_progress(running, 1e9)
        assert not supervisor.incidents
    finally:
        channel.close()
