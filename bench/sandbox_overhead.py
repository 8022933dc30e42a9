"""What per-job network sandboxes cost (issue 23.4), on network-namespace test hosts (needs root, ip, nft).

1. Setting up: open a job's sandboxes on 2 hosts (namespaces, veths, every host's filter replaced) and close them,
   median and max over N jobs, with M other jobs already holding sandboxes (the filter grows with the jobs).
2. Moving bytes: a TCP stream of SIZE MB and a ping-pong of small messages between job A's sandboxes on two hosts
   (veth into the host, the host's forward chain, the cluster link, the other host's chain, veth out) against the
   baseline of the same between the two hosts themselves (cluster link only), best of 3 each, alternating.
   Veth pairs on one kernel: this measures the added hops and the filter's per-packet cost, not a real NIC.

  .venv/bin/python bench/sandbox_overhead.py [--jobs 10] [--others 30] [--mb 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.netns_hosts import netns_hosts  # noqa: E402
from trainforge.infra.network.netns import HostShell, SandboxNetwork  # noqa: E402
from trainforge.infra.network.sandbox import Host, NetworkLayout  # noqa: E402

SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", int(sys.argv[1]))); s.settimeout(60)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mode = sys.argv[2]
if mode == "stream":
    while c.recv(1 << 20): pass
else:
    while (m := c.recv(64)): c.sendall(m)
"""
CLIENT = """
import json, socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mode, n = sys.argv[3], int(sys.argv[4])
t = time.perf_counter()
if mode == "stream":
    buf = b"x" * (1 << 20)
    for _ in range(n): c.sendall(buf)
    c.shutdown(socket.SHUT_WR); c.recv(1)
else:
    for _ in range(n):
        c.sendall(b"p" * 32); c.recv(64)
print(json.dumps(time.perf_counter() - t))
"""


def transfer(server_prefix: list[str], client_prefix: list[str], address: str, mode: str, n: int) -> float:
    srv = subprocess.Popen([*server_prefix, sys.executable, "-c", SERVER, "29700", mode])
    time.sleep(0.4)
    try:
        out = subprocess.run([*client_prefix, sys.executable, "-c", CLIENT, address, "29700", mode, str(n)],
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return float(json.loads(out))
    finally:
        srv.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--others", type=int, default=30)
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--pings", type=int, default=5000)
    args = ap.parse_args()
    with netns_hosts(2) as rig:
        h1, h2 = rig.names
        net = SandboxNetwork(NetworkLayout([Host(h, rig.addresses[h]) for h in rig.names]),
                             HostShell(rig.runner_template))
        net.prepare()
        try:
            for i in range(args.others):
                net.open(f"other-{i}", [h1, h2])
            opens, closes = [], []
            for i in range(args.jobs):
                t = time.perf_counter()
                net.open(f"probe-{i}", [h1, h2])
                opens.append(time.perf_counter() - t)
                t = time.perf_counter()
                net.close(f"probe-{i}")
                closes.append(time.perf_counter() - t)
            print(f"sandboxes for a 2-host job, {args.others} other jobs present ({args.jobs} jobs): "
                  f"open median {statistics.median(opens) * 1e3:.0f} ms / max {max(opens) * 1e3:.0f} ms, "
                  f"close median {statistics.median(closes) * 1e3:.0f} ms / max {max(closes) * 1e3:.0f} ms")

            a = net.open("job-a", [h1, h2])
            host = [["ip", "netns", "exec", rig.netns(h)] for h in (h1, h2)]
            box = [net.exec_prefix(a[h]) for h in (h1, h2)]
            for mode, n, unit in (("stream", args.mb, "MB/s"), ("pingpong", args.pings, "us/round trip")):
                base, sand = [], []
                for _ in range(3):
                    base.append(transfer(host[1], host[0], rig.addresses[h2], mode, n))
                    sand.append(transfer(box[1], box[0], a[h2].address, mode, n))
                b, s = min(base), min(sand)
                rs, rb = (n / s, n / b) if mode == "stream" else (s / n * 1e6, b / n * 1e6)
                print(f"{mode}: sandbox to sandbox {rs:.0f} {unit} vs host to host (baseline) "
                      f"{rb:.0f} {unit}: time ratio {s / b:.2f} (best of 3, alternating)")
        finally:
            for job in net.layout.jobs():
                net.close(job)


if __name__ == "__main__":
    main()
