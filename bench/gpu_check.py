"""GPU check (issue 22): trainforge's real worker on one NVIDIA H200, CUDA/NCCL, world size 1.

Runs `python -m torch.distributed.run --nproc-per-node=1 -m trainforge.trainer.worker` with TRAINFORGE_JOB_CONFIG
pointing at a SegmentConfig built by trainforge.tasks.prepare (validate_spec / resolve_dataset / make_plan /
worker_config against bench/gpu_check_cluster.yaml), exactly as bench/spine_overhead.py's run_worker, for:

  (a) tiny   the demo job (examples/tiny-cpu.yaml on 1 x h200 instead of 2 CPU slots; the embedded demo-text data),
  (b) llama1b a ~1B-parameter Llama in bf16 on a synthetic token dataset committed to the embedded catalog,
      a few dozen steps with two async checkpoints,

and reports, from each job's events.jsonl:
  - MFU: the median of the `metrics` events' `mfu` (steady state: the first steps and the steps right after a
    checkpoint save are left out) against the planner's `plan["predicted"]["mfu"]`; targets: >= 40% measured on
    the 1B model and measured / predicted within 10%;
  - async checkpoints: the `checkpoint_staged` events' `blocked_s` (how long each save held the loop) and the
    `checkpoint` (committed) events; on CUDA the checkpointer stages into pinned host buffers
    (trainer/checkpoint.py: `use_pinned_memory=cuda`), which the `metrics_meta` event's `peak_source`
    (`catalog:h200` = the worker ran on the H200) shows was the case;
  - NVML telemetry: the `system` events with `source == "nvml"` and gpu0_* fields (utilisation, memory, SM clock,
    temperature, power) read from the driver (trainer/telemetry.py NvmlSource).

`--smoke` runs the same code path on a CPU-only machine (gloo, the cluster's cpu slot, tiny shapes, ~1 minute):
the GPU-only checks (NVML, the MFU targets, pinned staging) print "skipped (no GPU)", never PASS.

  .venv/bin/python bench/gpu_check.py [--smoke] [--out DIR]      (or bench/gpu_check.sh, the same arguments)

Exit status 0 when every check that ran passed. The numbers go to DIR/gpu_check.json, the jobs' events and worker
logs beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
CLUSTER = REPO / "bench" / "gpu_check_cluster.yaml"
MFU_TARGET = 0.40
PREDICTION_TOLERANCE = 0.10
SKIPPED = "skipped (no GPU)"

# ~1B parameters: 16 x (attention 4 * 2048^2 + SwiGLU 3 * 2048 * 5632) + 2 * 32000 * 2048 embeddings = 0.95B.
LLAMA_1B = {"layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 16, "ffn_hidden": 5632, "vocab": 32000}
LLAMA_SMOKE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn_hidden": 128, "vocab": 512}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- jobs --------------------------------------------------------------------------------------------------------

def tiny_doc(smoke: bool) -> dict[str, Any]:
    """examples/tiny-cpu.yaml on one device: 1 x h200 (or, in smoke mode, the cluster's one cpu slot)."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["name"] = "gpu-check-tiny"
    doc["resources"] = {"gpu_type": "cpu" if smoke else "h200", "min_gpus": 1, "gpus_per_node": 1}
    doc["parallelism"] = {"strategy": "explicit", "dp": 1, "micro_batch_size": 4}
    doc["training"]["max_steps"] = 12 if smoke else 60
    doc["checkpoint"] = {"interval_steps": 6 if smoke else 30, "keep_last": 2}
    doc["max_runtime"] = "10m"
    return doc


def llama_doc(smoke: bool, steps: int) -> dict[str, Any]:
    model = LLAMA_SMOKE if smoke else LLAMA_1B
    seq = 64 if smoke else 2048
    return {
        "name": "gpu-check-llama1b",
        "team": "bench",
        "code": {"entrypoint": "trainforge.trainer.models.llama:build_model", "mode": "managed"},
        "dataset": {"ref": "catalog://gpu-check-tokens@main", "license": "CC0-1.0", "eval_fraction": 0.02},
        "resources": {"gpu_type": "cpu" if smoke else "h200", "min_gpus": 1, "gpus_per_node": 1},
        "model": dict(model),
        "training": {"max_steps": steps, "global_batch_size": 4 if smoke else 32, "seq_len": seq,
                     "precision": "bf16", "seed": 1234,
                     "optimizer": {"name": "adamw", "lr": 0.0003, "weight_decay": 0.01},
                     "lr_schedule": {"warmup_steps": max(1, steps // 10), "decay": "cosine", "min_lr_ratio": 0.1}},
        "parallelism": {"strategy": "explicit", "dp": 1, "micro_batch_size": 2 if smoke else 8},
        # two async saves (mid-run and final); keep one so a 1B run's ~12 GB checkpoints fit the disk
        "checkpoint": {"interval_steps": max(1, steps // 2), "keep_last": 1},
        "evaluation": {"enabled": False},
        "fault_tolerance": {"max_segment_retries": 0},
        "max_runtime": "10m",
        "labels": {"purpose": "gpu-check"},
    }


def commit_token_dataset(smoke: bool, steps: int) -> None:
    """Uniform random tokens (nothing can be downloaded) as catalog://gpu-check-tokens@main, committed the way
    tests/specs/cases.py::build_demo_dataset does."""
    import numpy as np

    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.shards import write_shard

    model = LLAMA_SMOKE if smoke else LLAMA_1B
    doc = llama_doc(smoke, steps)["training"]
    sample_len = doc["seq_len"] + 1
    samples = int(doc["global_batch_size"] * (steps + 4) * 1.1) + 16  # one epoch covers the run and the eval split
    data = np.random.default_rng(0).integers(0, model["vocab"], size=(samples, sample_len), dtype=np.uint16)
    EmbeddedCatalog().commit("gpu-check-tokens", lambda d: [write_shard(d / "shard-00000.arrow", data)],
                             sample_len=sample_len, token_dtype="uint16", vocab_size=model["vocab"], tokenizer="bytes",
                             license="CC0-1.0")


def run_worker(name: str, doc: dict[str, Any], work: Path, out: Path, env: dict[str, str],
               timeout_s: float) -> dict[str, Any]:
    """bench/spine_overhead.py's run_worker at world size 1, bounded by `timeout_s`: the job's plan, its events and
    the worker's wall time (the worker's output goes to OUT/NAME-worker.log)."""
    from spine_overhead import prepare_segment

    from trainforge.infra.backends.local import free_port
    from trainforge.plan.cluster import load_cluster

    spec_path = work / f"{name}.yaml"  # code.repo "." = this folder; the entrypoint is installed
    spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    record, path, plan = prepare_segment(spec_path, load_cluster(CLUSTER))
    log(f"{name}: {plan['parameters'] / 1e6:.1f}M parameters, layout {plan['layout']}, predicted "
        f"{plan['predicted']}; worker timeout {timeout_s:.0f}s")
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
           "-m", "trainforge.trainer.worker"]
    worker_log = out / f"{name}-worker.log"
    t0 = time.perf_counter()
    rc: int | str
    with worker_log.open("w") as fh:
        # own process group, so a timeout ends torchrun's workers too, not only the agent
        proc = subprocess.Popen(cmd, env={**env, "TRAINFORGE_JOB_CONFIG": str(path)}, stdout=fh,
                                stderr=subprocess.STDOUT, cwd=work, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout_s:.0f}s"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    wall = time.perf_counter() - t0
    events_path = record.folder / "events.jsonl"
    events = [json.loads(line) for line in events_path.read_text().splitlines()] if events_path.is_file() else []
    if events_path.is_file():
        shutil.copy(events_path, out / f"{name}-events.jsonl")
    if rc != 0:
        tail = worker_log.read_text()[-3000:]
        log(f"{name}: worker exited {rc}; the end of {worker_log}:\n{tail}")
    return {"name": name, "rc": rc, "wall_s": wall, "plan": plan, "events": events}


# ---- what the events say -------------------------------------------------------------------------------------------

def summarise(job: dict[str, Any], smoke: bool, skip_first: int) -> dict[str, Any]:
    events = job["events"]
    by = lambda t: [e for e in events if e.get("type") == t]  # noqa: E731
    metrics = [e for e in by("metrics") if e.get("mfu") is not None]
    staged, committed = by("checkpoint_staged"), by("checkpoint")
    meta = (by("metrics_meta") or [{}])[0]
    save_steps = {e["step"] for e in staged} | {e["step"] for e in committed}
    # steady state: not the first steps (allocator, cuDNN/cuBLAS heuristics) nor the step after a save
    steady = [e for e in metrics if e["step"] > skip_first and e["step"] - 1 not in save_steps
              and e["step"] not in save_steps]
    steady = steady or metrics
    measured = statistics.median(e["mfu"] for e in steady) if steady else None
    predicted = (job["plan"].get("predicted") or {}).get("mfu")
    step_s = statistics.median(e["step_time_s"] for e in steady) if steady else None
    systems = by("system")
    nvml = [e for e in systems if e.get("source") == "nvml"]
    nvml_fields = sorted({k for e in nvml for k in e if k.startswith("gpu")})
    gpu_mem = max((e.get("gpu0_mem_used_bytes") or 0.0 for e in nvml), default=0.0)
    blocked = [e["blocked_s"] for e in staged]
    return {
        "rc": job["rc"], "wall_s": round(job["wall_s"], 2), "parameters": job["plan"]["parameters"],
        "layout": job["plan"]["layout"], "steps_reported": len(metrics), "steady_steps": len(steady),
        "final_loss": metrics[-1].get("loss") if metrics else None,
        "peak_flops": meta.get("peak_flops"), "peak_source": meta.get("peak_source"),
        "flops_per_token": meta.get("flops_per_token"),
        "mfu_measured": measured, "mfu_predicted": predicted,
        "mfu_ratio": measured / predicted if measured is not None and predicted else None,
        "step_time_s_measured": step_s,
        "step_time_s_predicted": (job["plan"].get("predicted") or {}).get("step_time_s"),
        "tokens_per_s_measured": statistics.median(e["tokens_per_s"] for e in steady) if steady else None,
        "peak_mem_bytes": max((e.get("peak_mem_bytes") or 0.0 for e in metrics), default=None),
        "checkpoints_staged": [{"step": e["step"], "blocked_s": e["blocked_s"]} for e in staged],
        "checkpoints_committed": sorted(e["step"] for e in committed),
        "checkpoint_blocked_s_max": max(blocked) if blocked else None,
        "checkpoint_blocked_s_total": sum(blocked) if blocked else None,
        "pinned_staging": None if smoke else str(meta.get("peak_source", "")).startswith("catalog:"),
        "system_events": len(systems), "system_sources": sorted({str(e.get("source")) for e in systems}),
        "nvml_events": len(nvml), "nvml_fields": nvml_fields, "nvml_gpu0_mem_used_bytes_max": gpu_mem,
        "nvml_sample": {k: v for k, v in (nvml[-1] if nvml else {}).items() if k.startswith("gpu")},
    }


def checks(results: dict[str, dict[str, Any]], expect_saves: dict[str, int], smoke: bool) -> list[tuple[str, str, str]]:
    """(check, PASS | FAIL | skipped (no GPU), detail) rows."""
    rows: list[tuple[str, str, str]] = []
    ok = lambda cond: "PASS" if cond else "FAIL"  # noqa: E731
    for name, r in results.items():
        rows.append((f"{name}: worker ran to the end", ok(r["rc"] == 0 and r["steps_reported"] > 0),
                     f"rc {r['rc']}, {r['steps_reported']} metrics events, wall {r['wall_s']:.1f}s, "
                     f"final loss {r['final_loss']}"))
        want_source = "calibrated-cpu" if smoke else "catalog:h200"
        rows.append((f"{name}: device", ok(r["peak_source"] == want_source),
                     f"metrics_meta peak_source {r['peak_source']!r} (want {want_source!r}), peak "
                     f"{(r['peak_flops'] or 0) / 1e12:.2f} TFLOP/s"))
        rows.append((f"{name}: async checkpoints", ok(len(r["checkpoints_committed"]) >= expect_saves[name]
                                                      and len(r["checkpoints_staged"]) >= expect_saves[name]),
                     f"committed steps {r['checkpoints_committed']}, staged {r['checkpoints_staged']} "
                     f"(loop blocked: max {_fmt_s(r['checkpoint_blocked_s_max'])}, total "
                     f"{_fmt_s(r['checkpoint_blocked_s_total'])}; median step {_fmt_s(r['step_time_s_measured'])})"))
        if smoke:
            rows.append((f"{name}: pinned host staging", SKIPPED, "use_pinned_memory is on only for CUDA devices"))
        else:
            rows.append((f"{name}: pinned host staging", ok(bool(r["pinned_staging"])),
                         "checkpointer on a CUDA device (use_pinned_memory=cuda), per metrics_meta peak_source"))
        ratio = r["mfu_ratio"]
        mfu_detail = (f"measured {_pct(r['mfu_measured'])} (median of {r['steady_steps']} steady steps) vs "
                      f"predicted {_pct(r['mfu_predicted'])} -> ratio {ratio:.3f}" if ratio is not None else
                      f"measured {_pct(r['mfu_measured'])}, predicted {_pct(r['mfu_predicted'])}")
        rows.append((f"{name}: MFU", "info", mfu_detail))
        if name == "llama1b":
            if smoke:
                rows.append(("llama1b: MFU >= 40%", SKIPPED, "CPU peak is a calibration, not a target"))
                rows.append(("llama1b: prediction within 10%", SKIPPED, "the planner's cpu entry is nominal"))
            else:
                rows.append(("llama1b: MFU >= 40%", ok((r["mfu_measured"] or 0) >= MFU_TARGET), mfu_detail))
                rows.append(("llama1b: prediction within 10%",
                             ok(ratio is not None and abs(ratio - 1) <= PREDICTION_TOLERANCE), mfu_detail))
        if smoke:
            rows.append((f"{name}: NVML telemetry", SKIPPED,
                         f"{r['system_events']} system events, sources {r['system_sources']} (telemetry path ran)"))
        else:
            real = r["nvml_events"] > 0 and r["nvml_gpu0_mem_used_bytes_max"] > 0 and any(
                k.startswith("gpu0_") and k.endswith(("_util_percent", "power_w", "sm_clock_mhz"))
                for k in r["nvml_fields"])
            rows.append((f"{name}: NVML telemetry", ok(real),
                         f"{r['nvml_events']} nvml system events of {r['system_events']}; last sample "
                         f"{_short(r['nvml_sample'])}"))
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def _short(sample: dict[str, Any]) -> str:
    keys = ("gpu0_util_percent", "gpu0_mem_used_bytes", "gpu0_sm_clock_mhz", "gpu0_temperature_c", "gpu0_power_w")
    return ", ".join(f"{k.removeprefix('gpu0_')}={sample[k]:.4g}" for k in keys if k in sample) or "none"


# ---- main --------------------------------------------------------------------------------------------------------

def preflight(smoke: bool, env: dict[str, str]) -> str | None:
    """On the GPU: torch must see CUDA and NCCL (a CPU wheel of torch cannot run the check). None when fine."""
    if smoke:
        return None
    code = ("import torch, torch.distributed as d; assert torch.cuda.is_available(), f'torch {torch.__version__} "
            "sees no CUDA device'; assert d.is_nccl_available(), 'no NCCL in this torch'; "
            "print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))")
    try:
        out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "torch/CUDA preflight timed out after 120s"
    if out.returncode != 0:
        return (out.stderr.strip().splitlines() or ["?"])[-1]
    log(f"preflight: torch {out.stdout.strip()}")
    return None


def plan_only(steps: int) -> int:
    """The GPU run's specs through validate_spec and make_plan against bench/gpu_check_cluster.yaml."""
    from trainforge.plan.cluster import load_cluster
    from trainforge.tasks import prepare

    cluster = load_cluster(CLUSTER)
    with tempfile.TemporaryDirectory(prefix="gpu-check-plan-") as tmp:
        os.environ["TRAINFORGE_HOME"] = str(Path(tmp) / "home")
        from trainforge.datasets.demo import ensure_demo_dataset

        ensure_demo_dataset()
        commit_token_dataset(False, steps)
        for name, doc in (("tiny", tiny_doc(False)), ("llama1b", llama_doc(False, steps))):
            spec = prepare.validate_spec(doc, name, Path(tmp), cluster)
            plan = prepare.make_plan(spec, cluster)
            print(json.dumps({"job": name, "parameters": plan["parameters"], "world_size": plan["world_size"],
                              "layout": plan["layout"], "memory_per_gpu_gib": plan["memory_per_gpu_bytes"] / 2**30,
                              "predicted": plan["predicted"]}, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU-only: gloo, tiny shapes, GPU checks skipped")
    p.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json, events and worker logs")
    p.add_argument("--steps", type=int, default=None, help="steps of the 1B job (default 40; smoke 8)")
    p.add_argument("--only", choices=("tiny", "llama1b"), default=None, help="run one of the two jobs")
    p.add_argument("--keep", action="store_true", help="keep the temporary TRAINFORGE_HOME (checkpoints)")
    p.add_argument("--plan-only", action="store_true",
                   help="validate and plan the two GPU jobs against the cluster and print the plans (no worker, "
                        "no GPU needed)")
    p.add_argument("--work", type=Path, default=None,
                   help="where the temporary TRAINFORGE_HOME goes (the 1B job writes up to ~50 GB of checkpoints; "
                        "default: the system temp folder)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of the whole check (default 470 s on the GPU, 240 s in smoke mode)")
    args = p.parse_args()
    if args.plan_only:
        return plan_only(args.steps or 40)
    smoke = args.smoke
    steps = args.steps or (8 if smoke else 40)
    out = (args.out or Path(tempfile.mkdtemp(prefix="gpu-check-out-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (240.0 if smoke else 470.0)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work))
    free_gb = shutil.disk_usage(work).free / 2**30
    home = work / "home"
    env = {**os.environ, "TRAINFORGE_HOME": str(home), "TRAINFORGE_CLUSTER": str(CLUSTER),
           "TRAINFORGE_TELEMETRY_INTERVAL_S": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2" if smoke else "8")}
    os.environ.update({k: env[k] for k in ("TRAINFORGE_HOME", "TRAINFORGE_CLUSTER")})
    log(f"mode {'smoke (CPU, gloo)' if smoke else 'GPU (1 x H200, NCCL)'}; out {out}; work {work} "
        f"({free_gb:.0f} GiB free); budget {budget:.0f}s")
    if not smoke and free_gb < 50:
        log(f"warning: {free_gb:.0f} GiB free under {work}; the 1B job's checkpoints need up to ~50 GB (--work DIR)")
    t_start = time.perf_counter()
    left = lambda: budget - (time.perf_counter() - t_start)  # noqa: E731
    results: dict[str, dict[str, Any]] = {}
    expect = {"tiny": 2, "llama1b": 2}
    try:
        problem = preflight(smoke, env)
        if problem is not None:
            log(f"FAIL preflight: {problem}")
            (out / "gpu_check.json").write_text(json.dumps({"mode": "gpu", "preflight": problem, "ok": False},
                                                           indent=1))
            return 1
        jobs = [j for j in ("tiny", "llama1b") if args.only in (None, j)]
        if "tiny" in jobs:
            from trainforge.datasets.demo import ensure_demo_dataset

            ensure_demo_dataset()
            job = run_worker("tiny", tiny_doc(smoke), work, out, env, timeout_s=min(120.0, left() - 60))
            results["tiny"] = summarise(job, smoke, skip_first=3)
        if "llama1b" in jobs:
            commit_token_dataset(smoke, steps)
            job = run_worker("llama1b", llama_doc(smoke, steps), work, out, env, timeout_s=min(360.0, left() - 10))
            results["llama1b"] = summarise(job, smoke, skip_first=3 if smoke else 5)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    rows = checks(results, expect, smoke)
    ok = all(status != "FAIL" for _, status, _ in rows)
    summary = {"mode": "smoke" if smoke else "gpu", "ok": ok, "wall_s": round(time.perf_counter() - t_start, 1),
               "targets": {"mfu_min": MFU_TARGET, "prediction_tolerance": PREDICTION_TOLERANCE},
               "jobs": results, "checks": [{"check": c, "status": s, "detail": d} for c, s, d in rows]}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n==== gpu_check summary ====")
    for check, status, detail in rows:
        print(f"{status:>16}  {check}: {detail}")
    print(f"==== {'PASS' if ok else 'FAIL'} ({summary['mode']}, {summary['wall_s']}s; numbers in "
          f"{out / 'gpu_check.json'}) ====")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
