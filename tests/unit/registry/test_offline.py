"""registry/offline.py: a winding-down job's offline evaluations and exports are stopped, not waited for.

Each test runs both ways an offline request runs: `plain`, a process of its own (`python -m
trainforge.trainer.offline`, here a script in its place), and `warm`, a child the warm starter forks
(trainer/offline_zygote.py, here serving the same script)."""

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


ZYGOTE_SHIM = ("import signal, sys\n"
               "from trainforge._linux import die_with_parent\n"
               "from trainforge.trainer.offline_zygote import serve\n"
               "die_with_parent(signal.SIGKILL)  # as the starter's main does\n"
               "code = sys.argv[1]\n"
               "sys.exit(serve(lambda args: exec(code, {'__name__': '__main__'}) or 0))\n")


@pytest.fixture(params=["plain", "warm"], autouse=True)
def mode(request, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(offline.WARM_ENV, "1" if request.param == "warm" else "0")
    yield request.param
    offline.close_warm_starters()  # the next test's script is another starter's


def _script(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    offline.close_warm_starters()
    monkeypatch.setattr(offline, "offline_argv", lambda args: [sys.executable, "-c", code])
    monkeypatch.setattr(offline, "zygote_argv", lambda: [sys.executable, "-c", ZYGOTE_SHIM, code])


def _evaluate_in_thread() -> tuple[threading.Thread, list[BaseException]]:
    """An evaluation of JOB running on a thread, and what it raised (once the thread ended)."""
    raised: list[BaseException] = []

    def evaluate() -> None:
        try:
            run_offline(JOB, ["evaluate"], 120, {})
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=evaluate)
    thread.start()
    return thread, raised


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
    thread, raised = _evaluate_in_thread()
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



def test_a_wind_down_kills_what_the_model_code_started_too(monkeypatch, tmp_path):
    """The offline process runs the user's model code: a process it started (same session) goes with it, and one
    holding its output pipes does not keep the wind-down waiting."""
    pid_file = tmp_path / "child"
    _script(monkeypatch, "import subprocess, sys, time\n"
                         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                         f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
                         "time.sleep(60)\n")
    thread, raised = _evaluate_in_thread()
    deadline = time.monotonic() + 20
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the offline process never started its child"
        time.sleep(0.02)
    child = int(pid_file.read_text())
    t0 = time.monotonic()
    with stopped(JOB):
        thread.join(20)
    assert not thread.is_alive() and time.monotonic() - t0 < 10
    assert len(raised) == 1 and isinstance(raised[0], OfflineStopped), raised
    deadline = time.monotonic() + 10
    while _alive(child):
        assert time.monotonic() < deadline, "the model code's child outlived the wind-down"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_warm_starter_killed_mid_request_fails_that_request_and_the_next_one_gets_a_new_one(monkeypatch, mode):
    if mode != "warm":
        pytest.skip("the warm starter's own failure")
    _script(monkeypatch, "import time; time.sleep(60)")
    thread, raised = _evaluate_in_thread()
    _wait_running(JOB)
    [zygote] = offline._ZYGOTES.values()
    [child] = offline._RUNNING[JOB]
    zygote.proc.kill()
    thread.join(20)
    assert not thread.is_alive() and len(raised) == 1
    assert "offline evaluate failed (exit -9)" in str(raised[0])
    deadline = time.monotonic() + 10
    while _alive(child.pid):  # it died with its starter (PR_SET_PDEATHSIG)
        assert time.monotonic() < deadline, "the child outlived its warm starter"
        time.sleep(0.05)
    monkeypatch.setattr(offline, "zygote_argv", lambda: [sys.executable, "-c", ZYGOTE_SHIM, "print('{\"ok\": 1}')"])
    assert run_offline(JOB, ["evaluate"], 30, {}) == {"ok": 1}
    assert offline._ZYGOTES and zygote not in offline._ZYGOTES.values()


def test_each_warm_child_gets_its_own_environment_and_folder(monkeypatch, mode, tmp_path):
    _script(monkeypatch, "import json, os; print(json.dumps({'x': os.environ.get('X'), 'cwd': os.getcwd()}))")
    monkeypatch.chdir(tmp_path)
    assert run_offline(JOB, ["evaluate"], 30, {"X": "1"}) == {"x": "1", "cwd": str(tmp_path)}
    assert run_offline(JOB, ["evaluate"], 30, {"X": "2"}) == {"x": "2", "cwd": str(tmp_path)}
    if mode == "warm":  # one starter per environment, the other closed once idle
        assert len(offline._ZYGOTES) == 1


def test_the_warm_starter_outlives_the_thread_that_first_asked_for_it(monkeypatch, mode):
    """Its PR_SET_PDEATHSIG follows the thread that started it: a task runner's pool thread may end before the flow."""
    if mode != "warm":
        pytest.skip("the warm starter's own lifetime")
    _script(monkeypatch, "print('{\"n\": 1}')")
    thread, raised = _evaluate_in_thread()
    thread.join(30)
    assert not raised
    [zygote] = offline._ZYGOTES.values()
    with pytest.raises(subprocess.TimeoutExpired):  # the asking thread is gone: no parent-death signal comes
        zygote.proc.wait(timeout=1.0)
    assert not zygote.dead
    assert run_offline(JOB, ["evaluate"], 30, {}) == {"n": 1}
    assert list(offline._ZYGOTES.values()) == [zygote]
