"""Scheduler decision latency at fleet scale, and placement quality of a 4,096-GPU gang.

The 10,240-GPU fleet (examples/clusters/fleet-10k.yaml) is filled with 200+ running jobs and 1,000+ pending ones
(mixed priorities, teams, GPU types, 1..512 GPUs); then each new submission is timed (submit + one full
scheduling pass, which may preempt), with completions interleaved (also timed). Target (issue 19): P99 <= 10 ms.
Baseline for ratios: the same pass under the `fifo` policy.

The live path (`--db URL`, or `--db sqlite` for a temporary SQLite file): the same fleet and load in the live
scheduler's database, each decision timed as the flow's `provision gang` task makes it, `request(timeout_s=0)`:
one transaction that rebuilds the policy from the rows, submits, runs the pass and writes back what changed (a job
that cannot start is withdrawn in the same transaction); completions are timed as `release`. For PostgreSQL,
start one as docs/servers.md or ENVIRONMENT.md say and pass its URL (postgresql+psycopg2://...).

Run: .venv/bin/python bench/scheduler_latency.py [--submissions 1000] [--db sqlite|URL [--live-submissions 200]]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from trainforge.infra.scheduler import (
    ClusterState,
    JobRequest,
    JobState,
    Scheduler,
    SchedulerConfig,
    TeamPolicy,
)
from trainforge.plan.cluster import load_cluster

FLEET = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "fleet-10k.yaml"
TYPES = ["a100-40gb", "a100-80gb", "h100", "h200"]
PRIOS = ["critical", "high", "normal", "normal", "normal", "low", "preemptible"]


def random_job(rng: random.Random, i: int) -> JobRequest:
    n = rng.choice([1, 1, 2, 4, 8, 8, 8, 16, 32, 64, 128, 256, 512])
    tp = min(8, n) if n >= 8 else 1
    elastic = n >= 64 and rng.random() < 0.1
    return JobRequest(job_id=f"j{i}", team=f"team-{rng.randrange(12)}", priority=rng.choice(PRIOS),
                      gpu_type=rng.choice(TYPES), num_gpus=n, tp=tp, min_gpus=n // 2 if elastic else None,
                      max_runtime_s=rng.uniform(600, 86400))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def run(policy: str, submissions: int, seed: int) -> dict:
    rng = random.Random(seed)
    s = Scheduler(ClusterState.from_spec(load_cluster(FLEET)), config=SchedulerConfig(policy=policy))
    i = 0
    now = 0.0
    while len(s.pending()) < 1000:  # fill: everything that fits runs, the rest queues
        s.submit(random_job(rng, i), now)
        i += 1
        if i % 50 == 0:
            s.schedule(now)
    s.schedule(now)
    running0, pending0 = len(s.running()), len(s.pending())
    submit_lat, release_lat = [], []
    for k in range(submissions):
        now += 1.0
        t0 = time.perf_counter()
        s.submit(random_job(rng, i), now)
        s.schedule(now)
        submit_lat.append(time.perf_counter() - t0)
        i += 1
        if k % 2 == 0:  # a completion (or a victim stopping) every other submission
            ids = [j.job_id for j in s.jobs.values() if j.state is not JobState.PENDING]
            victim = rng.choice(ids)
            t0 = time.perf_counter()
            if s.jobs[victim].state is JobState.PREEMPTING:
                s.stopped(victim, now)
            else:
                s.finish(victim, now)
            s.schedule(now)
            release_lat.append(time.perf_counter() - t0)
    used = sum(n.num_gpus - n.free for n in s.state.nodes)
    return {"policy": policy, "running_at_start": running0, "pending_at_start": pending0,
            "running_at_end": len(s.running()), "pending_at_end": len(s.pending()),
            "gpus_busy_at_end": used, "submit_p50_ms": pct(submit_lat, 0.5), "submit_p99_ms": pct(submit_lat, 0.99),
            "submit_max_ms": max(submit_lat) * 1000, "release_p50_ms": pct(release_lat, 0.5),
            "release_p99_ms": pct(release_lat, 0.99), "preemptions": s.stats["preemptions"],
            "shrinks": s.stats["shrinks"]}


def big_gang(seed: int) -> None:
    """A critical 4,096-GPU h100 gang (tp=8, pp=4) arrives at the loaded fleet: it preempts, waits for the victims'
    checkpoint-then-stop, and is placed."""
    rng = random.Random(seed)
    # The frontier team's critical quota covers the gang (the default, 10% of the fleet, would schedule it as high)
    s = Scheduler(ClusterState.from_spec(load_cluster(FLEET)), {"frontier": TeamPolicy(critical_quota=4096)})
    for i in range(1600):  # background load without critical jobs (those could not be preempted)
        r = random_job(rng, i)
        s.submit(JobRequest(**{**{k: getattr(r, k) for k in r.__slots__},
                               "priority": "high" if r.priority == "critical" else r.priority}), 0.0)
    s.schedule(0.0)
    busy = sum(n.num_gpus - n.free for n in s.state.nodes if n.gpu_type == "h100")
    t0 = time.perf_counter()
    s.submit(JobRequest(job_id="gang-4096", team="frontier", priority="critical", gpu_type="h100", num_gpus=4096,
                        tp=8, pp=4), 1.0)
    decisions = s.schedule(1.0)
    ms = (time.perf_counter() - t0) * 1000
    victims = [j for j in s.jobs.values() if j.state is JobState.PREEMPTING]
    for v in victims:
        s.stopped(v.job_id, 30.0)
    s.schedule(30.0)
    pl = s.jobs["gang-4096"].placement
    if pl is None:
        raise SystemExit(f"4,096-GPU gang not placed: {s.jobs['gang-4096'].reason}")
    q = pl.quality
    print(f"4,096-GPU h100 gang (tp=8, pp=4) into a loaded fleet ({busy} of 4,096 h100 GPUs busy, "
          f"{len(s.running())} jobs running): preemption decision in {ms:.1f} ms "
          f"({len(decisions)} decisions, {len(victims)} victims); placed on {q.num_nodes} nodes / {q.num_racks} racks; "
          f"TP groups spanning nodes: {q.tp_groups_spanning_nodes} of {q.tp_groups}; "
          f"PP groups spanning racks: {q.pp_groups_spanning_racks} of {q.pp_groups}")


def live_run(db_url: str, submissions: int, seed: int) -> dict:
    """The policy's decisions through the live scheduler's transactions, at the same load as `run`."""
    from trainforge.infra.scheduler.live import GangRequest, LiveScheduler, SchedulingTimeout

    rng = random.Random(seed)
    live = LiveScheduler(load_cluster(FLEET), db_url, stale_after_s=1e9)  # the fill's pending jobs stay queued
    now = time.time()

    def fill(_conn, sched: Scheduler) -> int:  # one transaction, as if 1,200 requesters had come and waited
        i = 0
        while len(sched.pending()) < 1000:
            sched.submit(random_job(rng, i), now)
            i += 1
            if i % 50 == 0:
                sched.schedule(now)
        sched.schedule(now)
        return i

    i = live._tx("fill the bench's queue", fill)
    rows = live.queue()
    running0 = sum(r["state"] != "pending" for r in rows)
    pending0 = len(rows) - running0
    submit_lat, release_lat, started = [], [], 0
    for k in range(submissions):
        r = random_job(rng, i)
        i += 1
        req = GangRequest(job_id=r.job_id, team=r.team, priority=r.priority, gpu_type=r.gpu_type, num_gpus=r.num_gpus,
                          tp=r.tp, min_gpus=r.min_gpus, max_runtime_s=r.max_runtime_s)
        t0 = time.perf_counter()
        try:
            live.request(req, timeout_s=0)
            started += 1
        except SchedulingTimeout:
            pass
        submit_lat.append(time.perf_counter() - t0)
        if k % 2 == 0:
            ids = [r["job_id"] for r in live.queue() if r["state"] != "pending"]
            victim = rng.choice(ids)
            t0 = time.perf_counter()
            live.release(victim)
            release_lat.append(time.perf_counter() - t0)
    live.engine.dispose()
    return {"policy": f"ours, live ({live.engine.dialect.name})", "running_at_start": running0,
            "pending_at_start": pending0, "started": started, "submit_p50_ms": pct(submit_lat, 0.5),
            "submit_p99_ms": pct(submit_lat, 0.99), "submit_max_ms": max(submit_lat) * 1000,
            "release_p50_ms": pct(release_lat, 0.5), "release_p99_ms": pct(release_lat, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--submissions", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", help="also time the live path: `sqlite` (a temporary file) or a database URL")
    ap.add_argument("--live-submissions", type=int, default=200)
    args = ap.parse_args()
    big_gang(args.seed)
    results = [run(p, args.submissions, args.seed) for p in ("ours", "fifo")]
    print(f"\n{'':28}" + "".join(f"{r['policy']:>14}" for r in results))
    for key in results[0]:
        if key == "policy":
            continue
        print(f"{key:28}" + "".join(f"{r[key]:>14.2f}" if isinstance(r[key], float) else f"{r[key]:>14}"
                                    for r in results))
    ours, fifo = results
    print(f"\nP99 submit decision latency, ours: {ours['submit_p99_ms']:.2f} ms (target <= 10 ms) = "
          f"{ours['submit_p99_ms'] / max(fifo['submit_p99_ms'], 1e-9):.1f}x the fifo pass")
    if args.db:
        url = args.db
        tmp = None
        if url == "sqlite":
            tmp = tempfile.TemporaryDirectory()
            url = f"sqlite:///{tmp.name}/scheduler.db"
        live = live_run(url, args.live_submissions, args.seed)
        if tmp is not None:
            tmp.cleanup()
        print(f"\n{live['policy']}: {live['running_at_start']} running, {live['pending_at_start']} pending at the "
              f"start; {args.live_submissions} requests ({live['started']} started)")
        for key in ("submit_p50_ms", "submit_p99_ms", "submit_max_ms", "release_p50_ms", "release_p99_ms"):
            print(f"{key:28}{live[key]:>14.2f}")
        print(f"P99 decision latency with its transaction: {live['submit_p99_ms']:.1f} ms = "
              f"{live['submit_p99_ms'] / max(ours['submit_p99_ms'], 1e-9):.0f}x the policy alone")


if __name__ == "__main__":
    main()
