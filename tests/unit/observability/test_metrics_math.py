"""Pure parts of the trainer's step metrics: MFU, the step-time split, pipeline bubble, rank aggregation, the
peak FLOP/s source, the CPU calibration cache and the async event writer.

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import json
import threading

import pytest

from trainforge.contract.events import Metrics, System
from trainforge.events import AsyncEventWriter, EventWriter, read_events
from trainforge.plan.hardware import GPU_CATALOG
from trainforge.plan.model import preset
from trainforge.trainer.metrics import (
    RANK_FIELDS,
    aggregate,
    bubble_fraction,
    calibrate_cpu_peak,
    compute_mfu,
    device_peak_flops,
    gpu_type_from_name,
    split_step,
)


def test_mfu_is_model_flops_over_peak():
    # 1 GFLOP per token, 1000 tokens, 1 s, 2 devices of 1 TFLOP/s: 1e12 / 2e12 = 0.5
    assert compute_mfu(1e9, 1000, 1.0, 1e12, 2) == pytest.approx(0.5)
    assert compute_mfu(1e9, 1000, 0.5, 1e12, 2) == pytest.approx(1.0)
    assert compute_mfu(1e9, 1000, 0.0, 1e12, 2) == 0.0


def test_mfu_matches_the_planner_for_a_known_model():
    shape = preset("tiny")
    flops = shape.model_flops_per_token(128)
    assert flops > 6 * (shape.total_params - shape.embedding_params) - 1  # 6N + attention
    h100 = GPU_CATALOG["h100"].peak_flops("bf16")
    mfu = compute_mfu(flops, 1_000_000, 1.0, h100, 8)
    assert mfu == pytest.approx(flops * 1e6 / (8 * 989e12))


@pytest.mark.parametrize(("layout", "local_batch", "expected"), [
    ({"pp": 1}, 8, 0.0),
    ({"pp": 2, "micro_batch_size": 1}, 8, 1 / 9),  # (p-1)/(m + p-1) with m = 8
    ({"pp": 4, "vpp": 2, "micro_batch_size": 2}, 8, 1.5 / 5.5),  # m = 4, (p-1)/v = 1.5
])
def test_bubble_fraction(layout, local_batch, expected):
    assert bubble_fraction(layout, local_batch) == pytest.approx(expected)


def test_split_adds_up_to_step_time():
    split = split_step(step_time_s=1.0, data_wait_s=0.1, fb_s=0.7, comm_tail_s=0.2, sync_s=0.05, bubble_frac=0.0)
    assert split["compute_s"] == pytest.approx(0.5)
    assert split["exposed_comm_s"] == pytest.approx(0.25)
    assert sum(split.values()) == pytest.approx(1.0)
    # bubble taken out of compute, tail clamped to forward+backward
    split = split_step(1.0, 0.0, 0.8, 5.0, 0.0, 0.25)
    assert split["exposed_comm_s"] == pytest.approx(0.8) and split["compute_s"] == 0.0
    split = split_step(1.0, 0.0, 0.8, 0.0, 0.0, 0.25)
    assert split["bubble_s"] == pytest.approx(0.2) and split["compute_s"] == pytest.approx(0.6)
    assert sum(split.values()) == pytest.approx(1.0)


def _row(step, wait, comm, mem):
    values = {"step_time_s": step, "data_wait_s": wait, "compute_s": step - comm - wait, "exposed_comm_s": comm,
              "bubble_s": 0.0, "optimizer_s": 0.0, "peak_mem_bytes": mem}
    return [values[f] for f in RANK_FIELDS]


def test_aggregate_min_median_max_and_straggler():
    # rank 2 computes longest; the others wait for it in the all-reduce (equal step times)
    rows = [_row(1.0, 0.0, 0.4, 100), _row(1.0, 0.0, 0.3, 300), _row(1.0, 0.0, 0.0, 200)]
    agg = aggregate(rows)
    assert agg["step_time_s_min"] == agg["step_time_s_max"] == 1.0
    assert (agg["peak_mem_bytes_min"], agg["peak_mem_bytes_median"], agg["peak_mem_bytes_max"]) == (100, 200, 300)
    assert agg["straggler_rank"] == 2
    assert agg["straggler_ratio"] == pytest.approx(1.0 / 0.65)  # over the median of the others (0.6, 0.7)
    two = aggregate([_row(1.0, 0.0, 0.0, 1), _row(1.0, 0.0, 0.3 / 1.3, 1)])  # rank 0 computes 30% longer
    assert two["straggler_rank"] == 0 and two["straggler_ratio"] == pytest.approx(1.3)
    assert aggregate([]) == {}


def test_single_rank_aggregate_has_no_straggler_excess():
    agg = aggregate([_row(0.5, 0.1, 0.0, 10)])
    assert agg["straggler_rank"] == 0 and agg["straggler_ratio"] == 1.0


@pytest.mark.parametrize(("name", "mem", "expected"), [
    ("NVIDIA H100 80GB HBM3", 80 * 2**30, "h100"), ("NVIDIA H200", 141 * 2**30, "h200"),
    ("NVIDIA A100-SXM4-40GB", 40 * 2**30, "a100-40gb"), ("NVIDIA A100-SXM4-80GB", 80 * 2**30, "a100-80gb"),
    ("Tesla T4", 16 * 2**30, None)])
def test_gpu_type_from_device_name(name, mem, expected):
    assert gpu_type_from_name(name, mem) == expected


def test_peak_source_catalog_or_calibration():
    peak, source = device_peak_flops("h100", "bf16", lambda: 1.0)
    assert (peak, source) == (989e12, "catalog:h100")
    assert device_peak_flops("h100", "fp32", lambda: 1.0)[0] == 67e12
    assert device_peak_flops(None, "fp32", lambda: 5e9) == (5e9, "calibrated-cpu")
    assert device_peak_flops("cpu", "fp32", lambda: 5e9) == (5e9, "calibrated-cpu")


def test_cpu_calibration_is_measured_once_and_cached(tmp_path):
    first = calibrate_cpu_peak("fp32", threads=1, cache_dir=tmp_path, size=128, seconds=0.05)
    assert first > 1e8  # any CPU does >0.1 GFLOP/s on a 128^3 matmul
    cache = json.loads((tmp_path / "cpu-peak.json").read_text())
    assert list(cache.values()) == [first]
    assert calibrate_cpu_peak("fp32", threads=1, cache_dir=tmp_path, size=128, seconds=0.05) == first


def test_ranks_starting_together_measure_the_cpu_once(tmp_path):
    """Each rank of a host calls the calibration as it starts: one measures, the others wait for its figure (they
    would each time their own matmuls, on a CPU the others load, and get as many different figures)."""
    results: list[float] = []
    threads = [threading.Thread(target=lambda: results.append(
        calibrate_cpu_peak("fp32", threads=1, cache_dir=tmp_path, size=128, seconds=0.2))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and len(set(results)) == 1
    assert list(json.loads((tmp_path / "cpu-peak.json").read_text()).values()) == results[:1]


def test_async_writer_keeps_order_and_flushes_on_close(tmp_path):
    writer = AsyncEventWriter(EventWriter(tmp_path, enabled=True))
    threads = [threading.Thread(target=lambda: writer.publish(System(step=0, source="cpu", cpu_percent=1.0))) for _ in range(3)]
    for i in range(200):
        writer.publish(Metrics(step=i + 1, loss=1.0))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    events, _ = read_events(tmp_path / "events.jsonl")
    steps = [e["step"] for e in events if e["type"] == "metrics"]
    assert steps == list(range(1, 201))
    assert sum(e["type"] == "system" for e in events) == 3


def test_async_writer_disabled_off_rank0(tmp_path):
    writer = AsyncEventWriter(EventWriter(tmp_path, enabled=False))
    writer.publish(Metrics(step=1))
    writer.close()
    assert not (tmp_path / "events.jsonl").exists()
