"""The local backend: the gang is a torchrun process group on this host.

torchrun runs in its own session so the whole tree (agent + workers) can be signalled at once: cancelling a
segment stops every worker within seconds and leaves no orphans holding ports or memory.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainforge._optional import ensure_installed
from trainforge.infra.launch import LaunchSpec, torchrun_command
from trainforge.infra.procs import stop_group, stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SidecarSpec:
    """The node's channel publisher (trainforge/infra/backends/sidecar.py): where it writes and its ranks' socket."""

    store_url: str
    root: str
    node: str
    socket: str
    flush_interval_s: float = 0.5
    python: str = sys.executable

    def command(self) -> list[str]:
        return [self.python, "-m", "trainforge.infra.backends.sidecar", "--store", self.store_url,
                "--root", self.root, "--node", self.node, "--socket", self.socket,
                "--flush-interval", str(self.flush_interval_s)]


@dataclass
class LocalGang:
    launch: LaunchSpec
    env: dict[str, str]
    agent_log: Path
    sidecar: SidecarSpec | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    sidecar_proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        if self.launch.python == sys.executable:  # the ranks run in this environment: it needs the trainer's torch
            ensure_installed("torch", purpose="training on this machine (the local backend's torchrun ranks)")
        self.agent_log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        if self.sidecar is not None:
            # Started first and in its own session: it outlives a rank's restart, and the ranks' first
            # datagrams wait in their client's buffer until it is up.
            env["TRAINFORGE_CHANNEL_SOCKET"] = self.sidecar.socket
            with open(self.agent_log.with_name(self.agent_log.stem + ".sidecar.log"), "ab") as slog:
                self.sidecar_proc = subprocess.Popen(self.sidecar.command(), env=env, stdout=slog,
                                                     stderr=subprocess.STDOUT, start_new_session=True)
        log = open(self.agent_log, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        try:
            self.proc = subprocess.Popen(torchrun_command(self.launch), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def stop_sidecar(self, timeout_s: float = 15.0) -> None:
        """Let the node's publisher write its last (closing) batch and exit; SIGKILL it past `timeout_s`."""
        proc, self.sidecar_proc = self.sidecar_proc, None
        stop_process(proc, timeout_s)

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, grace_s: float = 5.0) -> None:
        """SIGTERM the whole process group (agent and workers), then SIGKILL whatever is left after grace_s."""
        if self.proc is None:
            self.stop_sidecar()
            return
        try:
            self._terminate_agent(grace_s)
        finally:
            self.stop_sidecar()

    def _terminate_agent(self, grace_s: float) -> None:
        assert self.proc is not None
        stop_group(self.proc, grace_s, poll_s=0.1)


def gang_exit_code(codes: list[int | None]) -> int | None:
    """A gang's code from its nodes' (None: still running): the first failing node's, else None while any runs,
    else 0."""
    failed = [c for c in codes if c not in (None, 0)]
    if failed:
        return failed[0]
    return None if None in codes else 0


@dataclass
class LocalMultiNodeGang:
    """A multi-node gang emulated on this host: one torchrun agent per "node" (`--nnodes=N --node-rank=i`) sharing
    one static rendezvous, exactly how the agents of a real multi-node job meet. Node i runs global ranks
    i * nproc_per_node ... (i + 1) * nproc_per_node - 1, so losing one agent with its workers is losing a node."""

    nodes: list[LocalGang]

    def start(self) -> None:
        for gang in self.nodes:
            gang.start()

    def poll(self) -> int | None:
        """None while any node runs and none failed; else the first failing node's code (the survivors are
        stopped by `terminate`, after the supervisor has looked at them), or 0 when every node finished."""
        return gang_exit_code([gang.poll() for gang in self.nodes])

    @property
    def pid(self) -> int:
        return self.nodes[0].pid

    def killed_nodes(self) -> list[int]:
        """Nodes whose agent itself died of a signal (SIGKILL: the host went away), as opposed to an agent that
        exited with an error after one of its workers failed."""
        return [i for i, gang in enumerate(self.nodes) if (code := gang.poll()) is not None and code < 0]

    def stop_sidecar(self, timeout_s: float = 15.0) -> None:
        for gang in self.nodes:
            if gang.sidecar_proc is not None:
                gang.sidecar_proc.send_signal(signal.SIGTERM)  # all at once: they close concurrently
        for gang in self.nodes:
            gang.stop_sidecar(timeout_s)

    def terminate(self, grace_s: float = 5.0) -> None:
        for gang in self.nodes:
            gang.terminate(grace_s)
