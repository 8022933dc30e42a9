"""The local backend: the gang is a torchrun process group on this host.

torchrun runs in its own session so the whole tree (agent + workers) can be signalled at once: cancelling a
segment stops every worker within seconds and leaves no orphans holding ports or memory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainforge.infra.launch import LaunchSpec, torchrun_command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LocalGang:
    launch: LaunchSpec
    env: dict[str, str]
    agent_log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        self.agent_log.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.agent_log, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        try:
            self.proc = subprocess.Popen(torchrun_command(self.launch), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

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
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    return
                time.sleep(0.1)
        self.proc.wait(timeout=5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


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
        codes = [gang.poll() for gang in self.nodes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        return None if None in codes else 0

    @property
    def pid(self) -> int:
        return self.nodes[0].pid

    def killed_nodes(self) -> list[int]:
        """Nodes whose agent itself died of a signal (SIGKILL: the host went away), as opposed to an agent that
        exited with an error after one of its workers failed."""
        return [i for i, gang in enumerate(self.nodes) if (code := gang.poll()) is not None and code < 0]

    def terminate(self, grace_s: float = 5.0) -> None:
        for gang in self.nodes:
            gang.terminate(grace_s)
