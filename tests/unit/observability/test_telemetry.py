"""Node telemetry: the NVML source against a fake NVML module (no GPU here), the CPU fallback, the background
sampler's events and its Prometheus endpoint (prometheus-client, scraped over loopback).

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import sys
import time
import types
import urllib.request

from trainforge.contract.events import System
from trainforge.infra.backends.local import free_port
from trainforge.trainer.telemetry import CpuSource, NvmlSource, TelemetrySampler, open_source


def fake_nvml(devices=2, ecc_unc=0):
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM, nv.NVML_TEMPERATURE_GPU = 1, 0
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC = 1, 0, 0
    nv.nvmlInit = lambda: None
    nv.nvmlDeviceGetCount = lambda: devices
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=50 + 10 * h, memory=20)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=(h + 1) * 2**30)
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    nv.nvmlDeviceGetTemperature = lambda h, kind: 61
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4  # SW power cap

    def no_power(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nv.nvmlDeviceGetPowerUsage = no_power
    nv.nvmlDeviceGetTotalEccErrors = lambda h, kind, counter: ecc_unc if kind == 1 else 3
    return nv


def test_nvml_source_samples_every_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(ecc_unc=1))
    source = open_source()
    assert isinstance(source, NvmlSource) and source.kind == "nvml"
    s = source.sample()
    assert s["gpu0_util_percent"] == 50 and s["gpu1_util_percent"] == 60
    assert s["gpu_util_percent_mean"] == 55
    assert s["gpu1_mem_peak_bytes"] == 2 * 2**30 and s["gpu0_sm_clock_mhz"] == 1980
    assert s["gpu0_throttle_reasons"] == 4 and s["gpu0_temperature_c"] == 61
    assert "gpu0_power_w" not in s  # not exposed: skipped, not an error
    assert s["gpu_ecc_uncorrected"] == 2 and s["gpu_ecc_corrected"] == 6


def test_cpu_fallback_when_nvml_has_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(devices=0))
    source = open_source()
    assert isinstance(source, CpuSource)
    s = source.sample()
    assert s["workers_rss_bytes"] > 10e6 and 0 <= s["cpu_percent"] <= 100 * 64
    assert s["workers_rss_peak_bytes"] >= s["workers_rss_bytes"]


def test_sampler_emits_system_events_and_serves_prometheus():
    events = []
    port = free_port()
    sampler = TelemetrySampler(events.append, lambda: 7, job_id="job-1", node=0,
                               interval_s=0.05, prometheus_port=port, source=CpuSource()).start()
    try:
        body = ""
        for _ in range(100):
            time.sleep(0.05)
            if events:
                body = urllib.request.urlopen(f"http://127.0.0.1:{sampler.exporter.port}/metrics", timeout=5).read()
                body = body.decode()
                if "trainforge_cpu_percent" in body:
                    break
        assert 'trainforge_workers_rss_bytes{job="job-1",node="0"}' in body
    finally:
        sampler.close()
    last = events[-1]
    assert isinstance(last, System) and last.source == "cpu" and last.step == 7
