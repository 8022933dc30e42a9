"""The channel's cost and latency on a real S3 server: node publishers in real processes write to SeaweedFS (started
here, loopback only, telemetry off), the control side's real ChannelReader reads them and the real EventRouter
routes every record it read.

Each node has `--ranks` ranks stepping at `--steps-per-s`; every rank sends one record per step (a `rank_metrics`
SegmentEvent stamped with its publish time) and beats once per flush. Latency is publish -> routed (one host, one
clock); requests/s counts every S3 request of both sides (the publishers' batch PUTs, hello/index PUTs, command
LISTs and GETs; the reader's listings in pages of 1,000 keys, hello GETs and batch GETs). The baseline, measured in
the same run on the same server, is the scheme the issue rejects: one object per rank per step, read by listing
each rank's prefix; the ratio column compares requests per record read with it.

Publishers: `--per-proc` (default 32) NodePublisher objects per OS process, each with its own flush thread and its
own seq, sharing the process's S3 client (a boto3 client costs 0.22 s of CPU and 13 MB here: 512 of them would
take 2 minutes of CPU and 7 GB before the first batch). 512 or 800 processes do not fit on a small machine.

    python bench/channel_bench.py                      # baseline N=8, N = 8, 64, 512, 200 jobs x 4, the reader alone
                                                       # (a few minutes on a host that keeps up; far longer on 2 busy cores)
    python bench/channel_bench.py --nodes 8,64 --jobs 0 --seconds 15
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import statistics
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
    Batch,
    ChannelLayout,
    ChannelReader,
    CommandWriter,
    JsonLinesProcess,
    NodePublisher,
    channel_root,
    encode_batch,
)
from trainforge.contract.events import RankMetrics, Sender, parse_event  # noqa: E402
from trainforge.contract.router import EventRouter  # noqa: E402
from trainforge.infra.storage.seaweedfs import SeaweedFSServer, _die_with_parent  # noqa: E402

BENCH_LEASE_S = 120.0  # long enough to cover starting 32 publishers per process on a loaded host; renewed every 10 s


def _event(rank: int, step: int) -> dict[str, Any]:
    """A rank's step as the trainer sends it: a typed RankMetrics (about 200 bytes of JSON); `time` is its
    publish time, the latency's start."""
    return RankMetrics(step=step, src=Sender(job="bench", attempt=0, rank=rank), loss_min=2.1, loss_median=2.2,
                       loss_max=2.3, step_time_s_min=0.41, step_time_s_median=0.42, step_time_s_max=0.47,
                       straggler_rank=rank, straggler_ratio=1.12).model_dump(mode="json", exclude_none=True)


# ---- the publisher processes --------------------------------------------------------------------------------


def _worker(spec: dict[str, Any]) -> None:
    from trainforge.infra.storage import open_store

    # One S3 client per process, shared by its publishers (boto3 clients are thread-safe), with a connection for
    # each publisher so that none waits for another's.
    os.environ["TRAINFORGE_S3_CONCURRENCY"] = str(max(8, len([n for _, ns in spec["jobs"] for n in ns])))
    store = open_store(spec["store"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ranks, period = spec["ranks"], 1.0 / spec["steps_per_s"]
    started = time.monotonic()
    if spec["mode"] == "channel":
        pubs = [NodePublisher(store, root, node, flush_interval_s=spec["flush"], lease_ttl_s=BENCH_LEASE_S)
                for root, nodes in spec["jobs"] for node in nodes]
        with ThreadPoolExecutor(max_workers=16) as pool:  # each start is a GET and a PUT: overlap them
            list(pool.map(NodePublisher.start, pubs))
        print(json.dumps({"event": "ready"}), flush=True)
        step, next_t = 0, time.monotonic()
        while not stop.is_set():
            for pub in pubs:
                for r in range(ranks):
                    pub.heartbeat(r, step=step)
                    pub.publish(_event(r, step))
            step += 1
            next_t = max(next_t + period, time.monotonic())
            stop.wait(max(0.0, next_t - time.monotonic()))
        with ThreadPoolExecutor(max_workers=16) as pool:  # each close is a last PUT and an index PUT
            list(pool.map(lambda p: p.close(timeout=5.0), pubs))
        requests = sum(p.stats["requests"] for p in pubs)
        failures = sum(p.stats["put_failures"] for p in pubs)
        batches = sum(p.stats["batches"] for p in pubs)
    else:  # the baseline: one object per rank per step
        targets = [(root, node, r) for root, nodes in spec["jobs"] for node in nodes for r in range(ranks)]
        print(json.dumps({"event": "ready"}), flush=True)
        requests = failures = batches = 0
        with ThreadPoolExecutor(max_workers=16) as pool:
            step, next_t = 0, time.monotonic()
            while not stop.is_set():
                def put(t: tuple[str, str, int], step: int = step) -> bool:
                    root, node, r = t
                    try:
                        store.put_bytes(f"{root}/naive/{node}/{r}/{step:012d}.json", json.dumps(_event(r, step)).encode())
                        return True
                    except Exception:
                        return False

                ok = list(pool.map(put, targets))
                requests += len(ok)
                failures += ok.count(False)
                step += 1
                next_t = max(next_t + period, time.monotonic())
                stop.wait(max(0.0, next_t - time.monotonic()))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"event": "stats", "requests": requests, "failures": failures, "batches": batches,
                      "seconds": time.monotonic() - started, "cpu_s": ru.ru_utime + ru.ru_stime}), flush=True)


# ---- the control side ---------------------------------------------------------------------------------------


class _NaiveReader:
    """The baseline's reader: LIST every rank's prefix after its last key, GET each new object."""

    def __init__(self, store: Any, root: str, nodes: list[str], ranks: int, pool: ThreadPoolExecutor):
        self.store, self.pool = store, pool
        self.prefixes = [f"{root}/naive/{n}/{r}/" for n in nodes for r in range(ranks)]
        self.last = dict.fromkeys(self.prefixes, "")
        self.requests = 0

    def poll_records(self) -> list[dict[str, Any]]:
        def one(prefix: str) -> tuple[int, list[dict[str, Any]]]:
            keys = self.store.list(prefix, start_after=self.last[prefix])
            out = [json.loads(self.store.get_bytes(k)) for k in keys]
            if keys:
                self.last[prefix] = keys[-1]
            return 1 + len(keys), out

        recs: list[dict[str, Any]] = []
        for n, out in self.pool.map(one, self.prefixes):
            self.requests += n
            recs += out
        return recs


def _backlog(store: Any, reader: ChannelReader) -> int:
    """Batches written but not read yet when the window closed (one uncounted listing)."""
    seen = reader.checkpoint()
    cursors = [c["key"] for c in seen.values() if c["key"]]
    keys = store.list(reader.layout.up_prefix, start_after=min(cursors, default=""))
    unread = {(p[1], p[2]) for k in keys if (p := ChannelLayout.parse_batch_key(k))
              and p[2] > seen.get(p[1], {"seq": -1})["seq"]}
    return len(unread)


def run_scenario(server: SeaweedFSServer, name: str, mode: str, jobs: int, nodes: int, args: argparse.Namespace,
                 ) -> dict[str, Any]:
    bucket = server.make_bucket()
    store = server.store(bucket, max_concurrency=32)
    env = {**os.environ, **server.env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    job_nodes = [(channel_root(f"teams/bench/jobs/j{j}"), [f"n{i}" for i in range(nodes)]) for j in range(jobs)]
    flat = [(root, n) for root, ns in job_nodes for n in ns]
    procs_n = max(min(len(flat), args.min_procs), math.ceil(len(flat) / args.per_proc))
    # The control plane's command writers exist, and every job's lease is granted, before any node starts: a
    # start-up slower than the lease (200 jobs on a starved host) must not let leases lapse before measuring.
    pool = ThreadPoolExecutor(max_workers=16)
    writers = list(pool.map(lambda jn: CommandWriter(store, jn[0]), job_nodes)) if mode == "channel" else []
    list(pool.map(lambda w: w.renew_lease(BENCH_LEASE_S), writers))
    procs = []
    for i in range(procs_n):
        by_root: dict[str, list[str]] = {}
        for root, n in flat[i::procs_n]:
            by_root.setdefault(root, []).append(n)
        spec = {"mode": mode, "store": f"s3://{bucket}", "jobs": list(by_root.items()), "ranks": args.ranks,
                "steps_per_s": args.steps_per_s, "flush": args.flush}
        procs.append(JsonLinesProcess([sys.executable, __file__, "_worker", json.dumps(spec)],
                                      name=f"{name} publisher process {i}", env=env, cwd=ROOT,
                                      preexec_fn=_die_with_parent))
    t_start = time.monotonic()
    for p in procs:
        p.expect("ready", timeout=300)
    startup_s = time.monotonic() - t_start
    if mode == "channel":
        # One job: the reader's own 16 threads; many jobs: 2 each, with 8 readers polled at once (16 in flight).
        readers: list[Any] = [ChannelReader(store, root, nodes=ns, flush_interval_s=args.flush,
                                            max_concurrency=16 if jobs == 1 else 2, max_batches_per_node=4)
                              for root, ns in job_nodes]
    else:
        readers = [_NaiveReader(store, root, ns, args.ranks, pool) for root, ns in job_nodes]
    router = EventRouter()
    latencies: list[float] = []
    lost_seen = routed = polls = 0
    wall0 = time.time() + 2.0  # records published in the first two seconds (start-up backlog) are not counted

    def poll(reader: Any) -> list[dict[str, Any]]:
        if time.monotonic() - t0 >= args.seconds:
            return []  # the window closed during this pass: a starved host's pass would otherwise run on for minutes
        if mode == "channel":
            return [r for b in reader.poll(discover=False) for r in b.records]
        return reader.poll_records()

    outer = ThreadPoolExecutor(max_workers=8 if mode == "channel" else 1)
    cycles: list[float] = []
    # The control plane renews every job's lease every 10 s, on its own thread (a slow reader must not starve it).
    done = threading.Event()

    def renew() -> None:
        while writers and not done.wait(LEASE_TTL_S / 3):
            list(pool.map(lambda w: w.renew_lease(BENCH_LEASE_S), writers))

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    t0 = time.monotonic()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    weed0 = _proc_cpu_s(server.proc.pid) if server.proc else 0.0
    while time.monotonic() - t0 < args.seconds:
        tick = time.monotonic()
        for recs in outer.map(poll, readers):
            now = time.time()
            for rec in recs:
                event = parse_event(rec)
                router.route(event)
                routed += 1
                if event.time >= wall0:
                    latencies.append(now - event.time)
        polls += 1
        if mode == "channel":
            lost_seen = max(lost_seen, sum(len(r.lost_nodes()) for r in readers))
        cycles.append(time.monotonic() - tick)
        time.sleep(max(0.0, args.poll - (time.monotonic() - tick)))
    window = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    reader_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    weed_cpu = (_proc_cpu_s(server.proc.pid) if server.proc else 0.0) - weed0
    read_requests = sum(r.requests for r in readers)
    done.set()
    renewer.join(timeout=30)
    for p in procs:
        p.proc.send_signal(signal.SIGTERM)
    stats = [p.expect("stats", timeout=300) for p in procs]
    for p in procs:
        p.proc.wait(timeout=60)
    # Counted once the nodes have stopped (their last flush included), so the listing does not race the writers.
    backlog = sum(pool.map(lambda r: _backlog(store, r), readers)) if mode == "channel" else 0
    outer.shutdown()
    pool.shutdown()
    for r in readers:
        if mode == "channel":
            r.close()
    server.delete_bucket(bucket)
    write_rps = sum(s["requests"] / s["seconds"] for s in stats)
    # CPU-seconds per second of every party over its whole run (the publishers' includes their start-up): what a
    # host would need to carry this load, whether or not this one could.
    pub_cpu = sum(s["cpu_s"] / s["seconds"] for s in stats)
    # What carrying the offered load would take, from the CPU each party spent per request it made (a starved
    # party makes fewer requests, not cheaper ones): per node per flush a batch PUT and a command GET; per flush
    # a GET per batch and, by the quiet rule, about two LISTs per job on the reader's side.
    pub_requests = sum(s["requests"] for s in stats)
    need_write = 2 * jobs * nodes / args.flush if mode == "channel" else jobs * nodes * args.ranks * args.steps_per_s
    need_read = (jobs * nodes + 2 * jobs) / args.flush if mode == "channel" else need_write + jobs * nodes * args.ranks / args.poll
    all_requests = pub_requests + read_requests
    # The control side's share (the publishers run on the nodes, one per node, in production): the reader and the
    # S3 server at the CPU each spent per request, times the requests the offered load takes.
    control_needed = ((reader_cpu / max(1, read_requests)) * need_read
                      + (weed_cpu / max(1, all_requests)) * (need_write + need_read))
    lat = sorted(latencies)
    return {
        "name": name, "nodes": jobs * nodes, "ranks": jobs * nodes * args.ranks, "procs": procs_n,
        "records": routed, "records_per_s": routed / window, "startup_s": startup_s,
        "p50_ms": 1000 * statistics.median(lat) if lat else float("nan"),
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else float("nan"),
        "write_rps": write_rps, "read_rps": read_requests / window, "failures": sum(s["failures"] for s in stats),
        "lost": lost_seen, "cycle_ms": 1000 * statistics.mean(cycles), "backlog": backlog,
        "cpu_per_s": reader_cpu / window, "cpu_ms_per_poll": 1000 * reader_cpu / max(1, polls),
        "pub_cpu_per_s": pub_cpu, "s3_cpu_per_s": weed_cpu / window, "control_needed": control_needed,
        "node_cpu_ms_per_s": 1000 * pub_cpu / (jobs * nodes), "write_share": pub_requests / max(1.0, sum(
            s["seconds"] for s in stats) / len(stats) * need_write),
    }


def _proc_cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) a process has used, from /proc (the S3 server is not our child's rusage)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_reader_alone(server: SeaweedFSServer, jobs: int, nodes: int, rounds: int, args: argparse.Namespace,
                     ) -> dict[str, Any]:
    """The control side's own cost, free of the publishers' load: `rounds` flushes of `jobs` x `nodes` nodes are
    written first (not measured), then each poll reads one flush of every node of every job (one ChannelReader per
    job, max_batches_per_node=1, 16 requests in flight in all), as a control plane that keeps up does once per
    flush interval. CPU is the process's (getrusage), so a busy host does not inflate it."""
    bucket = server.make_bucket()
    store = server.store(bucket, max_concurrency=32)
    roots = [channel_root(f"teams/bench/jobs/alone{j}") for j in range(jobs)]
    names = [f"n{i}" for i in range(nodes)]
    base_ms = int(time.time() * 1000)

    def write(item: tuple[str, int, str]) -> None:
        root, rnd, node = item
        records = [_event(r, rnd) for r in range(args.ranks) for _ in range(int(args.steps_per_s * args.flush))]
        beats = {str(r): {"step": rnd, "age_s": 0.1} for r in range(args.ranks)}
        data = encode_batch(Batch(node, rnd, time.time(), records, beats))
        store.put_bytes(ChannelLayout(root).batch_key(node, rnd, base_ms + 1000 * rnd + int(node[1:])), data)

    with ThreadPoolExecutor(max_workers=32) as pool:
        list(pool.map(write, [(root, rnd, n) for root in roots for rnd in range(rounds) for n in names]))
    per_reader = 16 if jobs == 1 else 2
    readers = [ChannelReader(store, root, nodes=names, flush_interval_s=0.0, max_batches_per_node=1,
                             max_concurrency=per_reader) for root in roots]
    outer = ThreadPoolExecutor(max_workers=max(1, 16 // per_reader))
    router = EventRouter()
    polls = []
    for _ in range(rounds):
        req0, keys0 = sum(r.requests for r in readers), sum(r.listed_keys for r in readers)
        cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        batches = 0
        for reader, got in zip(readers, outer.map(lambda r: r.poll(discover=False), readers), strict=True):
            batches += len(got)
            for rec in reader.records(got):
                router.route(parse_event(rec[3]))
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        polls.append({"batches": batches, "requests": sum(r.requests for r in readers) - req0,
                      "keys": sum(r.listed_keys for r in readers) - keys0,
                      "wall_ms": 1000 * (time.monotonic() - wall0),
                      "cpu_ms": 1000 * (cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime)})
    outer.shutdown()
    for reader in readers:
        reader.close()
    server.delete_bucket(bucket)
    return {"jobs": jobs, "nodes": nodes, "polls": polls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window per scenario")
    ap.add_argument("--nodes", type=str, default="8,64,512", help="node counts of one job (comma-separated)")
    ap.add_argument("--jobs", type=int, default=200, help="also: this many concurrent jobs of --job-nodes nodes")
    ap.add_argument("--job-nodes", type=int, default=4)
    ap.add_argument("--baseline-nodes", type=str, default="8", help="node counts for the per-rank-object baseline")
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--steps-per-s", type=float, default=2.0, help="training steps per second of every rank")
    ap.add_argument("--flush", type=float, default=1.0, help="publisher flush interval (s)")
    ap.add_argument("--poll", type=float, default=0.25, help="reader poll interval (s)")
    ap.add_argument("--per-proc", type=int, default=32, help="NodePublisher objects per publisher process at most")
    ap.add_argument("--min-procs", type=int, default=8, help="at least this many publisher processes")
    ap.add_argument("--reader-alone", type=int, default=512, help="then the reader alone on this many nodes (0: no)")
    ap.add_argument("--readers-alone-jobs", type=int, default=200,
                    help="then the control side alone on this many jobs of --job-nodes nodes (0: no)")
    args = ap.parse_args(argv)
    scenarios = [(f"baseline N={n}", "naive", 1, int(n)) for n in args.baseline_nodes.split(",") if n]
    scenarios += [(f"channel N={n}", "channel", 1, int(n)) for n in args.nodes.split(",") if n]
    if args.jobs:
        scenarios.append((f"channel {args.jobs} jobs x {args.job_nodes}", "channel", args.jobs, args.job_nodes))
    print(f"# {args.ranks} ranks/node, {args.steps_per_s:g} steps/s, one RankMetrics event per rank per step; flush "
          f"{args.flush:g} s, reader poll {args.poll:g} s, {args.seconds:g} s per scenario; SeaweedFS on loopback")
    print(f"# publishers: up to {args.per_proc} NodePublisher objects (each its own thread and seq) per OS process, "
          f"at least {args.min_procs} processes; one S3 client per process. Reader: ChannelReader -> parse_event -> "
          "EventRouter.route")
    print("# baseline = one S3 object per rank per step, one LIST per rank prefix per poll; 'x base' = the "
          "baseline's requests per record produced / this row's")
    print(f"# this host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    header = (f"{'scenario':<22} {'nodes':>5} {'procs':>5} {'rec/s':>6} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'write r/s':>9} {'read r/s':>8} {'x base':>6} {'poll ms':>7} {'cpu/poll':>8} {'rd cpu':>6} "
              f"{'backlog':>7} {'lost':>4} {'fail':>4} {'start s':>7} {'cores':>5} {'ctl need':>8} {'node ms/s':>9} {'wr made':>7}")
    print(header, flush=True)
    base_per_record: float | None = None
    with tempfile.TemporaryDirectory(prefix="tf-channel-bench-") as tmp, SeaweedFSServer(tmp) as server:
        for name, mode, jobs, nodes in scenarios:
            r = run_scenario(server, name, mode, jobs, nodes, args)
            # requests per record produced (nodes x ranks x steps/s: not flattered by a reader that falls behind)
            per_record = (r["write_rps"] + r["read_rps"]) / (r["ranks"] * args.steps_per_s)
            if mode == "naive" and base_per_record is None:
                base_per_record = per_record
            cores = r["cpu_per_s"] + r["pub_cpu_per_s"] + r["s3_cpu_per_s"]
            ratio = f"{base_per_record / per_record:6.1f}" if base_per_record and mode == "channel" else f"{'-':>6}"
            print(f"{r['name']:<22} {r['nodes']:>5} {r['procs']:>5} {r['records_per_s']:>6.0f} {r['p50_ms']:>7.0f} "
                  f"{r['p99_ms']:>7.0f} {r['write_rps']:>9.0f} {r['read_rps']:>8.0f} {ratio} {r['cycle_ms']:>7.0f} "
                  f"{r['cpu_ms_per_poll']:>6.0f}ms {r['cpu_per_s']:>6.2f} {r['backlog']:>7} {r['lost']:>4} "
                  f"{r['failures']:>4} {r['startup_s']:>7.1f} {cores:>5.1f} {r['control_needed']:>8.2f} {r['node_cpu_ms_per_s']:>9.1f} "
                  f"{r['write_share']:>7.0%}", flush=True)
        alone_runs = [(1, args.reader_alone)] if args.reader_alone else []
        alone_runs += [(args.readers_alone_jobs, args.job_nodes)] if args.readers_alone_jobs else []
        for jobs, nodes in alone_runs:
            alone = run_reader_alone(server, jobs, nodes, 5, args)
            what = f"{nodes} nodes" if jobs == 1 else f"{jobs} jobs x {nodes} nodes (one reader each)"
            print(f"# the control side alone, {what} written beforehand, one flush of every node per poll "
                  "(ChannelReader.poll + parse_event + EventRouter.route):")
            for i, p in enumerate(alone["polls"]):
                print(f"#   poll {i}: {p['batches']} batches, {p['requests']} requests ({p['keys']} keys listed), "
                      f"{p['cpu_ms']:.0f} ms CPU, {p['wall_ms']:.0f} ms wall", flush=True)
    print("# rec/s: records read and routed per second; poll ms: one pass of every reader; cpu/poll and rd cpu: the "
          "reader process's CPU per pass and CPU-seconds per second; backlog: batches written but unread at the end; "
          "cores: CPU-seconds per second the publishers, the reader and the S3 server got (at this host's "
          f"{os.cpu_count()}, the row measures a saturated host: its latency is queueing, not the channel); ctl need: "
          "the cores the reader and the S3 server need for the offered load at the CPU each spent per request; node "
          "ms/s: CPU of one node's publisher (its ranks' publish calls included) per second; wr made: the share of "
          "the offered write requests the publishers made")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        _worker(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
