"""Node telemetry: a background thread on each node's local rank 0 samples the hardware every few seconds.

GPU hosts (NVML through `nvidia-ml-py`): per GPU utilisation, memory used and its high-water mark, SM clock,
temperature, clock-event (throttle) reasons as a bit mask, uncorrected/corrected ECC counts (volatile), power, and
NVLink throughput counters where the driver exposes them. CPU hosts (no NVML or no GPU): host CPU %, this node's
worker processes' RSS and its high-water mark, and `source = cpu` says so.

Each sample goes to (a) the job's events as a `system` event (rank 0's node; the flow logs it under MLflow's
`system/` namespace) and (b) Prometheus gauges served on $TRAINFORGE_PROMETHEUS_PORT (+ node rank) when set,
for clusters that already scrape. Sampling never touches the training thread: NVML/psutil calls run here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from trainforge.contract.events import SegmentEvent, System

logger = logging.getLogger(__name__)

INTERVAL_S = float(os.environ.get("TRAINFORGE_TELEMETRY_INTERVAL_S", "5"))


class NvmlSource:
    """GPU metrics of every device on this node through NVML."""

    kind = "nvml"

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        from trainforge.trainer.health import visible_nvml_indices

        # Only this job's GPUs: NVML lists every GPU of the node, other tenants' included.
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in visible_nvml_indices(pynvml.nvmlDeviceGetCount())]
        if not self.handles:
            raise RuntimeError("NVML sees no GPU")
        self.mem_peak = [0] * len(self.handles)

    def _try(self, fn: Callable[[], Any], default: Any = None) -> Any:
        try:
            return fn()
        except Exception:  # a counter this GPU or driver does not expose
            return default

    def sample(self) -> dict[str, float]:
        nv, out = self.nv, {}
        ecc_unc = ecc_cor = 0.0
        for i, h in enumerate(self.handles):
            util = self._try(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h))
            mem = self._try(lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            if util is not None:
                out[f"gpu{i}_util_percent"] = float(util.gpu)
                out[f"gpu{i}_mem_util_percent"] = float(util.memory)
            if mem is not None:
                self.mem_peak[i] = max(self.mem_peak[i], int(mem.used))
                out[f"gpu{i}_mem_used_bytes"] = float(mem.used)
                out[f"gpu{i}_mem_peak_bytes"] = float(self.mem_peak[i])
            for key, fn in (
                ("sm_clock_mhz", lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                ("temperature_c", lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ("throttle_reasons", lambda h=h: nv.nvmlDeviceGetCurrentClocksEventReasons(h)),
                ("power_w", lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ):
                value = self._try(fn)
                if value is not None:
                    out[f"gpu{i}_{key}"] = float(value)
            unc = self._try(lambda h=h: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
            cor = self._try(lambda h=h: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC))
            ecc_unc += float(unc or 0)
            ecc_cor += float(cor or 0)
        out["gpu_ecc_uncorrected"], out["gpu_ecc_corrected"] = ecc_unc, ecc_cor
        utils = [v for k, v in out.items() if k.endswith("_util_percent") and "mem" not in k]
        if utils:
            out["gpu_util_percent_mean"] = sum(utils) / len(utils)
        return out


class CpuSource:
    """CPU hosts: host CPU % and the RSS of the worker processes (this process and its torchrun siblings)."""

    kind = "cpu"

    def __init__(self) -> None:
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.rss_peak = 0
        psutil.cpu_percent(None)  # first call primes the counter

    def _workers(self) -> list[Any]:
        try:
            parent = self.me.parent()
            siblings = [p for p in parent.children() if p.pid != self.me.pid] if parent else []
        except Exception:
            siblings = []
        return [self.me, *siblings]

    def sample(self) -> dict[str, float]:
        rss = 0
        for p in self._workers():
            try:
                rss += p.memory_info().rss
            except Exception:  # exited between listing and reading
                continue
        self.rss_peak = max(self.rss_peak, rss)
        return {"cpu_percent": float(self.psutil.cpu_percent(None)), "workers_rss_bytes": float(rss),
                "workers_rss_peak_bytes": float(self.rss_peak),
                "host_mem_used_percent": float(self.psutil.virtual_memory().percent)}


def open_source() -> Any:
    """NVML when the library and a GPU are present, else the CPU source (logged, so nobody mistakes it)."""
    try:
        return NvmlSource()
    except Exception as exc:
        logger.info("no NVML GPU telemetry (%s): reporting CPU %% and RSS instead", exc)
        return CpuSource()


class PrometheusExporter:
    """Gauges named `trainforge_<field>` labelled by job and node, served by prometheus-client's HTTP server."""

    def __init__(self, port: int, job_id: str, node: int):
        import prometheus_client as prom

        self.prom, self.labels = prom, {"job": job_id, "node": str(node)}
        self.registry = prom.CollectorRegistry()
        self.gauges: dict[str, Any] = {}
        self.server, _ = prom.start_http_server(port, addr=os.environ.get("TRAINFORGE_PROMETHEUS_ADDR", "127.0.0.1"),
                                                registry=self.registry)
        self.port = self.server.server_port

    def update(self, sample: dict[str, float]) -> None:
        for key, value in sample.items():
            gauge = self.gauges.get(key)
            if gauge is None:
                gauge = self.prom.Gauge(f"trainforge_{key}", f"trainforge node telemetry: {key}",
                                        list(self.labels), registry=self.registry)
                self.gauges[key] = gauge
            gauge.labels(**self.labels).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TelemetrySampler:
    """The per-node background thread: sample, hand to `emit` (rank 0's event writer), update Prometheus."""

    def __init__(self, emit: Callable[[SegmentEvent], None], step: Callable[[], int], *, job_id: str, node: int,
                 interval_s: float = INTERVAL_S, prometheus_port: int | None = None, source: Any = None):
        self.emit, self.step, self.interval_s = emit, step, interval_s
        self.source = source or open_source()
        self.exporter = None
        if prometheus_port:
            try:
                self.exporter = PrometheusExporter(prometheus_port + node, job_id, node)
            except OSError as exc:
                logger.warning("Prometheus endpoint on port %s not started: %s", prometheus_port + node, exc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)

    def start(self) -> TelemetrySampler:
        self._thread.start()
        return self

    def sample_once(self) -> dict[str, float]:
        sample = self.source.sample()
        if self.exporter is not None:
            self.exporter.update(sample)
        self.emit(System(step=self.step(), source=self.source.kind, **sample))
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample_once()
            except Exception as exc:  # telemetry must never take the worker down
                logger.warning("telemetry sample failed: %s", exc)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        with contextlib.suppress(Exception):
            self.sample_once()  # one last sample: the high-water marks at the end of the segment
        if self.exporter is not None:
            self.exporter.close()


def maybe_start(emit: Callable[[SegmentEvent], None], step: Callable[[], int], *, job_id: str, local_rank: int,
                node: int) -> TelemetrySampler | None:
    """One sampler per node (local rank 0); $TRAINFORGE_TELEMETRY=0 turns it off."""
    if local_rank != 0 or os.environ.get("TRAINFORGE_TELEMETRY", "1") == "0":
        return None
    port = os.environ.get("TRAINFORGE_PROMETHEUS_PORT")
    return TelemetrySampler(emit, step, job_id=job_id, node=node, prometheus_port=int(port) if port else None,
                            ).start()


