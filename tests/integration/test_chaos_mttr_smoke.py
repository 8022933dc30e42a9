"""bench/chaos_mttr.py `baseline` (trainforge's kill -9 recovery against plain torchrun, the comparison the docs
cite) runs end to end at its smallest size: one run each of trainforge and of the per-attempt-store torchrun
script, 12 steps, a checkpoint every 4, rank 1 killed at step 6, then the 1,024-GPU extrapolation. Nothing else runs
the bench, so without this test it broke unnoticed (a ModelShape handed to json.dumps).

Checks what the bench prints: exit 0; the trainforge row and the baseline row, each recovered 1/1 with a number
for fault -> first step and 2 lost steps (the step-4 checkpoint, killed at step 6); trainforge's recovery is an
in-segment restart after rank_lost; the extrapolation is printed. The bench runs in a session of its own with
TMPDIR in tmp_path and a tag of its own in its environment: no process of it may outlive it (any is named, then
killed) and what it wrote to temp is removed with tmp_path.

`timing`: the job runs the chaos suite's short detection windows and the run is sized to fit a minute, so it runs
alone (phase 2 of `make test`), as tests/chaos does.

Run: .venv/bin/python -m pytest tests/integration/test_chaos_mttr_smoke.py   (about 30 s on 2 cores)
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import leakcheck

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
STEPS, INTERVAL, KILL_STEP = 12, 4, 6
SMALLEST = ["baseline", "--runs", "1", "--steps", str(STEPS), "--interval", str(INTERVAL),
            "--kill-step", str(KILL_STEP), "--variant", "prefixed", "--limit-s", "30"]
BOUND_S = 150  # the whole bench; it takes ~30 s alone on 2 cores


def _row(out: str, label: str) -> tuple[str, float, str]:
    """(recovered, fault->step seconds, lost) of the table row starting with `label`."""
    m = re.search(rf"^{re.escape(label)}\s+(\d+/\d+)\s+(\d+\.\d+)\s+(\S+)\s+\d+\.\d+x$", out, re.MULTILINE)
    assert m, f"no row {label!r} with numbers in the bench's output:\n{out[-3000:]}"
    return m.group(1), float(m.group(2)), m.group(3)


def test_chaos_baseline_smallest_run(tmp_path: Path) -> None:
    tag = f"{os.environ.get(leakcheck.RUN_ENV, 'solo')}-chaos-smoke-{secrets.token_hex(3)}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch), leakcheck.RUN_ENV: tag}
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench/chaos_mttr.py"), *SMALLEST], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"bench/chaos_mttr.py did not finish in {BOUND_S} s:\n{out[-3000:]}")
    finally:
        left = leakcheck.leaked_processes(tag, grace_s=10)
        if left:
            leakcheck.kill_leaked(tag)
    assert proc.returncode == 0, f"bench exited {proc.returncode}:\n{out[-3000:]}"
    assert not left, "the bench left processes running:\n" + "\n".join(left)

    header = f"kill -9 rank 1 at step {KILL_STEP} ({STEPS} steps, ckpt every {INTERVAL})"
    assert re.search(rf"^{re.escape(header)}\s+recovered", out, re.MULTILINE), out[-3000:]
    ours = _row(out, "trainforge (heartbeats + torchrun restart + replica)")
    theirs = _row(out, "same + per-attempt store prefix, 60 s pg timeout")
    for recovered, seconds, lost in (ours, theirs):
        assert recovered == "1/1" and 0 < seconds < 30 and lost == str(KILL_STEP - INTERVAL), (ours, theirs)
    assert "plain torchrun" not in out  # one variant asked for, one run
    chaos = re.search(r"^CHAOS trainforge kill -9 \(in-segment restart\): detected=(\S+) .* tier=([\w -]+?) "
                      r"segments=(\d+)", out, re.MULTILINE)
    assert chaos and chaos.groups() == ("rank_lost", "in-segment restart", "1"), out[-3000:]
    assert re.search(rf"^CHAOS baseline same \+ per-attempt .* lost_steps={KILL_STEP - INTERVAL} "
                     rf"\(resumed from {INTERVAL}\) exit=0 ", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^extrapolation: 1024 x h100 .* planner step \d+\.\d+ s", out, re.MULTILINE), out[-3000:]
    assert re.search(r"MTTR node lost, restore from object store +=.* s \((meets|MISSES) the 5-min limit\)", out)
