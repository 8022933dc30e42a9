"""Cost of per-step observability on the training step, measured in one run against named baselines.

1. Event logging: the time `emit` holds the step for one realistic `metrics` event (~20 fields), synchronous
   EventWriter (open + write + flush per event, what the loop did before) vs AsyncEventWriter (queue put; a
   background thread writes). Prints the per-event cost of each and the ratio sync / async.
2. StepMeter.end_step (step-time split, RSS high-water, rank vector, MFU, profiler/telemetry bookkeeping) per step,
   single process (the all-gather of world > 1 is asynchronous: issued after step s, collected after s+1).
3. Both as a fraction of a real step of the demo model (the `tiny` preset, batch 8 x seq 128, fp32, 1 thread):
   target <= 1%.

  OMP_NUM_THREADS=1 .venv/bin/python bench/obs_logging.py [--events 2000] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from trainforge.contract.events import Metrics
from trainforge.events import AsyncEventWriter, EventWriter
from trainforge.plan.model import preset

PAYLOAD = {"loss": 2.345678, "grad_norm": 0.98765, "lr": 3e-3, "step_time_s": 0.123456, "tokens_per_s": 8300.0,
           "samples_per_s": 64.8, "data_wait_s": 0.0012, "compute_s": 0.1, "exposed_comm_s": 0.01, "bubble_s": 0.0,
           "optimizer_s": 0.012, "peak_mem_bytes": 412345678.0, "mfu": 0.0123}


def per_event(writer, n: int) -> float:
    """Median seconds one publish call takes (the time the training thread is held)."""
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        writer.publish(Metrics(step=i + 1, **PAYLOAD))  # building the typed event is the sender's cost too
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def model_step_time(steps: int) -> tuple[float, dict]:
    from trainforge.trainer.models.llama import build_model

    shape = preset("tiny")
    model_cfg = {"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads, "kv_heads": shape.kv_heads,
                 "ffn_hidden": shape.ffn_hidden, "vocab": shape.vocab, "experts": 0, "top_k": 0}
    torch.manual_seed(0)
    model = build_model({**model_cfg, "max_seq_len": 128})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, shape.vocab, (8, 129))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]), model_cfg


def meter_cost(model_cfg: dict, run_dir: Path, steps: int) -> float:
    from trainforge.trainer.metrics import StepMeter

    os.environ.setdefault("TRAINFORGE_HOME", str(run_dir))
    os.environ["TRAINFORGE_TELEMETRY"] = "0"
    cfg = SimpleNamespace(name="bench", model=model_cfg, layout={"dp": 1, "pp": 1, "micro_batch_size": 8},
                          training={"seq_len": 128, "global_batch_size": 8, "precision": "fp32"}, extra={},
                          run_dir=str(run_dir), job_id="bench")
    ctx = SimpleNamespace(rank=0, local_rank=0, world_size=1, is_main=True, device=torch.device("cpu"))
    pm = SimpleNamespace(model=torch.nn.Linear(2, 2), forward_backward=lambda *a: 0.0,
                         finish_gradients=lambda: None, global_loss=lambda x: x)
    meter = StepMeter(cfg, ctx, pm, emit=lambda *a, **k: None)
    samples = []
    for step in range(1, steps * 50 + 1):
        pm.forward_backward()
        t0 = time.perf_counter()
        meter.end_step(step, 0.1, 0.001)
        samples.append(time.perf_counter() - t0)
    meter.close()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync_dir, async_dir = Path(tmp, "sync"), Path(tmp, "async")
        sync_dir.mkdir()
        async_dir.mkdir()
        sync_cost = per_event(EventWriter(sync_dir, True), args.events)
        writer = AsyncEventWriter(EventWriter(async_dir, True))
        async_cost = per_event(writer, args.events)
        t0 = time.perf_counter()
        writer.close()
        drain = time.perf_counter() - t0
        written = len((async_dir / "events.jsonl").read_text().splitlines())
        step_s, model_cfg = model_step_time(args.steps)
        end_step = meter_cost(model_cfg, Path(tmp), args.steps)
    print(f"emit, synchronous EventWriter : {sync_cost * 1e6:8.1f} us/event")
    print(f"emit, AsyncEventWriter        : {async_cost * 1e6:8.1f} us/event "
          f"(all {written} written; final drain {drain * 1e3:.1f} ms)")
    print(f"ratio sync / async            : {sync_cost / async_cost:8.1f}x")
    print(f"StepMeter.end_step            : {end_step * 1e6:8.1f} us/step")
    print(f"demo model step (tiny, 8x128) : {step_s * 1e3:8.1f} ms")
    overhead = (async_cost * 2 + end_step) / step_s  # metrics + rank_metrics events + the meter
    print(f"observability per step        : {overhead:8.3%} of the step (sync logging would be "
          f"{(sync_cost * 2 + end_step) / step_s:.3%}); target <= 1%")


if __name__ == "__main__":
    main()
