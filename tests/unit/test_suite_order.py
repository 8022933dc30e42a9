"""The order of work `make test` hands xdist workers (tests/fixtures/suite.py): a module with a module-scoped fixture
runs on one worker as one unit, so its fixture (a trained job, a DeepSpeed set-up) is set up once, not once per test;
units go longest first by tests/durations.json.

A first version used xdist's own `loadgroup` with `xdist_group` marks, which pytest 9 ignores (xdist writes the group
into `item._nodeid`; pytest 9 reads `item._id`): every module fixture of the suite then ran once per test, and
nothing failed. This runs a real xdist session on a throwaway module and counts the set-ups.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.suite import _load_durations

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a nested pytest on 2 xdist workers: `make test`, not `make test-fast`


def test_a_module_fixture_is_set_up_once_when_its_tests_spread_over_workers(tmp_path: Path) -> None:
    setups = tmp_path / "setups.txt"
    (tmp_path / "test_shared.py").write_text(textwrap.dedent(f"""
        import os, time
        import pytest

        @pytest.fixture(scope="module")
        def trained():
            with open({str(setups)!r}, "a") as f:
                f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")
            return 1

        @pytest.mark.parametrize("i", range(6))
        def test_reads_it(trained, i):
            time.sleep(0.05)
            assert trained == 1

        @pytest.mark.parametrize("i", range(6))
        def test_alone(i):
            time.sleep(0.05)
    """))
    # A pytest of its own, not one of this run's xdist workers: run inside `make test`, this test's process carries
    # PYTEST_XDIST_WORKER, which would make the nested controller take itself for a worker.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.fixtures.suite",
                          "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "--rootdir", str(tmp_path),
                          str(tmp_path / "test_shared.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "12 passed" in run.stdout, run.stdout[-2000:]
    assert len(setups.read_text().split()) == 1, f"the module fixture was set up on {setups.read_text().split()}"


def test_the_durations_file_names_tests_that_exist() -> None:
    """tests/durations.json is refreshed from real runs (scripts/test-durations): most of its ids are collected
    today (a rename leaves a stale id, which only costs ordering, but a file of stale ids orders nothing)."""
    durations = _load_durations()
    assert len(durations) > 1000
    files = {nodeid.split("::")[0] for nodeid in durations}
    assert sum((ROOT / f).is_file() for f in files) >= 0.95 * len(files)
