"""The channel's cost and latency on a real S3 server: node publishers in real processes write to SeaweedFS (started
here, loopback only, telemetry off), the control side's real ChannelReader reads them.

Each node has `--ranks` ranks stepping at `--steps-per-s`; every rank sends one record per step (a metrics-sized
event stamped with its publish time) and beats once per flush. Latency is publish -> read (one host, one clock);
requests/s counts every S3 request of both sides (PUTs of batches, the publishers' command LISTs, the reader's
LISTs and GETs). The baseline, measured in the same run on the same server, is the scheme the issue rejects: one
object per rank per step, read by listing each rank's prefix.

Publishers run as threads in a few processes (`--procs`, default up to 8): 512 or 800 processes do not fit on a
small machine; each thread is a full NodePublisher with its own flush thread and its own seq.

    python bench/channel_bench.py                      # N = 8 and 64 nodes + the baseline at 8 (~1.5 min)
    python bench/channel_bench.py --big                # adds N = 512 and 200 jobs x 4 nodes (+ baseline at 64)
    python bench/channel_bench.py --nodes 512 --seconds 30
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainforge.contract.channel import (  # noqa: E402
    LEASE_TTL_S,
    ChannelReader,
    CommandWriter,
    NodePublisher,
    channel_root,
)
from trainforge.infra.storage.seaweedfs import SeaweedFSServer, _die_with_parent  # noqa: E402

PAD = "x" * 160  # a metrics event is ~200 bytes of JSON
BENCH_LEASE_S = 120.0  # long enough to cover starting 100 publishers per process on a loaded host; renewed every 10 s


# ---- the publisher processes --------------------------------------------------------------------------------


def _worker(spec: dict[str, Any]) -> None:
    from trainforge.infra.storage import open_store

    store = open_store(spec["store"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ranks, period = spec["ranks"], 1.0 / spec["steps_per_s"]
    started = time.monotonic()
    if spec["mode"] == "channel":
        pubs = [NodePublisher(store, root, node, flush_interval_s=spec["flush"], lease_ttl_s=BENCH_LEASE_S)
                for root, nodes in spec["jobs"] for node in nodes]
        with ThreadPoolExecutor(max_workers=16) as pool:  # each start is a LIST and a PUT: overlap them
            list(pool.map(NodePublisher.start, pubs))
        print(json.dumps({"event": "ready"}), flush=True)
        step, next_t = 0, time.monotonic()
        while not stop.is_set():
            for pub in pubs:
                for r in range(ranks):
                    pub.heartbeat(r, step=step)
                    pub.publish({"type": "rank_metrics", "rank": r, "step": step, "t_pub": time.time(), "pad": PAD})
            step += 1
            next_t = max(next_t + period, time.monotonic())
            stop.wait(max(0.0, next_t - time.monotonic()))
        with ThreadPoolExecutor(max_workers=16) as pool:  # each close is a last PUT: overlap them too
            list(pool.map(lambda p: p.close(timeout=5.0), pubs))
        s = [p.stats for p in pubs]
        requests = sum(x["batches"] + x["put_failures"] + x["polls"] + 2 for x in s)  # +2: start LIST, hello PUT
        failures = sum(x["put_failures"] for x in s)
    else:  # the baseline: one object per rank per step
        targets = [(root, node, r) for root, nodes in spec["jobs"] for node in nodes for r in range(ranks)]
        print(json.dumps({"event": "ready"}), flush=True)
        requests = failures = 0
        with ThreadPoolExecutor(max_workers=16) as pool:
            step, next_t = 0, time.monotonic()
            while not stop.is_set():
                def put(t: tuple[str, str, int], step: int = step) -> bool:
                    root, node, r = t
                    body = json.dumps({"type": "rank_metrics", "rank": r, "step": step, "t_pub": time.time(),
                                       "pad": PAD}).encode()
                    try:
                        store.put_bytes(f"{root}/naive/{node}/{r}/{step:012d}.json", body)
                        return True
                    except Exception:
                        return False

                ok = list(pool.map(put, targets))
                requests += len(ok)
                failures += ok.count(False)
                step += 1
                next_t = max(next_t + period, time.monotonic())
                stop.wait(max(0.0, next_t - time.monotonic()))
    print(json.dumps({"event": "stats", "requests": requests, "failures": failures,
                      "seconds": time.monotonic() - started}), flush=True)


class _Proc:
    def __init__(self, spec: dict[str, Any], env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, __file__, "_worker", json.dumps(spec)], env=env,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=_die_with_parent)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))  # queue.Empty past the deadline
            if msg.get("event") == event:
                return msg


# ---- the control side ---------------------------------------------------------------------------------------


class _NaiveReader:
    """The baseline's reader: LIST every rank's prefix after its last key, GET each new object."""

    def __init__(self, store: Any, root: str, nodes: list[str], ranks: int):
        self.store = store
        self.prefixes = [f"{root}/naive/{n}/{r}/" for n in nodes for r in range(ranks)]
        self.last = dict.fromkeys(self.prefixes, "")
        self.requests = 0

    def poll_records(self, pool: ThreadPoolExecutor) -> list[dict[str, Any]]:
        def one(prefix: str) -> tuple[int, list[dict[str, Any]]]:
            keys = self.store.list(prefix, start_after=self.last[prefix])
            out = [json.loads(self.store.get_bytes(k)) for k in keys]
            if keys:
                self.last[prefix] = keys[-1]
            return 1 + len(keys), out

        recs: list[dict[str, Any]] = []
        for n, out in pool.map(one, self.prefixes):
            self.requests += n
            recs += out
        return recs


def run_scenario(server: SeaweedFSServer, name: str, mode: str, jobs: int, nodes: int, args: argparse.Namespace,
                 ) -> dict[str, Any]:
    bucket = server.make_bucket()
    store = server.store(bucket)
    env = {**os.environ, **server.env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job_nodes = [(channel_root(f"teams/bench/jobs/j{j}"), [f"n{i}" for i in range(nodes)]) for j in range(jobs)]
    flat = [(root, n) for root, ns in job_nodes for n in ns]
    procs_n = max(1, min(args.procs, len(flat)))
    shares: list[list[tuple[str, str]]] = [flat[i::procs_n] for i in range(procs_n)]
    procs = []
    for share in shares:
        by_root: dict[str, list[str]] = {}
        for root, n in share:
            by_root.setdefault(root, []).append(n)
        spec = {"mode": mode, "store": f"s3://{bucket}", "jobs": list(by_root.items()), "ranks": args.ranks,
                "steps_per_s": args.steps_per_s, "flush": args.flush}
        procs.append(_Proc(spec, env))
    for p in procs:
        p.expect("ready", timeout=120)
    if mode == "channel":
        # One job: the reader's own 16 threads; many jobs: 2 each, with 8 readers polled at once (16 in flight).
        readers = [ChannelReader(store, root, nodes=ns, flush_interval_s=args.flush,
                                 max_concurrency=16 if jobs == 1 else 2, max_batches_per_node=4)
                   for root, ns in job_nodes]
    else:
        readers = [_NaiveReader(store, root, ns, args.ranks) for root, ns in job_nodes]
    pool = ThreadPoolExecutor(max_workers=16)
    latencies: list[float] = []
    lost_seen = 0
    t0 = time.monotonic()
    wall0 = time.time() + 1.0  # records published in the first second (start-up backlog) are not counted

    def poll(reader: Any) -> list[dict[str, Any]]:
        if mode == "channel":
            return [r for b in reader.poll(discover=False) for r in b.records]
        return reader.poll_records(pool)

    outer = ThreadPoolExecutor(max_workers=8 if mode == "channel" else 1)
    cycles: list[float] = []
    # The control plane renews every job's lease every 10 s, on its own thread (a slow reader must not starve it).
    writers = [CommandWriter(store, root) for root, _ in job_nodes] if mode == "channel" else []
    done = threading.Event()

    def renew() -> None:
        while writers and not done.is_set():
            for w in writers:
                w.renew_lease(BENCH_LEASE_S)
            done.wait(LEASE_TTL_S / 3)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    while time.monotonic() - t0 < args.seconds:
        tick = time.monotonic()
        for recs in outer.map(poll, readers):
            now = time.time()
            latencies += [now - r["t_pub"] for r in recs if r.get("t_pub", 0) >= wall0]
        if mode == "channel":
            lost_seen = max(lost_seen, sum(len(r.lost_nodes()) for r in readers))
        cycles.append(time.monotonic() - tick)
        time.sleep(max(0.0, args.poll - (time.monotonic() - tick)))
    window = time.monotonic() - t0
    done.set()
    renewer.join(timeout=30)
    read_requests = sum(r.requests for r in readers)
    for p in procs:
        p.proc.send_signal(signal.SIGTERM)
    stats = [p.expect("stats", timeout=60) for p in procs]
    for p in procs:
        p.proc.wait(timeout=30)
    outer.shutdown()
    pool.shutdown()
    for r in readers:
        if mode == "channel":
            r.close()
    server.delete_bucket(bucket)
    write_rps = sum(s["requests"] / s["seconds"] for s in stats)
    lat = sorted(latencies)
    return {
        "name": name, "nodes": jobs * nodes, "ranks": jobs * nodes * args.ranks, "procs": procs_n,
        "records": len(lat), "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
        "write_rps": write_rps, "read_rps": read_requests / window, "failures": sum(s["failures"] for s in stats),
        "lost": lost_seen, "cycle_ms": 1000 * statistics.mean(cycles),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="measurement window per scenario")
    ap.add_argument("--nodes", type=str, default="8,64", help="node counts of one job (comma-separated)")
    ap.add_argument("--jobs", type=int, default=0, help="also: this many concurrent jobs of --job-nodes nodes")
    ap.add_argument("--job-nodes", type=int, default=4)
    ap.add_argument("--baseline-nodes", type=str, default="8", help="node counts for the per-rank-object baseline")
    ap.add_argument("--big", action="store_true", help="= --nodes 8,64,512 --jobs 200 --baseline-nodes 8,64")
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--steps-per-s", type=float, default=2.0, help="training steps per second of every rank")
    ap.add_argument("--flush", type=float, default=1.0, help="publisher flush interval (s)")
    ap.add_argument("--poll", type=float, default=0.25, help="reader poll interval (s)")
    ap.add_argument("--procs", type=int, default=8, help="publisher processes (threads inside)")
    args = ap.parse_args(argv)
    if args.big:
        args.nodes, args.jobs, args.baseline_nodes = "8,64,512", 200, "8,64"
    scenarios = [(f"channel N={n}", "channel", 1, int(n)) for n in args.nodes.split(",") if n]
    if args.jobs:
        scenarios.append((f"channel {args.jobs} jobs x {args.job_nodes}", "channel", args.jobs, args.job_nodes))
    scenarios += [(f"baseline N={n}", "naive", 1, int(n)) for n in args.baseline_nodes.split(",") if n]
    print(f"# {args.ranks} ranks/node, {args.steps_per_s:g} steps/s, one record per rank per step; flush "
          f"{args.flush:g} s, reader poll {args.poll:g} s, {args.seconds:g} s per scenario; SeaweedFS on loopback")
    print(f"# publishers: threads in up to {args.procs} processes. baseline = one S3 object per rank per step")
    print(f"# this host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    header = (f"{'scenario':<24} {'nodes':>5} {'ranks':>5} {'procs':>5} {'records':>8} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'write req/s':>11} {'read req/s':>10} {'poll ms':>7} {'fail':>4} {'lost':>4}")
    print(header)
    with tempfile.TemporaryDirectory(prefix="tf-channel-bench-") as tmp, SeaweedFSServer(tmp) as server:
        for name, mode, jobs, nodes in scenarios:
            r = run_scenario(server, name, mode, jobs, nodes, args)
            print(f"{r['name']:<24} {r['nodes']:>5} {r['ranks']:>5} {r['procs']:>5} {r['records']:>8} "
                  f"{r['p50_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['write_rps']:>11.0f} {r['read_rps']:>10.0f} "
                  f"{r['cycle_ms']:>7.0f} "
                  f"{r['failures']:>4} {r['lost']:>4}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        _worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
