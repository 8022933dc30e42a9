"""The `hosts` backend: a gang's nodes on the machines of the cluster description, one node agent each.

The launch itself is built elsewhere (infra/launch.py `gang_launch`: pure); this module only runs it. For each node
the runner template (`ssh {host} {command}` by default; the tests' network-namespace hosts use `nsenter`) starts
`python -m trainforge.infra.backends.node_agent` on the host, which reads its `NodeProgram` from stdin and keeps
stdin open as the node's lease (infra/backends/node_agent.py). The runner's process on this host is the handle:

- start: every node's agent is started at once, fetches the job's inputs (within the launcher's
  `inputs_timeout_s`) and reports `ready` within `start_timeout_s` otherwise; then all are told `go` (with the first
  node's rendezvous port) and must report `started` within `start_timeout_s`. A host that does not (unreachable, no
  such interpreter, a refused login, the store out of its reach) stops every agent already started and raises
  `HostUnreachable` naming the host and what its runner printed; an input missing from the store raises
  `InputsUnavailable`, blaming no host; the job's cancel while the nodes fetch raises `StartCancelled`.
- cut: each agent probes its peers and reports the ones it cannot reach (node_agent.py `probe`); `cut` turns the
  reports into the cut between the gang's hosts (plan/reach.py), once the channel heard every host after the first
  failed probe (a host that went silent there is a lost host, not a cut).
- poll: a node's exit code comes from its agent's `exit` line; a runner that ended without one lost its node
  (the host or the connection went away), reported as killed (`killed_nodes`), as a dead local agent is.
- stop: `stop <grace>` down each node's stdin, then the runner is killed, which closes the node's stdin: the agent
  stops whatever is left (node_agent.py: within ORPHAN_GRACE_S + SIDECAR_STOP_S).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainforge.infra.backends.local import gang_exit_code
from trainforge.infra.backends.node_agent import NodeProgram
from trainforge.infra.backends.node_logs import UPLOAD_TIMEOUT_S
from trainforge.infra.backends.reach_probe import format_peers
from trainforge.plan.reach import Cut, find_cut

AGENT_MODULE = "trainforge.infra.backends.node_agent"
LOST = -int(signal.SIGKILL)
"""The exit code of a node whose runner ended without its agent's exit line: the node was lost."""


class StartCancelled(RuntimeError):
    """The job was cancelled while its gang started: every agent already started was stopped."""


class InputsUnavailable(RuntimeError):
    """A node could not fetch the job's inputs because one is missing or changed in the store: every node would
    fail the same way, so no host is to blame."""


class HostUnreachable(RuntimeError):
    """A node's agent did not start on its host: names the host, the address and what the runner printed."""

    def __init__(self, host: str, message: str):
        super().__init__(message)
        self.host = host


def runner_command(template: str, host: str, argv: list[str]) -> list[str]:
    """The local command that runs `argv` on `host`: the template split like a shell would, `{host}` replaced by the
    host's name, and `{command}` by `exec` + argv shell-quoted as one word (ssh hands it to the remote login shell,
    `sh -c` to a local one; `exec` makes the agent the shell's own process, so a signal to it reaches the agent),
    or a word `{argv}` by argv's words themselves (for `sudo`, `docker exec`: programs that take a command)."""
    command = "exec " + shlex.join(argv)
    out: list[str] = []
    for part in shlex.split(template):
        if part == "{argv}":
            out.extend(argv)
        else:
            out.append(part.replace("{host}", host).replace("{command}", command))
    return out


def agent_command(python: str) -> list[str]:
    return [python, "-m", AGENT_MODULE]


REMOVE_TIMEOUT_S = 30.0
"""How long the removal of a finished job's folders may take on all its hosts together (a host that does not answer
keeps them: the next agent there sweeps them by age)."""


def remove_job_folders(runner: str, python: str, work_dir: str, job_id: str, hosts: list[str],
                       timeout_s: float = REMOVE_TIMEOUT_S) -> dict[str, str]:
    """A finished job's folders removed on each host, through the runner, all hosts at once: each host's outcome
    (`removed`, `absent`, `in use`: an agent of the job still runs there) or what went wrong."""
    procs: dict[str, subprocess.Popen[str]] = {}
    out: dict[str, str] = {}
    for host in hosts:
        argv = runner_command(runner, host, [python, "-m", "trainforge.infra.backends.node_folders", "remove",
                                             "--work-dir", work_dir, "--job", job_id, "--node", host])
        try:
            procs[host] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as exc:
            out[host] = f"its runner could not be started: {exc}"
    deadline = time.monotonic() + timeout_s
    for host, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            # bounded: a runner's child outside its group (an ssh ControlPersist master) may keep the pipes open
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            out[host] = f"no answer within {timeout_s:.0f} s"
            continue
        try:
            answer = json.loads(stdout.strip().splitlines()[-1])
            out[host] = answer.get("outcome") or answer.get("error") or "no outcome"
        except (IndexError, ValueError, AttributeError):
            tail = " ".join(stderr.strip().splitlines()[-3:])
            out[host] = f"its runner exited {proc.returncode}: {tail or 'nothing said'}"
    return out


@dataclass
class RemoteNode:
    """One node: its program and the runner process that carries it to the host."""

    host: str
    address: str
    argv: list[str]
    program: NodeProgram
    log: Path
    """The runner's own output on this host (ssh's errors, the agent's stderr)."""
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    started: threading.Event = field(default_factory=threading.Event, init=False)
    ready: threading.Event = field(default_factory=threading.Event, init=False)
    """Its agent has its inputs and waits for `go` (a `hold` program)."""
    fetching_since: float | None = field(default=None, init=False)
    """When its agent reported it was fetching the job's inputs (time.monotonic)."""
    exit_code: int | None = field(default=None, init=False)
    error: str | None = field(default=None, init=False)
    inputs_error: bool = field(default=False, init=False)
    """The error is the job's inputs' (missing or changed in the store), not this host's."""
    _reader: threading.Thread | None = field(default=None, init=False)

    port: int | None = field(default=None, init=False)
    """The rendezvous port of the gang: the one the first node's agent picked (when the launcher names none), which
    every other node is given in its `go` line and reports in `started`."""
    probe_port: int | None = field(default=None, init=False)
    """The port the node's agent probes are answered on (its `ready` report; reach_probe.py)."""
    unreachable: frozenset[str] = field(default=frozenset(), init=False)
    """The gang peers the node's agent last reported it cannot reach (its `reach` reports)."""
    failing_since: dict[str, float] = field(default_factory=dict, init=False)
    """For each of those: when its first failed probe began (this host's time.monotonic)."""

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                             start_new_session=True)
        except OSError as exc:  # no such runner (ssh, nsenter not installed)
            self.error = f"its runner `{self.argv[0]}` could not be started: {exc}"
            return
        # Sent and read on a thread of its own: a runner that never reads (a host that does not answer) must not
        # block the start past its timeout.
        self._reader = threading.Thread(target=self._talk, name=f"node-agent-{self.host}", daemon=True)
        self._reader.start()

    def _talk(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(self.program.to_line().encode())
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:  # the runner is already gone (refused at once), or closed by a stop
            self.error = self.error or f"the runner ended before the program was sent ({exc})"
        for raw in self.proc.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue  # a login banner or the like: the protocol is JSON lines only
            if not isinstance(message, dict):
                continue
            if "started" in message:
                self.port = self.port or (message["started"] or {}).get("port")
                self.started.set()
            elif "ready" in message:
                self.port = (message["ready"] or {}).get("port")
                self.probe_port = (message["ready"] or {}).get("probe_port")
                self.ready.set()
            elif "reach" in message:
                self._reached(message["reach"] or {})
            elif "fetching" in message:
                self.fetching_since = time.monotonic()
            elif "exit" in message:
                self.exit_code = int(message["exit"])
            elif "error" in message:
                self.inputs_error = bool(message.get("inputs"))  # first: a reader of `error` reads both
                self.error = str(message["error"])

    def _reached(self, report: dict) -> None:
        now = time.monotonic()
        down = frozenset(str(p) for p in report.get("unreachable") or ())
        failing = report.get("failing_s") or {}
        self.failing_since = {p: self.failing_since.get(p, now - float(failing.get(p, 0.0))) for p in down}
        self.unreachable = down

    def poll(self) -> int | None:
        """The node's exit code: its agent's, or LOST when the runner ended without one; None while it runs."""
        if self.proc is None:  # never started
            return LOST
        if self.proc.poll() is None:
            return None
        if self._reader is not None:
            self._reader.join(timeout=2)  # the exit line may still be in the pipe
        return self.exit_code if self.exit_code is not None else LOST

    def send(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()

    def close(self, wait_s: float) -> None:
        """Close the node's stdin (its agent stops what is left), wait up to wait_s, then kill the runner."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)

    def tail(self, n: int = 10) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


@dataclass
class HostsGang:
    """A gang across machines (the same interface as the local backend's LocalMultiNodeGang)."""

    nodes: list[RemoteNode]
    start_timeout_s: float = 60.0
    inputs_timeout_s: float = 3600.0
    """How long a node may fetch the job's inputs, from its agent's `fetching` report (launcher.inputs_timeout_s)."""
    stop_wait_s: float = 30.0 + UPLOAD_TIMEOUT_S
    """How long a node's agent has, past the grace, to stop its processes and report (node_agent.py: SIGKILL 5 s
    after the grace, the sidecar's 15 s, the reaping of what is left, then its logs' upload, node_logs.py)."""
    lost: Callable[[], frozenset[str]] = frozenset
    """The nodes known lost (the supervisor's channel): a stop does not wait for them, their runner is ended at
    once (a host behind a broken link cannot answer; fencing it is the network layer's)."""

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start every node's agent at once; each fetches the job's inputs and reports `ready` (the first one with
        the rendezvous port it picked); then `go` to all, and each starts torchrun. On any failure (or an interrupt)
        stop every agent already started before raising: `HostUnreachable` naming the host, `InputsUnavailable`
        when an input is missing from the store (the job's, not a host's), `StartCancelled` once `should_stop()`
        (the job's cancel, polled while the nodes fetch)."""
        try:
            deadline = time.monotonic() + self.start_timeout_s
            for node in self.nodes:  # with peers, each agent measures which of them it reaches (`cut`)
                node.program = dataclasses.replace(node.program, hold=True, probe=len(self.nodes) > 1)
                node.start()
            self._wait_all(lambda node: node.ready, deadline, should_stop)
            first = self.nodes[0]
            if first.program.pick_port and first.port is None:
                raise HostUnreachable(first.host, f"host {first.host} ({first.address}): its node agent did "
                                                  "not report the rendezvous port it picked")
            if should_stop():  # the last moment nothing has started anywhere
                raise StartCancelled("the job was cancelled while its nodes started")
            peers = format_peers({n.host: (n.address, n.probe_port) for n in self.nodes if n.probe_port})
            go = f"go {first.port if first.program.pick_port else 0} {peers}".rstrip() + "\n"
            for node in self.nodes:
                node.send(go)
            self._wait_all(lambda node: node.started, time.monotonic() + self.start_timeout_s, should_stop)
        except BaseException:
            self.terminate(grace_s=1.0)
            raise

    def _wait_all(self, event: Callable[[RemoteNode], threading.Event], deadline: float,
                  should_stop: Callable[[], bool]) -> None:
        """Until every node's `event` (ready, started), watching all at once: the first node that failed (its
        runner ended, its agent's error) or ran past its limit (the start deadline; inputs_timeout_s from its
        `fetching` report) ends the wait, whatever the others are doing."""
        while True:
            waiting = [node for node in self.nodes if not event(node).is_set()]
            if not waiting:
                return
            if should_stop():
                raise StartCancelled("the job was cancelled while its nodes started")
            for node in waiting:
                self._check(node, deadline)
            event(waiting[0]).wait(timeout=0.1)

    def _check(self, node: RemoteNode, deadline: float) -> None:
        ended = node.proc is None or node.proc.poll() is not None
        if ended and node._reader is not None:
            node._reader.join(timeout=2)  # its last lines (an error) may still be in the pipe
        failed = ended or node.error is not None
        since = None if node.ready.is_set() else node.fetching_since  # still fetching, since then
        fetching = since is not None
        limit = deadline if since is None else since + self.inputs_timeout_s
        if not failed and time.monotonic() <= limit:
            return
        if node.error and node.inputs_error:
            raise InputsUnavailable(node.error)
        if node.error:
            why = node.error
        elif failed:
            why = f"its runner exited with code {node.proc.poll() if node.proc else '?'}"
        elif fetching:
            why = f"it did not fetch the job's inputs within {self.inputs_timeout_s:.0f} s (inputs_timeout_s)"
        else:
            why = f"no agent started within {self.start_timeout_s:.0f} s"
        tail = node.tail()
        raise HostUnreachable(node.host, f"host {node.host} ({node.address}) could not start its node agent: "
                                         f"{why}" + (f"\n--- its runner printed ---\n{tail}" if tail else ""))

    def cut(self, heard_at: Callable[[str], float | None]) -> Cut | None:
        """The cut between the gang's hosts its agents' probes show (plan/reach.py `find_cut`), once the channel
        heard every host of it after the first of those probes failed (`heard_at(host)`: when the host's last
        batch arrived, time.monotonic; None: never or lost): a host silent in the channel too is a lost host (the
        supervisor's), not a cut. None while there is no such cut."""
        reports = {n.host: n.unreachable for n in self.nodes if n.unreachable}
        if not reports:
            return None
        found = find_cut([n.host for n in self.nodes], reports)
        if found is None:
            return None
        first = min(t for n in self.nodes for t in n.failing_since.values())
        if any((heard_at(n.host) or float("-inf")) <= first for n in self.nodes):
            return None
        return found

    def poll(self) -> int | None:
        """None while any node runs and none failed; else the first failing node's code, or 0 when all finished."""
        return gang_exit_code([node.poll() for node in self.nodes])

    def killed_nodes(self) -> list[int]:
        """Nodes lost whole: the runner ended without the agent's exit line, or the agent died of a signal."""
        return [i for i, node in enumerate(self.nodes) if (code := node.poll()) is not None and code < 0]

    def stop_sidecar(self, timeout_s: float = 15.0 + UPLOAD_TIMEOUT_S) -> None:
        """Each node's agent stops its sidecar as soon as its torchrun agent ends, uploads its logs, then reports:
        wait for that."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while node.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)

    def terminate(self, grace_s: float = 5.0) -> None:
        lost = self.lost()
        for node in self.nodes:
            if node.host not in lost:
                node.send(f"stop {grace_s}\n")
        for node in self.nodes:
            node.close(wait_s=0.0 if node.host in lost else grace_s + self.stop_wait_s)

