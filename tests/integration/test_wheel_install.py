"""The wheel, installed into a fresh venv with nothing of the checkout, runs the demo from an empty folder.

Builds the wheel (`pip wheel --no-deps --no-build-isolation`: this venv's setuptools, no download), checks that it
ships prefect.yaml, examples/ and the LICENSE as real files, installs it with the `trainer` extra into a new venv
(torch==2.13.0 first, the CPU wheel; then the wheel's own metadata, resolved by pip as any user's install is), and
from an empty folder with its own TRAINFORGE_HOME runs `trainforge demo` (a real
2-worker gloo job through the embedded Prefect server), `trainforge simulate` on its shipped default cluster, and
reads the shipped prefect.yaml's dataset triggers as `automations install` does. The venv is also checked for what
the extras promise: no psycopg2, kubernetes or great-expectations, and a missing one is named by its extra.

Both installs are `pip install --no-index --find-links WHEELHOUSE` into the fresh venv: the resolver reads the
wheel's Requires-Dist and picks every distribution from a wheelhouse of this machine's cache
(${XDG_CACHE_HOME:-~/.cache}/trainforge-test-wheelhouse/KEY), so no index round trip and no sdist build
(deepspeed's) happens per run. The wheelhouse is filled once per machine and per KEY, a hash of pyproject.toml's
dependencies and `trainer` extra (with the torch pin, the Python and the platform): `pip wheel` of torch==2.13.0 and
the wheel[trainer], from the package index like any user's install, into a temporary folder renamed into place
under a file lock (concurrent runs wait for it; one killed mid-fill leaves nothing used). A wheelhouse resolved
against an older index stays in use until pyproject.toml's dependencies change: rm -r that folder to resolve anew.

Slow (about 4-6 min on 2 quiet cores the first time, most of it pip downloading and installing torch, prefect and
mlflow; later runs only install); CI runs it.
Run: pytest tests/integration/test_wheel_install.py
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU wheel on this machine's disk, never a CUDA build
WHEELHOUSE_RECIPE = 1  # part of the wheelhouse's key: bump it when _wheelhouse fills it differently
TRACE_HEADER = "job_id,submit_time_s,submit_time_iso,duration_s,num_gpus,gpu_milli,user,team,gpu_type,status,source_trace"


def _run(cmd: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} -> {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _clean_env(home: Path, venv: Path) -> dict[str, str]:
    """The user's environment: this venv's bin first, none of the test session's Python or trainforge settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINFORGE_", "PREFECT_", "MLFLOW_", "PYTHON", "VIRTUAL_ENV", "PYTEST"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), TRAINFORGE_HOME=str(home),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1", COLUMNS="200")
    return env


def _wheelhouse_key() -> str:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    what = {"dependencies": project["dependencies"], "trainer": project["optional-dependencies"]["trainer"],
            "torch": TORCH, "python": f"cp{sys.version_info.major}{sys.version_info.minor}",
            "platform": sysconfig.get_platform(), "recipe": WHEELHOUSE_RECIPE}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _wheelhouse(python: Path, wheel: Path, cwd: Path) -> Path:
    """The folder of wheels that `pip install --no-index` of torch, then of wheel[trainer], takes everything from:
    filled once (on a machine's first run, or when the dependencies changed) by `python`'s pip (the fresh venv's,
    the one that installs from it) from the package index, sdists built into wheels; complete or absent."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainforge-test-wheelhouse"
    key = _wheelhouse_key()
    house = root / key
    if house.is_dir():  # it appears only whole, by the rename below
        return house
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run filling it: wait for its rename
        if house.is_dir():
            return house
        for stale in root.glob(f".{key}.tmp-*"):  # a fill killed midway (we hold the lock: no one writes there)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-", dir=root))
        try:
            _run([str(python), "-m", "pip", "wheel", "--quiet", "-w", str(tmp), TORCH, f"{wheel}[trainer]"],
                 timeout=1500, cwd=cwd)
            for own in tmp.glob("trainforge-*.whl"):  # the wheel under test is this run's, never a cached one
                own.unlink()
            os.rename(tmp, house)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return house


def _build_wheel(out: Path) -> Path:
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
          str(REPO)], timeout=300, cwd=out)
    (wheel,) = out.glob("trainforge-*.whl")
    return wheel


def test_the_wheel_runs_the_demo_from_an_empty_folder(tmp_path):
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    wheel = _build_wheel(tmp_path)
    timings["build"] = time.monotonic() - t0
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for info in zf.infolist():  # copies, not links (a link's mode has S_IFLNK in the high bits)
            assert (info.external_attr >> 16) & 0o170000 != 0o120000, f"{info.filename} is a symlink in the wheel"
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for name in ("trainforge/project/prefect.yaml", "trainforge/project/examples/tiny-cpu.yaml",
                 "trainforge/project/examples/clusters/fleet-10k.yaml", "trainforge/py.typed"):
        assert name in names, f"{name} is not in {wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Python: >=3.11" in metadata
    base = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert not [line for line in base if "torch" in line or "deepspeed" in line], base

    venv, home, empty = tmp_path / "venv", tmp_path / "home", tmp_path / "empty"
    empty.mkdir()
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    t1 = time.monotonic()
    house = _wheelhouse(venv / "bin" / "python", wheel, empty)
    timings["wheelhouse"] = time.monotonic() - t1
    # --no-compile: pip byte-compiles every module of every distribution (torch's thousands) at install, more than
    # half of the install's CPU; the demo compiles the modules it imports as it imports them, as Python always does.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
           "--find-links", str(house)]
    _run([*pip, TORCH], timeout=900, cwd=empty)
    _run([*pip, f"{wheel}[trainer]"], timeout=1200, cwd=empty)
    timings["install"] = time.monotonic() - t0 - timings["wheelhouse"]
    env = _clean_env(home, venv)
    py = str(venv / "bin" / "python")

    where = _run([py, "-c", "import trainforge, torch; print(trainforge.__file__); print(torch.__version__); "
                  "print(trainforge.__version__)"], timeout=120, cwd=empty, env=env).stdout.split()
    assert Path(where[0]).is_relative_to(venv) and not Path(where[0]).is_relative_to(REPO), where
    assert where[1].startswith("2.13.0"), f"the venv's torch is {where[1]}, not the CPU 2.13.0"
    # The extras the user did not ask for are absent, and their commands say which extra to install. The quality
    # gate comes with the trainer: a job trains only on a gated version (the demo gates its dataset as it builds it).
    missing = _run([py, "-c", "import importlib.util as u; print([m for m in ('psycopg2', 'kubernetes', "
                    "'great_expectations') if u.find_spec(m)])"], timeout=60, cwd=empty, env=env).stdout.strip()
    assert missing == "['great_expectations']", missing
    gate = subprocess.run([py, "-c", "from trainforge.infra.servers import ServerStack; ServerStack().up()"],
                          cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert gate.returncode != 0 and "pip install 'trainforge[stack]'" in gate.stderr, gate.stderr[-2000:]

    t0 = time.monotonic()
    demo = subprocess.run([str(venv / "bin" / "trainforge"), "demo"], cwd=empty, env=env, capture_output=True,
                          text=True, timeout=900)
    timings["demo"] = time.monotonic() - t0
    assert demo.returncode == 0, f"demo -> {demo.returncode}\n{demo.stdout[-4000:]}\n{demo.stderr[-4000:]}"
    assert "demo finished" in demo.stdout, demo.stdout[-3000:]
    assert not [p.name for p in empty.iterdir()], "the demo wrote into the working folder instead of TRAINFORGE_HOME"

    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join([TRACE_HEADER, *(f"j{i},{i * 60},,{600 + 37 * i},{i % 4 + 1},1000,,team{i % 3},,,x"
                                                for i in range(30))]) + "\n")
    _run([str(venv / "bin" / "trainforge"), "simulate", "--trace", str(trace), "--json"], timeout=300, cwd=empty,
         env=env)
    # `automations install` and `up` read the shipped prefect.yaml (no checkout): its triggers and their specs load.
    subs = _run([py, "-c", "from trainforge.infra.servers import repo_root; from trainforge.infra.automations import "
                 "load_subscriptions; print([s.dataset for s in load_subscriptions(repo_root() / 'prefect.yaml')])"],
                timeout=120, cwd=empty, env=env).stdout.strip()
    assert subs == "['demo-text']", subs
    print("wheel install timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
