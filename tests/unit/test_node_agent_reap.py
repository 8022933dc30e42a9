"""What a node agent reaps as it ends (infra/backends/node_agent.py `_reap_all`): a child's own children, which
re-parent to the agent (its node's subreaper) only once the child is killed, are killed too, with no grace after a
stop. A real subreaper process, its child and the child's child in a session of its own (as torchrun starts
workers)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    from trainforge.infra.backends import node_agent

    node_agent.prctl(node_agent.PR_SET_CHILD_SUBREAPER, 1)
    # both ignore SIGTERM, as a worker blocked in a collective of a broken gang does: only SIGKILL ends them
    sleeper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    spawn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             f"p = subprocess.Popen([sys.executable, '-c', {sleeper!r}], start_new_session=True); "
             "print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    t0 = time.monotonic()
    node_agent._reap_all(grace_s=0.0)
    print(grandchild, round(time.monotonic() - t0, 2), node_agent.REAP_GRACE_S, node_agent._children(), flush=True)
""")


def test_a_killed_childs_own_children_are_killed_too_and_at_once_after_a_stop():
    done = subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    grandchild, took, grace, left = done.stdout.split(maxsplit=3)
    assert left.strip() == "[]"
    assert float(took) < float(grace)  # no SIGTERM grace spent on processes that ignore it: SIGKILL at once
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:  # reaped by the agent: gone
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{grandchild}")
