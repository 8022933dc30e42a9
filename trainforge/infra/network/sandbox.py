"""Per-job network sandboxes: which addresses a job's workers get on each host and which packets may pass.

Why the network and not the rendezvous: the c10d TCPStore has no authentication, and neither rendezvous
backend removes it. torch's etcd backend can authenticate the *rendezvous* with client certificates, but since
torch 2.4 the agent of rank 0 still serves a plain TCPStore for the process group (the bootstrap store,
`dynamic_rendezvous.py` `_create_tcp_store_server`; opting out with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 moves
it into rank 0's worker, still a TCPStore), and gloo's and NCCL's socket transports accept any peer that
connects to their ports. A token in a key prefix stops only callers that play along. So each job's workers run
in their own network namespace on every host they use (a *sandbox*, the way a Kubernetes pod has its own
network), and the host's packet filter passes only:
  - sandbox to sandbox of the same job (any port: rendezvous, store, gloo/NCCL, whatever the job opens);
  - sandbox to the control plane's services, by address and port (object store, Prefect API), masqueraded;
  - replies to those.
Everything else that enters or leaves a sandbox is dropped: another job's sandbox, the host itself, any other
machine on the cluster network, and a sandbox that forges its source address (each sandbox's host-side link
accepts only its own address, so root inside a sandbox cannot pose as another job's worker).

Addresses: each host owns one /24 of `sandbox_cidr` (its `slot`), and each sandbox on it one /30 (the host
side's gateway address and the sandbox's), so a packet between two sandboxes, even on one host, is routed
through the host and meets the filter (a shared bridge would switch it past the filter). Hosts route the other
hosts' /24s through their cluster addresses (host-gateway routing, as flannel's host-gw mode does).

Everything here is pure: `NetworkLayout` allocates and renders; `netns.py` runs the commands on the hosts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass, field

DEFAULT_SANDBOX_CIDR = "10.201.0.0/16"
SANDBOXES_PER_HOST = 63  # /30s in a /24, the first (.0/30) left unused
NFT_TABLE = "trainforge"
HOST_LINK_PREFIX = "tfs"  # host-side veth of a sandbox: tfs<slot> (fits IFNAMSIZ)
SANDBOX_LINK = "eth0"  # inside the sandbox: what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name


class NetworkLayoutError(ValueError):
    """A placement the layout cannot give addresses to (a host it does not know, a host full of sandboxes)."""


@dataclass(frozen=True)
class Host:
    """A machine of the cluster description: its name and its address on the cluster network."""

    name: str
    address: str


@dataclass(frozen=True)
class Service:
    """A control-plane endpoint sandboxes may open connections to (the object store, the Prefect API)."""

    address: str  # an address or a CIDR
    port: int


@dataclass(frozen=True)
class Sandbox:
    """One job's network on one host."""

    job: str
    host: str
    netns: str
    host_link: str
    gateway: str  # the host side of the /30: the sandbox's default route
    address: str  # the sandbox's own address: torchrun's --local-addr, the rendezvous endpoint on node 0

    @property
    def prefix_len(self) -> int:
        return 30


def job_tag(job: str) -> str:
    """A short, stable name part for a job id (netns names and nft set names allow [a-z0-9_])."""
    readable = re.sub(r"[^a-z0-9]", "", job.lower())[:10]
    return f"{readable}{hashlib.sha256(job.encode()).hexdigest()[:6]}"


@dataclass
class NetworkLayout:
    """The sandboxes of every job on every host, and each host's packet filter. Deterministic: the same calls in
    the same order give the same addresses."""

    hosts: list[Host]
    services: list[Service] = field(default_factory=list)
    sandbox_cidr: str = DEFAULT_SANDBOX_CIDR
    _jobs: dict[str, dict[str, Sandbox]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.sandbox_cidr)
        if net.version != 4 or net.prefixlen > 16:
            raise NetworkLayoutError(f"sandbox_cidr {self.sandbox_cidr!r}: give an IPv4 network of /16 or wider "
                                     "(each host takes one /24 of it)")
        if len(self.hosts) > 256:
            raise NetworkLayoutError(f"{len(self.hosts)} hosts: a /16 sandbox_cidr gives at most 256 hosts a /24")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise NetworkLayoutError(f"hosts: duplicate names in {names}")
        self._net = net
        self._index = {h.name: i for i, h in enumerate(self.hosts)}

    # -- allocation -------------------------------------------------------------------------------------------
    def host_subnet(self, host: str) -> str:
        base = int(self._net.network_address) + (self._host_index(host) << 8)
        return f"{ipaddress.ip_address(base)}/24"

    def open(self, job: str, hosts: list[str]) -> dict[str, Sandbox]:
        """Give `job` a sandbox on each of `hosts` (a grow adds hosts; hosts it already has keep their sandbox)."""
        have = self._jobs.setdefault(job, {})
        for host in hosts:
            if host not in have:
                have[host] = self._allocate(job, host)
        return {h: have[h] for h in hosts}

    def shrink(self, job: str, hosts: list[str]) -> list[Sandbox]:
        """Take `job` off `hosts`; returns the sandboxes to remove."""
        have = self._jobs.get(job, {})
        gone = [have.pop(h) for h in hosts if h in have]
        if not have:
            self._jobs.pop(job, None)  # no sandbox left: no (empty, unrenderable) address set either
        return gone

    def close(self, job: str) -> list[Sandbox]:
        """The job ended: every sandbox of it, to remove."""
        return list(self._jobs.pop(job, {}).values())

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def sandboxes(self, job: str) -> dict[str, Sandbox]:
        return dict(self._jobs.get(job, {}))

    def on_host(self, host: str) -> list[Sandbox]:
        return [boxes[host] for boxes in self._jobs.values() if host in boxes]

    def _host_index(self, host: str) -> int:
        if host not in self._index:
            raise NetworkLayoutError(f"host {host!r} is not in the cluster description "
                                     f"(known: {', '.join(sorted(self._index))})")
        return self._index[host]

    def _allocate(self, job: str, host: str) -> Sandbox:
        used = {int(ipaddress.ip_address(s.gateway)) & 0xFF for s in self.on_host(host)}
        base = int(ipaddress.ip_network(self.host_subnet(host)).network_address)
        for slot in range(1, SANDBOXES_PER_HOST + 1):
            if (slot * 4 + 1) not in used:
                return Sandbox(job=job, host=host, netns=f"tf-{host}-{job_tag(job)}",
                               host_link=f"{HOST_LINK_PREFIX}{slot}",
                               gateway=str(ipaddress.ip_address(base + slot * 4 + 1)),
                               address=str(ipaddress.ip_address(base + slot * 4 + 2)))
        raise NetworkLayoutError(f"host {host!r} already holds {SANDBOXES_PER_HOST} job sandboxes: no address "
                                 "left in its /24")

    # -- rendering --------------------------------------------------------------------------------------------
    def routes(self, host: str) -> list[tuple[str, str]]:
        """(destination /24, via address) for every other host's sandboxes: host-gateway routing."""
        self._host_index(host)
        return [(self.host_subnet(h.name), h.address) for h in self.hosts if h.name != host]

    def ruleset(self, host: str) -> str:
        """The host's whole `inet trainforge` table, for `nft -f` (replaced atomically: the file deletes and
        recreates it in one transaction, so no packet sees half a policy)."""
        self._host_index(host)
        cidr = self.sandbox_cidr
        jobs = sorted(job for job, boxes in self._jobs.items() if boxes)
        lines = [f"table inet {NFT_TABLE}", f"delete table inet {NFT_TABLE}", f"table inet {NFT_TABLE} {{"]
        for job in jobs:
            members = sorted(s.address for s in self._jobs[job].values())
            lines += [f"  set job_{job_tag(job)} {{", "    type ipv4_addr",
                      f"    elements = {{ {', '.join(members)} }}", "  }"]
        lines += ["  chain forward {", "    type filter hook forward priority filter; policy accept;"]
        # Anti-spoofing first (before conntrack), so a forged source is dropped even mid-connection.
        for box in sorted(self.on_host(host), key=lambda s: s.host_link):
            lines.append(f'    iifname "{box.host_link}" ip saddr != {box.address} drop')
        lines += ["    ct state established,related accept",
                  f"    ip saddr {cidr} ip daddr {cidr} jump between_sandboxes"]
        for svc in self.services:
            lines.append(f"    ip saddr {cidr} ip daddr {svc.address} tcp dport {svc.port} accept")
        lines += [f"    ip saddr {cidr} drop", f"    ip daddr {cidr} drop", "  }",
                  "  chain between_sandboxes {"]
        for job in jobs:
            lines.append(f"    ip saddr @job_{job_tag(job)} ip daddr @job_{job_tag(job)} accept")
        lines += ["    drop", "  }",
                  # A sandbox reaches nothing on its own host except replies to connections the host opened.
                  "  chain input {", "    type filter hook input priority filter; policy accept;",
                  "    ct state established,related accept", f'    iifname "{HOST_LINK_PREFIX}*" drop', "  }",
                  "  chain postrouting {", "    type nat hook postrouting priority srcnat; policy accept;",
                  f"    ip saddr {cidr} ip daddr != {cidr} masquerade", "  }", "}"]
        return "\n".join(lines) + "\n"
