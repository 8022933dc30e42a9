"""registry/offline.py: a winding-down job's offline evaluations and exports are stopped, not waited for."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from trainforge.registry import offline
from trainforge.registry.offline import OfflineStopped, refuse_if_stopped, run_offline, stopped

JOB = ("file:///store", "jobs/a")
OTHER = ("file:///store", "jobs/b")


def _script(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    monkeypatch.setattr(offline, "offline_argv", lambda args: [sys.executable, "-c", code])


def _wait_running(key: tuple[str, str], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not offline._RUNNING.get(key):
        assert time.monotonic() < deadline, "the offline process never started"
        time.sleep(0.02)


def test_the_result_is_the_last_stdout_line(monkeypatch):
    _script(monkeypatch, "print('loading'); print('{\"loss\": 1.5}')")
    assert run_offline(JOB, ["evaluate"], 30, {}) == {"loss": 1.5}
    assert not offline._RUNNING


def test_a_failure_says_which_and_its_stderr(monkeypatch):
    _script(monkeypatch, "import sys; sys.stderr.write('boom in the model\\n'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"offline export failed \(exit 3\):\nboom in the model"):
        run_offline(JOB, ["export"], 30, {})


def test_a_timeout_kills_the_process(monkeypatch):
    _script(monkeypatch, "import time; time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_offline(JOB, ["evaluate"], 0.5, {})
    assert time.monotonic() - t0 < 10
    assert not offline._RUNNING


def test_a_wind_down_kills_the_running_evaluation_and_refuses_new_ones(monkeypatch):
    _script(monkeypatch, "import time; time.sleep(60); print('{}')")
    raised: list[BaseException] = []

    def evaluate() -> None:
        try:
            run_offline(JOB, ["evaluate"], 120, {})
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=evaluate)
    thread.start()
    _wait_running(JOB)
    t0 = time.monotonic()
    with stopped(JOB):
        thread.join(20)
        assert not thread.is_alive() and time.monotonic() - t0 < 10, "the wind-down waited for the evaluation"
        assert len(raised) == 1 and isinstance(raised[0], OfflineStopped), raised
        assert "stopped: the job is ending" in str(raised[0])
        with pytest.raises(OfflineStopped, match="not started"):
            run_offline(JOB, ["export"], 30, {})
        with pytest.raises(OfflineStopped, match="offline evaluate not started"):
            refuse_if_stopped(JOB, "evaluate")
        # another job's evaluations are not this wind-down's business
        _script(monkeypatch, "print('{\"loss\": 2.0}')")
        assert run_offline(OTHER, ["evaluate"], 30, {}) == {"loss": 2.0}
    # the wind-down is over (a resume in this process): offline work runs again
    assert run_offline(JOB, ["evaluate"], 30, {}) == {"loss": 2.0}
    refuse_if_stopped(JOB, "evaluate")


def test_overlapping_wind_downs_of_one_job_end_with_the_last(monkeypatch):
    _script(monkeypatch, "print('{}')")
    with stopped(JOB):
        with stopped(JOB):
            pass
        with pytest.raises(OfflineStopped):
            run_offline(JOB, ["evaluate"], 30, {})
    assert run_offline(JOB, ["evaluate"], 30, {}) == {}

