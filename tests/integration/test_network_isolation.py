"""Gangs only their own (issue 23.4), on network-namespace test hosts: a process of another job cannot join a gang's
rendezvous, read its store or reach its collective ports, while the gang itself trains across two hosts.

Three hosts; job A's gang is a real torchrun (c10d rendezvous, gloo) on hosts 1 and 2, job B has sandboxes on
hosts 2 and 3 (so B shares host 2 with A: the case a per-host firewall by address alone cannot tell apart).
The attacker is B's own process, and then the bare host 3 (any machine on the cluster network)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.netns_hosts import netns_hosts
from trainforge.infra.network.netns import HostShell, SandboxNetwork
from trainforge.infra.network.sandbox import NFT_TABLE, Host, NetworkLayout, Service

pytestmark = pytest.mark.slow  # network-namespace hosts and a torchrun gang: `make test`, not `make test-fast`

RDZV_PORT = 29400
GANG_TIMEOUT_S = 120

WORKER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)]); dist.all_reduce(t)
    open(f"{out}/ready-{rank}", "w").write(str(t.item()))
    deadline = time.time() + 100
    while not os.path.exists(f"{out}/release") and time.time() < deadline:
        time.sleep(0.1)
    t = torch.tensor([float(10 * (rank + 1))]); dist.all_reduce(t)
    open(f"{out}/done-{rank}", "w").write(str(t.item()))
    dist.destroy_process_group()
""")

# Runs inside a sandbox (or a host): tries every (address, port[, source]) at once; prints which connected.
PROBE = textwrap.dedent("""
    import json, socket, sys, threading
    from datetime import timedelta
    targets = json.loads(sys.argv[1]); result = {}
    def connect(key, addr, port, source):
        try:
            s = socket.create_connection((addr, port), timeout=3, source_address=(source, 0) if source else None)
            s.close(); result[key] = True
        except OSError:
            result[key] = False
    def store(key, addr, port):
        import torch.distributed as dist
        try:
            dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=3)).check(["probe"])
            result[key] = True
        except Exception:
            result[key] = False
    threads = []
    for key, (kind, addr, port, source) in targets.items():
        fn = store if kind == "store" else connect
        args = (key, addr, port) if kind == "store" else (key, addr, port, source)
        threads.append(threading.Thread(target=fn, args=args)); threads[-1].start()
    for t in threads: t.join(20)
    print(json.dumps(result))
""")


def _probe(prefix: list[str], targets: dict[str, tuple[str, str, int, str | None]]) -> dict[str, bool]:
    done = subprocess.run([*prefix, sys.executable, "-c", PROBE, json.dumps(targets)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _listening_ports(prefix: list[str]) -> list[int]:
    out = subprocess.run([*prefix, "ss", "-Htln"], capture_output=True, text=True, timeout=10, check=True).stdout
    return sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()})


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"a gang agent exited early with {proc.returncode}: "
                                     f"{proc.stdout.read() if proc.stdout else ''}")
        assert time.monotonic() < deadline, f"the gang did not get to {paths} in {timeout:.0f} s"
        time.sleep(0.2)


def _service(address: str) -> tuple[socket.socket, int]:
    """A control-plane stand-in on the bridge (the root namespace), where the object store listens in a
    deployment: sandboxes may connect to it."""
    srv = socket.create_server((address, 0))
    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


@pytest.mark.timeout(300)
def test_another_job_cannot_reach_a_gang_across_hosts(tmp_path: Path) -> None:
    with netns_hosts(3) as rig:
        h1, h2, h3 = rig.names
        service, service_port = _service(rig.bridge_address)
        layout = NetworkLayout([Host(h, rig.addresses[h]) for h in rig.names],
                               services=[Service(rig.bridge_address, service_port)])
        net = SandboxNetwork(layout, HostShell(rig.runner_template))
        agents: list[subprocess.Popen] = []
        try:
            net.prepare()
            a = net.open("team-a/job-1", [h1, h2])
            b = net.open("team-b/job-2", [h2, h3])
            assert {a[h2].address, b[h2].address} == {s.address for s in layout.on_host(h2)}

            script = tmp_path / "worker.py"
            script.write_text(WORKER)
            out = tmp_path / "out"
            out.mkdir()
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}
            for i, host in enumerate((h1, h2)):
                box = a[host]
                agents.append(subprocess.Popen(
                    [*net.exec_prefix(box), sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                     "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={a[h1].address}:{RDZV_PORT}",
                     "--rdzv-id=team-a-job-1", f"--local-addr={box.address}",
                     f"--rdzv-conf=is_host={'true' if i == 0 else 'false'}", "--max-restarts=0",
                     str(script), str(out)],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            _wait_for([out / "ready-0", out / "ready-1"], agents, GANG_TIMEOUT_S)
            assert (out / "ready-0").read_text() == "3.0"  # the gang did all-reduce across the two hosts

            # Everything job A listens on, on both hosts: the rendezvous store, the bootstrap store, gloo's pairs.
            ports = {host: _listening_ports(net.exec_prefix(a[host])) for host in (h1, h2)}
            assert RDZV_PORT in ports[h1] and ports[h2], ports  # h2: gloo's listening pair port(s)
            targets: dict[str, tuple[str, str, int, str | None]] = {
                "store": ("store", a[h1].address, RDZV_PORT, None),
                # Root in B's sandbox can give itself A's address: the host-side link accepts only B's own.
                "forged": ("tcp", a[h1].address, RDZV_PORT, a[h2].address),
            }
            for host in (h1, h2):
                for port in ports[host]:
                    targets[f"{host}:{port}"] = ("tcp", a[host].address, port, None)
            attacker = net.exec_prefix(b[h2])
            subprocess.run([*attacker, "ip", "addr", "add", f"{a[h2].address}/32", "dev", "eth0"], check=True,
                           timeout=10)

            from_b = _probe(attacker, targets)
            assert not any(from_b.values()), f"job B's process reached job A: {from_b}"
            from_host = _probe(["ip", "netns", "exec", rig.netns(h3)],
                               {k: v for k, v in targets.items() if k != "forged"})
            assert not any(from_host.values()), f"a bare host of the cluster reached job A: {from_host}"

            # What stays open: A's own worker to its rendezvous, B to its own other host and to the services.
            own = _probe(net.exec_prefix(a[h2]), {"rdzv": ("tcp", a[h1].address, RDZV_PORT, None)})
            b_h3 = subprocess.Popen([*net.exec_prefix(b[h3]), sys.executable, "-c",
                                     "import socket,time;s=socket.create_server(('0.0.0.0',29500));"
                                     "s.settimeout(20);s.accept()"])
            deadline = time.monotonic() + 20  # bounded wait for B's listener, not a fixed sleep
            while 29500 not in _listening_ports(net.exec_prefix(b[h3])):
                assert time.monotonic() < deadline and b_h3.poll() is None, "B's listener did not start"
                time.sleep(0.05)
            b_own = _probe(net.exec_prefix(b[h3]), {"service": ("tcp", rig.bridge_address, service_port, None)})
            b_own |= _probe(["ip", "netns", "exec", b[h2].netns],
                            {"peer": ("tcp", b[h3].address, 29500, b[h2].address)})
            b_h3.wait(timeout=20)
            assert own == {"rdzv": True} and b_own == {"service": True, "peer": True}, (own, b_own)

            # The same probe without the filter connects: what stopped B above is the filter, nothing else.
            for host in rig.names:
                rig.run(host, "nft", "delete", "table", "inet", NFT_TABLE)
            unfiltered = _probe(attacker, {"store": targets["store"]})
            assert unfiltered == {"store": True}, unfiltered
            net.prepare()

            (out / "release").write_text("")
            for agent in agents:
                agent.wait(timeout=GANG_TIMEOUT_S)
                assert agent.returncode == 0, agent.stdout.read() if agent.stdout else ""
            assert [(out / f"done-{r}").read_text() for r in (0, 1)] == ["30.0", "30.0"]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
            net.close("team-a/job-1")
            net.close("team-b/job-2")
            service.close()
            left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert f"tf-t{rig.token}h" not in left, f"sandboxes left behind: {left}"
