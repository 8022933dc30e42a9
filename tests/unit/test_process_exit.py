"""A worker leaves through trainer/process_exit.py: every exit step a job's files depend on runs, the teardown of
the modules' objects does not. A real child process under each CPython the project supports (3.11+), since the
module calls CPython's private exit steps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import trainforge.trainer.process_exit as process_exit

CHILD = textwrap.dedent("""
    import atexit, importlib.util, logging, logging.handlers, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    out = Path(sys.argv[2])
    spec = importlib.util.spec_from_file_location("process_exit", sys.argv[1])
    process_exit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(process_exit)

    def late(name):
        time.sleep(0.3)
        (out / name).write_text("done")

    threading.Thread(target=late, args=("thread",)).start()  # non-daemon: waited for
    pool = ThreadPoolExecutor(1)
    pool.submit(late, "executor")  # never shut down: joined as the interpreter's exit would
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    target = logging.FileHandler(out / "log.txt")
    buffered = logging.handlers.MemoryHandler(capacity=100, target=target)  # written only when flushed
    logging.getLogger("job").addHandler(buffered)
    logging.getLogger("job").warning("the last line")

    class Teardown:
        def __del__(self):
            (out / "teardown").write_text("ran")

    keep = Teardown()  # a module global: freed only by the interpreter's teardown
    sys.stdout.write("buffered, not flushed")
    process_exit.exit_now(3)
""")


def interpreters() -> list[str]:
    """This one, and 3.12 and 3.13 where the machine has them (pyenv's versions first: its shims on PATH answer
    "command not found" for a version not selected)."""
    found = [sys.executable]
    for version in ("3.12", "3.13"):
        candidates = [*map(str, sorted(Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))),
                      shutil.which(f"python{version}")]
        found += [path for path in candidates if path and _runs(path)][:1]
    return found


def _runs(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.parametrize("python", interpreters())
def test_exit_now_runs_what_the_job_needs_and_skips_the_teardown(python: str, tmp_path: Path) -> None:
    done = subprocess.run([python, "-c", CHILD, process_exit.__file__, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, not flushed"
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "executor").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "the last line\n"
    assert not (tmp_path / "teardown").exists()  # what it saves: the interpreter's teardown did not run
