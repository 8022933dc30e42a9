"""Leaving a process that imported torch without tearing its interpreter down.

A worker (or an offline evaluation or export) ends having imported torch, DCP and pyarrow. The interpreter's own
exit then frees every module's objects one at a time. That costs about 0.6 s of CPU in a process alone. At a
segment's end, 6 ranks on 2 cores took 3 s from their last `atexit` hook to their exit (stop 54's trace). The
segment's end waits that long for nothing: the job's files are closed and its last checkpoint committed before
the worker returns (`engine.close()`).

`exit_now` does the parts of the interpreter's exit that can matter to a job, in the interpreter's own order:
 1. join the non-daemon threads (an executor's, woken by concurrent.futures' own exit hook);
 2. run the `atexit` hooks (`logging.shutdown` flushes the handlers);
 3. flush stdout and stderr.
Then it leaves with `os._exit`. Both calls in 1 and 2 are CPython's private ones, used as `Py_FinalizeEx` uses
them; this module is the one place that knows it (tests/unit/test_process_exit.py runs it under each Python the
project supports)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Exit with `code` as a normal exit would, minus the teardown of the modules' objects."""
    shutdown = getattr(threading, "_shutdown", None)
    if threading.current_thread() is threading.main_thread() and shutdown is not None:
        shutdown()  # what the interpreter's exit does first: wait for every non-daemon thread
    getattr(atexit, "_run_exitfuncs", lambda: None)()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken pipe: what was left to say is lost, which CPython reports as 120
            code = code or 120
    os._exit(code)
