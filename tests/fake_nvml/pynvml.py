"""A stand-in for nvidia-ml-py's `pynvml` on hosts without GPUs: put this folder on PYTHONPATH (a worker imports
it as `pynvml`) and say what fails in $TRAINFORGE_FAKE_NVML, comma-separated:

    devices=2            GPUs on the node (default 1)
    fail=ecc             uncorrected ECC errors appear     | fail=xid:79  a critical Xid event (GPU fell off the bus)
    fail=retired         a page retirement waits for reset | fail=slowdown  hardware slowdown clock-event reason
    device=1             which GPU fails (default 0)
    group_rank=1         only on the node of that rank ($GROUP_RANK, set by torchrun), default every node
    attempt=0            only in that segment attempt ($TRAINFORGE_SEGMENT_ATTEMPT), default every attempt
    after_s=3            seconds after the process' nvmlInit (default 0)

Unset, every GPU is healthy. Only what trainforge reads is here (trainer/health.py, trainer/telemetry.py).
"""

from __future__ import annotations

import os
import time
import types

NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 0, 1
NVML_VOLATILE_ECC = 0
NVML_ERROR_TIMEOUT = 10
nvmlEventTypeXidCriticalError = 0x8

_started: float | None = None
_xid_sent: set[int] = set()


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


def _spec() -> dict[str, str]:
    raw = os.environ.get("TRAINFORGE_FAKE_NVML", "")
    return dict(part.split("=", 1) for part in raw.split(",") if "=" in part)


def _failing(index: int) -> str | None:
    spec = _spec()
    if "fail" not in spec or int(spec.get("device", 0)) != index:
        return None
    if "group_rank" in spec and os.environ.get("GROUP_RANK") != spec["group_rank"]:
        return None
    if "attempt" in spec and os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0") != spec["attempt"]:
        return None
    if _started is None or time.monotonic() - _started < float(spec.get("after_s", 0)):
        return None
    return spec["fail"]


def nvmlInit() -> None:
    global _started
    if _started is None:
        _started = time.monotonic()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return int(_spec().get("devices", 1))


def nvmlDeviceGetHandleByIndex(i: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(index=i)


def nvmlDeviceGetIndex(h: types.SimpleNamespace) -> int:
    return h.index


def nvmlDeviceGetTotalEccErrors(h, kind: int, counter: int) -> int:
    return 2 if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED and _failing(h.index) == "ecc" else 0


def nvmlDeviceGetRetiredPages(h, cause: int) -> list[int]:
    return [0x1F000] if cause == 1 and _failing(h.index) == "retired" else []


def nvmlDeviceGetRetiredPagesPendingStatus(h) -> int:
    return int(_failing(h.index) == "retired")


def nvmlDeviceGetCurrentClocksEventReasons(h) -> int:
    return 0x8 if _failing(h.index) == "slowdown" else 0x1  # HW slowdown, else GPU idle


def nvmlDeviceGetTemperature(h, sensor: int) -> int:
    return 64


def nvmlDeviceGetClockInfo(h, kind: int) -> int:
    return 1980


def nvmlDeviceGetPowerUsage(h) -> int:
    return 300_000


def nvmlDeviceGetUtilizationRates(h) -> types.SimpleNamespace:
    return types.SimpleNamespace(gpu=90, memory=40)


def nvmlDeviceGetMemoryInfo(h) -> types.SimpleNamespace:
    return types.SimpleNamespace(used=8 << 30, total=80 << 30)


def nvmlEventSetCreate() -> list:
    return []


def nvmlDeviceRegisterEvents(h, types_mask: int, event_set: list) -> None:
    event_set.append(h)


def nvmlEventSetWait_v2(event_set: list, timeout_ms: int) -> types.SimpleNamespace:
    for h in event_set:
        fail = _failing(h.index) or ""
        if fail.startswith("xid:") and h.index not in _xid_sent:
            _xid_sent.add(h.index)  # an event is delivered once, like the driver's
            return types.SimpleNamespace(device=h, eventType=nvmlEventTypeXidCriticalError,
                                         eventData=int(fail[4:]))
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: list) -> None:
    event_set.clear()
