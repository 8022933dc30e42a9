"""Chaos MTTR bench: runs the fault scenarios against a real 2-worker job (tiny model, 24 steps, checkpoint every
8 steps, gloo on CPU) and prints detection latency, MTTR (detection -> first step completed after the restore) and
lost steps per failure class, from the run's own records (events.jsonl + fault markers).

Multi-node rows run 4 workers as 2 "nodes" of 2 (one torchrun agent per node on this host, one rendezvous),
placed and re-placed by the live scheduler (trainforge/tasks/chaos.py). `baseline` runs the kill -9 scenario
$CHAOS_BASELINE_RUNS times (default 2) under trainforge and under `torchrun --max-restarts=1` with a script that
restarts from `torch.save` files (bench/chaos_baseline_worker.py; plain, and with the per-attempt store fix), every
run bounded at 90 s, and prints the MTTR ratio. Both modes end with the extrapolation to a 1,024-GPU job: MTTR and
lost work per node failure from the measured detection / re-provisioning and the planner's step time, checkpoint
cost model and Young/Daly interval, at the fleet's node MTBF and at 2,000 h, against the 5-minute / 10-minute limits.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/chaos_mttr.py [scenario ...]   (about 5 minutes on 2 cores)
     e.g. `bench/chaos_mttr.py baseline` (about 6 minutes), `bench/chaos_mttr.py node wave`
The comparison's size has flags (`--help`; the defaults are the run above): its smallest run, the smoke test's
(tests/integration/test_chaos_mttr_smoke.py, under a minute): `bench/chaos_mttr.py baseline --runs 1 --steps 12
--interval 4 --kill-step 6 --variant prefixed --limit-s 30`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

SCENARIOS = {
    # name: (fault, max_restarts, fault marker kind, detected kind)
    "kill-9 (in-segment restart)": ("kill:rank=1:step=10", 1, "kill", "rank_lost"),
    "kill-9 (segment retry)": ("kill:rank=1:step=10", 0, "kill", "rank_lost"),
    "SIGSTOP (heartbeat timeout)": ("stop:rank=1:step=10", 1, "stop", "rank_lost"),
    "hang (watchdog + stacks)": ("hang:rank=1:step=10", 0, "hang", "hang"),
    "NaN (rollback + skip)": ("nan:rank=0:step=12", 0, "nan", "divergence"),
    "SIGTERM (emergency ckpt)": ("sigterm:rank=1:step=13", 0, "sigterm", "preemption"),
}
WAVE = ",".join(f"sigterm:rank={r}:step=12" for r in range(4))
MULTI = {
    # name: (fault, fault marker kind, detected kind); 4 workers = 2 nodes x 2, 20 steps
    "node lost (2 of 4 ranks)": ("node:rank=2:step=14", "node", "rank_lost"),
    "spot wave (SIGTERM x4)": (WAVE, "sigterm", "preemption"),
}
ROOT = Path(__file__).resolve().parents[1]


BASELINE_LIMIT_S = 90.0
BASELINES = {
    # key (--variant): (row label, extra worker config). Plain = what the torchrun docs show: env:// init, torch's
    # default timeouts.
    "plain": ("plain torchrun --max-restarts=1 + torch.save", {}),
    "prefixed": ("same + per-attempt store prefix, 60 s pg timeout", {"prefix_store": True, "pg_timeout_s": 60}),
}


def baseline(name: str, extra: dict, interval: int = 8, steps: int = 24, kill_step: int = 10,
             limit_s: float = BASELINE_LIMIT_S) -> dict:
    """kill -9 of rank 1 at `kill_step` under torchrun --max-restarts=1 with torch.save checkpoints; bounded at
    `limit_s` (the agent and its workers are killed after it: no orphans, no unbounded wait)."""
    from tests.chaos.harness import make_job

    with tempfile.TemporaryDirectory() as home:
        os.environ["TRAINFORGE_HOME"] = home
        job = make_job("bench-baseline", steps=steps, interval=interval)
        folder = Path(home) / "baseline"
        folder.mkdir()
        # The same model as the trainforge job: the numbers its managed entrypoint gets (trainer/loop.py
        # build_model), as plain JSON (job.config.model is a ModelShape, which json cannot encode).
        model = {**job.config.model_args(), "max_seq_len": job.config.training.seq_len}
        cfg = {"model": model, "steps": steps, "interval": interval, "batch": job.config.training.global_batch_size,
               "seq_len": job.config.training.seq_len, "kill_rank": 1, "kill_step": kill_step, "dir": str(folder),
               **extra}
        scratch = folder / "tmp"  # torchrun's log folder (torchelastic_*) and the workers' temp files go here
        scratch.mkdir()
        env = {**os.environ, "BASELINE_CONFIG": json.dumps(cfg), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
               "--master-addr=127.0.0.1", f"--master-port={_port()}", str(ROOT / "bench/chaos_baseline_worker.py")]
        t0 = time.monotonic()
        with open(folder / "torchrun.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                stacks = _py_spy(proc.pid)
                _kill_tree(proc)
                code = None
                (folder / "stacks.txt").write_text(stacks)
                if stacks:
                    print(f"  baseline '{name}' stuck after {limit_s:.0f}s; restarted workers' stacks:\n"
                          + "\n".join("    " + line for line in stacks.splitlines()[:40]))
            finally:
                # the agent's session (start_new_session): a worker it left behind goes with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if code not in (0, None):
            print(f"  baseline '{name}' exited {code}; torchrun's log ends:\n"
                  + "\n".join("    " + line for line in
                               (folder / "torchrun.log").read_text(errors="replace").splitlines()[-15:]))
        evs = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()] \
            if (folder / "events.jsonl").is_file() else []
        killed = next((e for e in evs if e["event"] == "killed"), None)
        kill_t = killed["time"] if killed else math.inf
        restart = [e for e in evs if e["event"] == "start" and e["time"] > kill_t]
        # steps done when the fault fired: rank 1 dies at the start of step index `kill_step`, so `kill_step`
        # steps were trained (rank 0 may write its event of the last one just after rank 1's `killed`)
        reached = max([e["step"] for e in evs if e["event"] == "step" and e["time"] < kill_t]
                      + ([killed["step"]] if killed else []), default=0)
        # the first step completed by the restarted gang (the survivor may still report the step it was finishing)
        restart_t = restart[0]["time"] if restart else math.inf
        first = min((e["time"] for e in evs if e["event"] == "step" and e["time"] > restart_t), default=None)
        resumed = restart[0]["resumed_from"] if restart else None
        out = {"scenario": name, "exit_code": code,
               "fault_to_step_s": round(first - kill_t, 2) if first else None,
               "lost_steps": reached - resumed if resumed is not None else None,
               "resumed_from": resumed, "wall_s": round(time.monotonic() - t0, 1)}
        print(f"CHAOS baseline {name}: kill -9 rank 1 at step {kill_step}: fault->first step after restore "
              f"{out['fault_to_step_s']}s lost_steps={out['lost_steps']} (resumed from {resumed}) "
              f"exit={'killed at the limit' if code is None else code} wall={out['wall_s']}s")
        return out


def _py_spy(pid: int) -> str:
    """Stacks of the agent's children (the restarted workers), to say where a stuck baseline waits."""
    import psutil

    spy = Path(sys.executable).parent / "py-spy"
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        if not spy.exists():
            break
        try:
            dump = subprocess.run([str(spy), "dump", "--pid", str(child.pid)], capture_output=True, text=True,
                                  timeout=20).stdout
            # py-spy prints each thread innermost frame first: the main thread's top frames say where it waits
            frames = [line.strip() for line in dump.splitlines() if line.startswith("    ")]
            out.append(f"pid {child.pid} ({' '.join(child.cmdline()[-1:])}): " + " <- ".join(frames[:6]))
        except (subprocess.SubprocessError, OSError, psutil.Error):
            continue
    return "\n".join(out)


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _port() -> int:
    from trainforge.infra.backends.local import free_port

    return free_port()


def compare_baseline(runs: int = 2, *, steps: int = 24, interval: int = 8, kill_step: int = 10,
                     variants: list[str] | None = None, limit_s: float = BASELINE_LIMIT_S) -> dict:
    """trainforge's kill -9 recovery vs torchrun + torch.save, measured in the same run, `runs` times each; the
    ratio of the median time from the fault to the first step completed after the restore. `variants`: the keys
    of BASELINES to run (default all)."""
    from tests.chaos.harness import make_job, measure, run_job

    ours = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            # `durable=1`: rank 1 dies once its last save is committed (trainer/faults.py), as the baseline's
            # synchronous torch.save always is by then; without it a save still in flight on a loaded host makes
            # the restart fall back a whole interval (tests/chaos/test_kill.py)
            job = run_job(make_job(f"bench-chaos-kill-{i}", steps=steps, interval=interval),
                          fault=f"kill:rank=1:step={kill_step}:durable=1", max_restarts=1)
            ours.append(measure(job, "trainforge kill -9 (in-segment restart)", "kill", "rank_lost"))
    totals = [(m["detection_s"] or 0) + (m["mttr_s"] or 0) for m in ours if m["mttr_s"] is not None]
    total = statistics.median(totals) if totals else None
    lost = "/".join("-" if m["lost_steps"] is None else str(m["lost_steps"]) for m in ours)
    chosen = {key: BASELINES[key] for key in (variants or BASELINES)}
    bases = {label: [baseline(label, extra, interval=interval, steps=steps, kill_step=kill_step, limit_s=limit_s)
                     for _ in range(runs)] for label, extra in chosen.values()}
    print(f"\n{f'kill -9 rank 1 at step {kill_step} ({steps} steps, ckpt every {interval})':52} {'recovered':>9} "
          f"{'fault->step s':>13} {'lost':>6} {'vs trainforge':>13}")
    print(f"{'trainforge (heartbeats + torchrun restart + replica)':52} {len(totals)}/{runs:<7} "
          f"{'none' if total is None else format(total, '13.2f'):>13} {lost:>6} {'1.00x':>13}")
    ratios = {}
    for name, rows in bases.items():
        ok = [b["fault_to_step_s"] for b in rows if b["fault_to_step_s"] is not None]
        lost_b = "/".join("-" if b["lost_steps"] is None else str(b["lost_steps"]) for b in rows)
        if ok and total:
            ratios[name] = statistics.median(ok) / total
            print(f"{name:52} {len(ok)}/{runs:<7} {statistics.median(ok):13.2f} {lost_b:>6} {ratios[name]:12.2f}x")
        elif ok:  # trainforge did not recover: no ratio
            print(f"{name:52} {len(ok)}/{runs:<7} {statistics.median(ok):13.2f} {lost_b:>6} {'-':>13}")
        else:
            vs = f"> {limit_s / total:.1f}x" if total else "-"
            print(f"{name:52} {0}/{runs:<7} {'none':>13} {lost_b:>6} {vs:>13}")
    print(f"(fault->step: median over the recovered runs; a run that completed no step within {limit_s:.0f} s "
          "of the fault counts as not recovered and its process tree is killed)")
    return {"trainforge": ours[0], "trainforge_total_s": total, "baselines": bases, "ratios": ratios}


def multi_node(selected: list[str]) -> list[dict]:
    from tests.chaos.harness import make_job, measure, run_job

    rows = []
    for i, (name, (fault, marker, kind)) in enumerate(MULTI.items()):
        if selected and not any(s in name for s in selected):
            continue
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            job = run_job(make_job(f"bench-multi-{i}", steps=20, interval=4, workers=4), fault=fault,
                          max_retries=1)
            row = measure(job, name, marker, kind)
            row["placements"] = job.placements
            row["regang_s"] = job.regang_s
            print(f"  placements {job.placements}, re-gang {job.regang_s}s")
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------ extrapolation to 1,000 GPUs
SCALE_GPUS, SCALE_GPUS_PER_NODE, SCALE_MODEL, SCALE_GPU = 1024, 8, "llama-70b", "h100"
SCALE_BATCH, SCALE_SEQ = 1024, 4096  # 4M tokens per step
PROCESS_START_S = 60.0
"""Assumption: start 1,024 processes, import torch, NCCL init and the first collectives at 128 nodes (published
large-job start-ups are 1-3 minutes; ours here is ~4 s for 2 gloo workers). The one modelled term we cannot
measure on this machine."""
NODE_READ_BPS, STORE_READ_BPS = 2e9, 100e9
"""Assumed (the planner's bandwidth model, plan/checkpointing.py): a node reads from the object store at 2 GB/s, and
the store serves at most 100 GB/s in all."""
RESTORE_STORE_X, RESTORE_RANK_X = 1.001, 1.002
"""Measured (bench/restore_bytes.py, 2026-12-07, FSDP and HSDP at world 2, 4 and 8, a 288 MiB checkpoint on
SeaweedFS, counted by a proxy): the bytes the store served for one restore, in all, over the checkpoint's size
(worst 288.9 / 288.7 MiB), and the most one rank read over size / world (36.3 / 36.1 MiB, minus .metadata)."""
MEASURED_GANG_RATE_BPS = 288.9 * 2**20 / 2.20
"""Measured in the same run: the FSDP gang of 8 restored 288.9 MiB in 2.20 s (131 MiB/s) on 2 shared cores (sha256 of
every chunk, the proxy and the server on the same cores): a floor for one node's restore rate, not an estimate."""
HEARTBEAT_TIMEOUT_S = 5.0  # the policy default for a silent node (trainer/health.py); a dead process is immediate
LIMIT_MTTR_S, LIMIT_LOST_S = 300.0, 600.0  # the seed: MTTR <= 5 min for a node failure; <= 10 min of lost progress


def measure_regang() -> float:
    """Seconds the live scheduler takes to release a 4-GPU gang and admit it again on the chaos cluster (SQLite),
    the re-provisioning part of a segment retry."""
    from tests.chaos.harness import CHAOS_CLUSTER, chaos_cluster
    from trainforge.infra.scheduler.live import GangRequest
    from trainforge.tasks.provision import live_scheduler

    with tempfile.TemporaryDirectory() as home:
        os.environ["TRAINFORGE_HOME"] = home
        with chaos_cluster(CHAOS_CLUSTER):
            req = GangRequest(job_id="regang", team="demo", gpu_type="cpu", num_gpus=4, gpus_per_node=2)
            live_scheduler().request(req, timeout_s=30)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                live_scheduler().release("regang")
                live_scheduler().request(req, timeout_s=30)
                times.append(time.perf_counter() - t0)
            live_scheduler().release("regang")
    return statistics.median(times)


def extrapolate(measured: dict) -> None:
    """MTTR and lost work for a 1,024-GPU job (128 nodes of 8 H100, Llama-70B) from this run's measured detection
    and re-provisioning, the planner's step time and checkpoint cost model (plan/checkpointing.py: size, write and
    read bandwidth, Young/Daly interval) at the seed's node MTBF (cluster default 50,000 h) and at 2,000 h."""
    from trainforge.plan.advisor import PlanRequest, search
    from trainforge.plan.checkpointing import checkpoint_bytes, plan_checkpoints
    from trainforge.plan.cluster import load_cluster
    from trainforge.plan.hardware import gpu_spec
    from trainforge.plan.model import preset
    from trainforge.plan.topology import default_topology

    shape = preset(SCALE_MODEL)
    nodes = SCALE_GPUS // SCALE_GPUS_PER_NODE
    best = search(PlanRequest(shape, gpu_spec(SCALE_GPU), default_topology(SCALE_GPU, SCALE_GPUS_PER_NODE),
                              SCALE_GPUS, SCALE_BATCH, SCALE_SEQ)).best
    step_s = best.step.step_time_s
    size = checkpoint_bytes(shape)["training_checkpoint"]
    # Ranged restore (trainer/checkpointing/store_reader.py): each node reads its ranks' share once (measured byte
    # factors), at the assumed per-node bandwidth, all nodes together capped by the assumed store bandwidth.
    per_node = size * RESTORE_RANK_X / nodes
    restore_store_s = max(per_node / NODE_READ_BPS, size * RESTORE_STORE_X / STORE_READ_BPS)
    # main's restore before it: rank 0 read and verified the whole checkpoint alone, then every other node read all
    # of it again (nodes x size from the store), before anyone loaded
    restore_main_s = size / NODE_READ_BPS + max(size / NODE_READ_BPS, (nodes - 1) * size / STORE_READ_BPS)
    restore_floor_s = per_node / MEASURED_GANG_RATE_BPS
    # in-memory replica (tier 1): only the replaced node fetches its shard from a peer (~25 GB/s over IB)
    restore_peer_s = size / nodes / 25e9
    detect = {"process": measured.get("detection_s") or 0.0, "node": HEARTBEAT_TIMEOUT_S}
    regang = measured.get("regang_s") or 0.0
    mtbf_default = load_cluster(ROOT / "examples/clusters/fleet-10k.yaml").node_mtbf_hours
    print(f"\nextrapolation: {SCALE_GPUS} x {SCALE_GPU} ({nodes} nodes), {SCALE_MODEL}, layout "
          f"{best.layout.describe()}, planner step {step_s:.2f} s; training checkpoint {size / 1e12:.2f} TB")
    print(f"  measured here: detection {detect['process']:.2f} s (dead process), re-gang {regang:.2f} s; node "
          f"silence detected at the heartbeat timeout ({HEARTBEAT_TIMEOUT_S:g} s); start-up + NCCL init assumed "
          f"{PROCESS_START_S:g} s")
    print(f"  restore bytes measured (bench/restore_bytes.py): store serves {RESTORE_STORE_X:.3f} x the checkpoint, "
          f"a rank reads {RESTORE_RANK_X:.3f} x its share: {per_node / 1e9:.2f} GB per node, "
          f"{size * RESTORE_STORE_X / 1e12:.2f} TB in all (main: {nodes} x {size / 1e12:.2f} TB = "
          f"{nodes * size / 1e12:.0f} TB); read at {NODE_READ_BPS / 1e9:g} GB/s per node and {STORE_READ_BPS / 1e9:g} "
          f"GB/s of store, both assumed: restore {restore_store_s:.1f} s (main {restore_main_s:.0f} s); at the "
          f"rate measured on 2 cores ({MEASURED_GANG_RATE_BPS / 2**20:.0f} MiB/s per node) {restore_floor_s:.0f} s")
    rows = []
    for label, restore in (("node lost, restore from object store", restore_store_s),
                           ("node lost, restore from peer replica", restore_peer_s),
                           ("node lost, restore at the 2-core rate", restore_floor_s),
                           ("node lost, main's restore (a copy per node)", restore_main_s)):
        mttr = detect["node"] + regang + PROCESS_START_S + restore + step_s
        rows.append((label, mttr))
        print(f"  MTTR {label:43} = {detect['node']:.1f} detect + {regang:.2f} re-gang + {PROCESS_START_S:.0f} "
              f"start + {restore:.1f} restore + {step_s:.1f} first step = {mttr:6.1f} s "
              f"({'meets' if mttr <= LIMIT_MTTR_S else 'MISSES'} the 5-min limit)")
    mttr = rows[0][1]
    for mtbf in sorted({mtbf_default, 2000.0}, reverse=True):
        c = plan_checkpoints(shape, nodes=nodes, node_mtbf_hours=mtbf, step_time_s=step_s,
                             async_stall_fraction=0.1, restart_s=mttr)
        worst = c.worst_lost_work_s + mttr  # a failure just before the next checkpoint commits, plus the downtime
        how = (f"capped from Daly's {c.daly_interval_s / 60:.1f} min so one failure loses <= 10 min"
               if c.capped else "Daly")
        print(f"  node MTBF {mtbf:>7,.0f} h: a failure every {c.cluster_mtbf_s / 3600:6.1f} h; interval "
              f"{c.interval_s / 60:5.1f} min ({c.interval_steps} steps, {how}); lost progress per failure avg "
              f"{(c.interval_s / 2) / 60:4.1f} min, worst {c.worst_lost_work_s / 60:4.1f} min "
              f"({'meets' if c.worst_lost_work_s <= LIMIT_LOST_S else 'MISSES'} the 10-min limit; "
              f"with downtime {worst / 60:.1f} min); goodput {100 * (1 - c.overhead_fraction):.2f}%")
        if c.capped:  # what meeting the limit costs against Daly's optimum
            free = plan_checkpoints(shape, nodes=nodes, node_mtbf_hours=mtbf, step_time_s=step_s,
                                    async_stall_fraction=0.1, restart_s=mttr, max_lost_work_s=None)
            print(f"    uncapped Daly would lose up to {free.worst_lost_work_s / 60:.1f} min per failure at goodput "
                  f"{100 * (1 - free.overhead_fraction):.2f}%: the cap costs "
                  f"{100 * (c.overhead_fraction - free.overhead_fraction):.2f} points of goodput")
    print(f"  with the in-memory replica (tier 1, process loss): lost <= 1 step = {step_s:.1f} s; MTTR "
          f"{detect['process'] + PROCESS_START_S + restore_peer_s + step_s:.1f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Scenario names (substrings of the rows; none = all; `baseline` = the torchrun comparison) and the
    comparison's size. The defaults are the documented run; the smallest one (a smoke run, ~30 s on 2 cores):
    `baseline --runs 1 --steps 12 --interval 4 --kill-step 6 --variant prefixed --limit-s 30`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="*", help="scenarios to run (substrings), `baseline`, `scale`; none: all")
    ap.add_argument("--runs", type=int, default=int(os.environ.get("CHAOS_BASELINE_RUNS", "2")),
                    help="baseline: runs of each recovery (default $CHAOS_BASELINE_RUNS or 2)")
    ap.add_argument("--steps", type=int, default=24, help="baseline: steps of the job (default 24)")
    ap.add_argument("--interval", type=int, default=8, help="baseline: checkpoint interval in steps (default 8)")
    ap.add_argument("--kill-step", type=int, default=10, help="baseline: step rank 1 is killed at (default 10)")
    ap.add_argument("--variant", action="append", choices=sorted(BASELINES), dest="variants",
                    help="baseline: the torchrun variant(s) to run (repeatable; default all)")
    ap.add_argument("--limit-s", type=float, default=BASELINE_LIMIT_S,
                    help=f"baseline: bound of each torchrun run in seconds (default {BASELINE_LIMIT_S:.0f})")
    args = ap.parse_args(argv)
    if not 0 < args.interval < args.kill_step < args.steps or args.runs < 1:
        ap.error("need --runs >= 1 and 0 < --interval < --kill-step < --steps")
    return args


def main(argv: list[str]) -> None:
    from tests.chaos.harness import make_job, measure, run_job

    args = parse_args(argv)
    selected = args.scenarios
    if "baseline" in selected or "scale" in selected:
        result = compare_baseline(args.runs, steps=args.steps, interval=args.interval, kill_step=args.kill_step,
                                  variants=args.variants, limit_s=args.limit_s)
        extrapolate({"detection_s": result["trainforge"]["detection_s"], "regang_s": measure_regang()})
        selected = [s for s in selected if s not in ("baseline", "scale")]
        if not selected:
            return
    rows = []
    for i, (name, (fault, restarts, marker, kind)) in enumerate(SCENARIOS.items()):
        if selected and not any(s in name for s in selected):
            continue
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            job = run_job(make_job(f"bench-chaos-{i}"), fault=fault, max_restarts=restarts)
            rows.append(measure(job, name, marker, kind))
    if not selected or any(s in n for s in selected for n in MULTI):
        rows += multi_node(selected)
    print(f"\n{'scenario':32} {'detected':12} {'detect s':>9} {'MTTR s':>8} {'lost':>5}  tier")
    for r in rows:
        print(f"{r['scenario']:32} {r['detected'] or '-':12} {r['detection_s'] or 0:9.2f} {r['mttr_s'] or 0:8.2f} "
              f"{r['lost_steps'] if r['lost_steps'] is not None else '-':>5}  {r['tier']}")
    print("(policy: heartbeat 0.25 s / timeout 3 s, hang timeout 4 s; checkpoint interval 8 steps of ~0.1 s)")
    kill = next((r for r in rows if r["detected"] == "rank_lost" and r["detection_s"] is not None), None)
    regang = [s for r in rows for s in r.get("regang_s", [])]
    if kill is not None:
        extrapolate({"detection_s": kill["detection_s"], "regang_s": max(regang, default=None) or measure_regang()})


if __name__ == "__main__":
    main(sys.argv[1:])
