"""A warm start for the offline evaluations and exports: imports the offline module once, forks a child for each.

`python -m trainforge.trainer.offline` spends 2.4 s of its 2.5 s on a 2-core host importing torch and the trainer
before a small model's evaluation; the demo's job runs four of them (an evaluation per checkpoint and the export),
three while its own workers train on the same cores. The flow's side (registry/offline.py) instead starts this
process once per environment: it imports the offline module, then for each request forks a child that is what
the plain process was (its own session, the request's environment, working folder, stdout and stderr files, the
same `main`), so a stop still kills one request's whole process group and nothing else.

Protocol, JSON lines: a request `{"id", "args", "env", "cwd", "stdout", "stderr"}` on stdin; the replies
`{"ready": true}` once imported, `{"id", "pid"}` once forked, `{"id", "exit": code}` when the child ended (negative:
killed by that signal). The zygote stays single-threaded, since a fork copies the locks other threads hold: it
polls stdin with `select` and reaps its children with `waitpid(WNOHANG)`. It ends when its stdin closes (the flow
ended) and dies with the flow (PR_SET_PDEATHSIG); each child dies with it in turn, so no evaluation outlives the
process that asked for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import traceback
from typing import Any

from trainforge._linux import die_with_parent


def _reply(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _child(request: dict[str, Any], run: Any) -> None:
    """In the forked child: become the plain offline process the request describes, run it, leave."""
    code = 1
    try:
        os.setsid()  # its own group: a stop kills what it started too
        die_with_parent(signal.SIGKILL)  # the zygote gone (the flow gone): nothing waits for this result
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # never the zygote's request pipe
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        code = int(run(list(request["args"])) or 0)
    except SystemExit as exc:  # argparse's errors, the offline module's own SystemExit("...")
        if isinstance(exc.code, int):
            code = exc.code
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve(run: Any) -> int:
    """Answer requests until stdin closes; `run(args) -> exit code` is what each child runs."""
    children: dict[int, int] = {}  # pid -> request id
    buffer = b""
    _reply({"ready": True})
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:  # the flow closed its end: it is done, or gone
                for pid in children:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                return 0
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                request = json.loads(line)
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()  # nothing buffered here is written twice by the child
                pid = os.fork()
                if pid == 0:
                    _child(request, run)
                children[pid] = request["id"]
                _reply({"id": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            rid = children.pop(pid, None)
            if rid is not None:
                _reply({"id": rid, "exit": os.waitstatus_to_exitcode(status)})


def main(argv: list[str] | None = None) -> int:
    """`python -m trainforge.trainer.offline_zygote [MODULE:FUNCTION]`: what each child runs (default: the offline
    module's `main`)."""
    die_with_parent(signal.SIGKILL)
    args = sys.argv[1:] if argv is None else argv
    module, _, name = (args[0] if args else "trainforge.trainer.offline:main").partition(":")
    run = getattr(__import__(module, fromlist=[name]), name)  # the warm part: torch, the trainer, the models
    return serve(run)


if __name__ == "__main__":
    sys.exit(main())
