"""Applies a `NetworkLayout` on the hosts: network namespaces, veth pairs, routes and the nftables table.

Commands reach a host through a runner template, `ssh {host} {command}` by default (how the many-host launch
starts its agents); the network-namespace test hosts use `ip netns exec {host} sh -c {command}`. Every command
is idempotent where the kernel allows (`ip route replace`, the table replaced as a whole), so re-applying after
a control-plane restart converges instead of failing.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from trainforge.infra.network.sandbox import SANDBOX_LINK, NetworkLayout, Sandbox

DEFAULT_RUNNER = "ssh {host} {command}"
COMMAND_TIMEOUT_S = 30.0


class HostCommandError(RuntimeError):
    """A network command failed on a host: names the host, the command and what it printed."""


@dataclass
class HostShell:
    """Runs a shell command on a host through the runner template."""

    template: str = DEFAULT_RUNNER
    timeout_s: float = COMMAND_TIMEOUT_S

    def run(self, host: str, command: str, *, stdin: str | None = None, check: bool = True) -> str:
        argv = [part.format(host=host, command=command) for part in shlex.split(self.template)]
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise HostCommandError(f"host {host}: `{command}` did not finish in {self.timeout_s:.0f} s") from exc
        if check and done.returncode != 0:
            raise HostCommandError(f"host {host}: `{command}` failed (exit {done.returncode}): "
                                   f"{(done.stderr or done.stdout).strip()[-400:]}")
        return done.stdout


@dataclass
class SandboxNetwork:
    """The layout (what should be) and the shell (how to make it so)."""

    layout: NetworkLayout
    shell: HostShell

    def prepare(self) -> None:
        """Once per host: forwarding on, routes to the other hosts' sandboxes, the (empty) filter."""
        for host in self.layout.hosts:
            cmds = ["sysctl -qw net.ipv4.ip_forward=1"]
            cmds += [f"ip route replace {dest} via {via}" for dest, via in self.layout.routes(host.name)]
            self.shell.run(host.name, " && ".join(cmds))
            self._apply_ruleset(host.name)

    def open(self, job: str, hosts: Sequence[str]) -> dict[str, Sandbox]:
        """Sandboxes for `job` on `hosts` (new ones made), then every host's filter updated: a job's address set
        is on every host, so the filter is in place before the first worker starts."""
        before = set(self.layout.sandboxes(job))
        boxes = self.layout.open(job, list(hosts))
        new = [box for host, box in boxes.items() if host not in before]
        try:
            for box in new:
                self._create(box)
            self._apply_all()
        except Exception:
            # Nothing half-made stays: the new sandboxes go (a partly created one too: removal tolerates
            # missing parts), the layout forgets them, and the filters go back to what they were.
            for box in new:
                self._remove(box)
            self.layout.shrink(job, [box.host for box in new])
            with contextlib.suppress(HostCommandError):
                self._apply_all()
            raise
        return boxes

    def shrink(self, job: str, hosts: Sequence[str]) -> None:
        for box in self.layout.shrink(job, list(hosts)):
            self._remove(box)
        self._apply_all()

    def close(self, job: str) -> None:
        """The job ended: its sandboxes go (killing what still runs in them first) and its set leaves every
        host's filter."""
        for box in self.layout.close(job):
            self._remove(box)
        self._apply_all()

    def exec_prefix(self, box: Sandbox) -> list[str]:
        """What to put before a command for it to run inside the sandbox, on its host."""
        return ["ip", "netns", "exec", box.netns]

    # -- commands ---------------------------------------------------------------------------------------------
    def _create(self, box: Sandbox) -> None:
        inside = f"ip netns exec {box.netns}"
        self.shell.run(box.host, " && ".join([
            f"ip netns add {box.netns}",
            f"ip link add {box.host_link} type veth peer name {SANDBOX_LINK} netns {box.netns}",
            f"ip addr add {box.gateway}/{box.prefix_len} dev {box.host_link}",
            f"ip link set {box.host_link} up",
            f"{inside} ip link set lo up",
            f"{inside} ip addr add {box.address}/{box.prefix_len} dev {SANDBOX_LINK}",
            f"{inside} ip link set {SANDBOX_LINK} up",
            f"{inside} ip route add default via {box.gateway}",
        ]))

    def _remove(self, box: Sandbox) -> None:
        # Processes left in the namespace would keep it (and its addresses) alive after `ip netns del`.
        self.shell.run(box.host, f"ip netns pids {box.netns} 2>/dev/null | xargs -r kill -9; "
                                 f"ip link del {box.host_link} 2>/dev/null; ip netns del {box.netns} 2>/dev/null; true",
                       check=False)

    def _apply_all(self) -> None:
        for host in self.layout.hosts:
            self._apply_ruleset(host.name)

    def _apply_ruleset(self, host: str) -> None:
        self.shell.run(host, "nft -f -", stdin=self.layout.ruleset(host))
