"""Health of a running gang: the declarative policy, and the worker side of detection.

What each failure class is detected by, and what follows (the supervisor in trainforge/tasks/supervisor.py
reads the heartbeats this module sends through the node's channel publisher; docs/fault-tolerance.md has the
state machine):

| class                  | detected by                                              | action (policy)                   |
|------------------------|----------------------------------------------------------|-----------------------------------|
| process / node loss    | a heartbeat per rank every `heartbeat_interval_s`, in    | in-segment restart (torchrun), or |
|                        | its node's batches: the sidecar's process check, the     | segment retry (re-provision)      |
|                        | beat's age, the node's batches stopping                  |                                   |
| hang (collective, I/O) | step-progress watchdog in the supervisor + the process   | dump every rank's stack, name the |
|                        | group's collective timeout (from the plan, not 30 min)   | rank and line, kill, restart      |
| divergence             | NaN/Inf loss or grad norm; robust z-score loss spike     | roll back + skip the batch, or    |
|                        | over a window (global values: every rank agrees)         | stop                              |
| straggler              | per-rank local time per step vs the median of ranks      | report with evidence, or evict    |
| spot preemption        | SIGTERM (termination notice) / scheduler `preempting`    | emergency checkpoint, clean stop  |
| GPU health             | NVML with every heartbeat, where present: uncorrected    | stop the gang now; node marked    |
|                        | ECC, retired pages, critical Xids, hardware slowdown     | unhealthy, re-placed without it   |

Importing this module pulls in no torch: the control plane reads the policy and the heartbeat journal's layout
from here.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import math
import os
import re
import signal
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainforge.contract.events import Heartbeat, dump_event

# The policy lives in the contract (a worker reads it from its SegmentConfig); re-exported here for its users.
from trainforge.contract.health import ENV_VAR as ENV_VAR
from trainforge.contract.health import HealthPolicy as HealthPolicy
from trainforge.events import rank_client

logger = logging.getLogger(__name__)



def collective_timeout_for(step_time_s: float | None, *, factor: float = 20.0, floor_s: float = 30.0,
                           ceiling_s: float = 600.0) -> float:
    """The process-group timeout from the plan's predicted step time: long enough for a slow step and start-up
    skew between ranks, short enough that a stuck collective fails in seconds to minutes, never torch's 30 min."""
    if not step_time_s or not math.isfinite(step_time_s):
        return floor_s * 4
    return min(ceiling_s, max(floor_s, factor * step_time_s))


# ------------------------------------------------------------------------------------------ divergence


class DivergenceError(FloatingPointError):
    """Training diverged at `step` (0-based index of the batch that produced the bad loss)."""

    def __init__(self, step: int, reason: str, action: str):
        super().__init__(f"divergence at step {step + 1}: {reason} (policy: {action})")
        self.step, self.reason, self.action = step, reason, action


@dataclass
class DivergenceDetector:
    """NaN/Inf loss or grad norm, and loss spikes by a robust z-score: 0.6745 (x - median) / MAD over a window
    (Iglewicz & Hoaglin's modified z-score; the median and MAD ignore earlier spikes, unlike a mean and std)."""

    window: int = 32
    min_window: int = 16
    z_threshold: float = 10.0
    min_rel: float = 0.5
    history: deque[float] = field(default_factory=deque)

    def observe(self, loss: float, grad_norm: float | None = None) -> str | None:
        if not math.isfinite(loss):
            return f"loss is {loss}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"gradient norm is {grad_norm}"
        reason = None
        if len(self.history) >= self.min_window:
            z = robust_z(loss, list(self.history))
            med = statistics.median(self.history)
            if z > self.z_threshold and loss > med + self.min_rel * abs(med):
                reason = f"loss spike {loss:.4g} (robust z-score {z:.1f} > {self.z_threshold:g} over the last " \
                         f"{len(self.history)} steps, median {statistics.median(self.history):.4g})"
        if reason is None:  # spikes stay out of the reference window
            self.history.append(loss)
            while len(self.history) > self.window:
                self.history.popleft()
        return reason


def robust_z(x: float, values: list[float]) -> float:
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    mad = max(mad, 1e-3 * max(abs(med), 1e-12))  # a flat window must not turn noise into infinite z
    return 0.6745 * (x - med) / mad


# ------------------------------------------------------------------------------------------ files


def health_dir(run_dir: str | Path, attempt: int | str) -> Path:
    return Path(run_dir) / "health" / f"segment-{attempt}"


def stacks_dir(run_dir: str | Path, attempt: int | str) -> Path:
    return Path(run_dir) / "artifacts" / "stacks" / f"segment-{attempt}"


SOCKET_ENV = "TRAINFORGE_CHANNEL_SOCKET"
"""The worker's environment variable naming its node's publisher socket (a leading '@': abstract namespace; read
by trainforge/events.py `rank_client`); it names the node's stack-dump folder too."""


def node_stacks_dir(socket_path: str) -> Path:
    """Where the ranks of a node write their faulthandler dumps when they have a node publisher: a folder on the
    node itself (its temporary directory), named after the publisher's socket, which is unique per node and
    segment attempt. The node's sidecar (trainforge/infra/backends/sidecar.py) creates it, reads each rank's file
    there after a `dump_stacks` and removes the folder at the end; the files are `stacks_file_name(rank, restart)`."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket_path.lstrip("@"))
    return Path(tempfile.gettempdir()) / f"trainforge-stacks-{name}"


def stacks_file_name(rank: int, restart: int) -> str:
    return f"rank-{rank:05d}-restart-{restart}.txt"


def where_am_i() -> dict[str, str]:
    """What a rank observes of its own placement: its network namespace and the address it reaches its gang's
    rendezvous from (a UDP `connect` sends nothing; it only asks the kernel for the route's source address). So
    where a rank ran is known from the rank itself, not from what its launcher meant to do."""
    import socket

    out = {}
    with contextlib.suppress(OSError):
        out["netns"] = os.readlink("/proc/self/ns/net")
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError, ValueError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "9"))))
            out["address"] = s.getsockname()[0]
    return out


def heartbeat_path(run_dir: str | Path, attempt: int | str, rank: int) -> Path:
    """Where the control plane journals a rank's last heartbeat at the end of a segment (tasks/supervisor.py)."""
    return health_dir(run_dir, attempt) / f"rank-{rank:05d}.json"


def read_heartbeats(run_dir: str | Path, attempt: int | str) -> dict[int, dict[str, Any]]:
    """The journal of a segment's last beat per rank (a post-mortem record: live beats travel in the channel)."""
    out = {}
    for path in health_dir(run_dir, attempt).glob("rank-*.json"):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced while reading: the next poll sees it
            continue
        out[int(beat["rank"])] = beat
    return out


# ------------------------------------------------------------------------------------------ GPU health


HW_SLOWDOWN = 0x8 | 0x40 | 0x80
"""Clock-event (throttle) reasons that mean the hardware is in trouble: HW slowdown, HW thermal, HW power brake (a
software power cap or an idle clock is not a fault)."""
CRITICAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
"""Xid events that mean the GPU (not the user's code) failed: double-bit ECC (48), internal micro-controller halt
(61, 62), row-remapping events (63, 64), NVLink error (74), fell off the bus (79), high single-bit ECC rate (92),
contained / uncontained ECC errors (94, 95), GSP errors (119, 120), unrecovered ECC (140). Xids 13, 31, 43 and the
like follow from the user's kernels and are left to the process' own failure."""
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
RETIRED_CAUSES = (0, 1)  # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, _DOUBLE_BIT_ECC_ERROR


def visible_nvml_indices(count: int, env: Mapping[str, str] | None = None) -> list[int]:
    """The NVML indices of the GPUs this process may use. NVML ignores CUDA_VISIBLE_DEVICES and lists every GPU
    of the node, other tenants' included; the worker's devices are the ones the scheduler allocated to its job
    (infra/launch.py `device_environment`), so only those are sampled and reported. Numeric entries are NVML
    indices; UUID or MIG names (no index to read) leave the whole node."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(count))
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        return list(range(count))
    picked: list[int] = []
    for e in entries:  # CUDA stops at the first invalid entry; so does this
        if int(e) >= count:
            break
        picked.append(int(e))
    return picked


class GpuHealthSampler:
    """NVML's health view of this node's GPUs, opened once and sampled with every heartbeat: uncorrected ECC
    errors (volatile), retired pages and a retirement waiting for a reset, critical Xid events (from an event set
    drained without waiting) and hardware throttle reasons, per device, with the reasons a device is unhealthy.

    `open()` gives why there is none on a host without NVML or without a GPU, so CPU hosts never pay."""

    def __init__(self, nv: Any):
        self.nv = nv
        self.indices = visible_nvml_indices(nv.nvmlDeviceGetCount())
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
        self.xids: dict[int, list[int]] = {i: [] for i in self.indices}
        self._events: Any = None
        try:  # Xid events: a set the driver fills; a board or driver without them just has no Xid column
            self._events = nv.nvmlEventSetCreate()
            for h in self.handles:
                nv.nvmlDeviceRegisterEvents(h, XID_EVENT, self._events)
        except Exception:
            self._events = None

    @classmethod
    def open(cls) -> GpuHealthSampler | str:
        """The sampler, or why there is none (no nvidia-ml-py, no driver, no GPU)."""
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            return "NVML not available on this host (nvidia-ml-py not installed)"
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # no driver / no GPU
            return f"NVML not available on this host: {exc}"
        try:
            sampler = cls(pynvml)
        except Exception as exc:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return f"NVML could not list the GPUs: {exc}"
        if not sampler.handles:
            sampler.close()
            return "NVML sees no GPU on this host"
        return sampler

    def _drain_xids(self) -> None:
        if self._events is None:
            return
        wait = getattr(self.nv, "nvmlEventSetWait_v2", None) or self.nv.nvmlEventSetWait
        for _ in range(1024):  # bounded: a storm of events is not read forever in one beat
            try:
                data = wait(self._events, 0)  # 0 ms: only what already happened
            except Exception:  # NVML_ERROR_TIMEOUT: nothing more
                return
            try:  # handles are ctypes pointers (no equality by value): the device's index names it
                index = int(self.nv.nvmlDeviceGetIndex(data.device))
            except Exception:
                index = next((i for i, h in zip(self.indices, self.handles, strict=True) if h is data.device), -1)
            if index in self.xids:
                self.xids[index].append(int(data.eventData))
                del self.xids[index][:-16]

    def sample(self) -> dict[str, Any]:
        """One look at every device (a call a board does not support gives None, not an error)."""
        nv = self.nv
        self._drain_xids()
        devices = []
        for i, h in zip(self.indices, self.handles, strict=True):
            dev: dict[str, Any] = {"index": i}
            for name, call in (
                ("ecc_uncorrected", lambda h=h: nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)),
                ("temperature_c", lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                ("sm_clock_mhz", lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                ("throttle_reasons", lambda h=h: self._clock_event_reasons(h)),
                ("retired_pages", lambda h=h: sum(len(nv.nvmlDeviceGetRetiredPages(h, c)) for c in RETIRED_CAUSES)),
                ("retired_pages_pending", lambda h=h: nv.nvmlDeviceGetRetiredPagesPendingStatus(h)),
            ):
                try:
                    dev[name] = int(call())
                except Exception:  # not supported on this board
                    dev[name] = None
            critical = [x for x in self.xids[i] if x in CRITICAL_XIDS]
            dev["xids"] = list(self.xids[i])
            reasons = []
            if dev["ecc_uncorrected"]:
                reasons.append(f"{dev['ecc_uncorrected']} uncorrected ECC error(s)")
            if dev["retired_pages_pending"]:
                reasons.append("a page retirement waits for a GPU reset")
            if critical:
                reasons.append(f"critical Xid {critical[-1]}")
            if (dev["throttle_reasons"] or 0) & HW_SLOWDOWN:
                reasons.append(f"hardware slowdown (clock-event reasons {dev['throttle_reasons']:#x})")
            dev["reasons"], dev["healthy"] = reasons, not reasons
            devices.append(dev)
        return {"available": True, "devices": devices, "healthy": all(d["healthy"] for d in devices)}

    def _clock_event_reasons(self, h: Any) -> int:
        # The newer name first (the "throttle" one is deprecated in recent drivers' bindings)
        fn = getattr(self.nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            self.nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(h))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._events is not None:
                self.nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


def gpu_health() -> dict[str, Any]:
    """One sample of `GpuHealthSampler` (opened and closed), or a clear 'not available' on a host without NVML."""
    sampler = GpuHealthSampler.open()
    if isinstance(sampler, str):
        return {"available": False, "reason": sampler}
    try:
        return sampler.sample()
    finally:
        sampler.close()


# ------------------------------------------------------------------------------------------ worker side


class HealthMonitor:
    """One per worker process: heartbeats from a thread, stack dumps on SIGUSR1 (faulthandler), a SIGTERM
    handler that turns a termination notice into a checkpoint at the next step boundary, and the per-step
    divergence / straggler measurements. Started by the worker before torch is imported.

    The heartbeats (typed `Heartbeat`s) go to the node's publisher over its socket ($TRAINFORGE_CHANNEL_SOCKET,
    the backend's sidecar), the only way the control plane supervises a rank. A worker started without one (the
    trainer driven directly, e.g. in tests) is not supervised: its monitor keeps the state and sends nothing."""

    def __init__(self, policy: HealthPolicy, run_dir: str | Path, rank: int, attempt: int | str, *,
                 handle_sigterm: bool = True):
        self.policy = policy
        self.handle_sigterm = handle_sigterm
        self.rank = rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.run_dir, self.attempt = run_dir, attempt
        self._client = rank_client(rank)
        self.detector = DivergenceDetector(policy.spike_window, policy.spike_min_window, policy.spike_z,
                                           policy.spike_min_rel)
        self.stop_requested = False
        self.stop_requested_at: float | None = None
        self._ctx: Any = None
        self._state: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "restart": self.restart,
                                       "host": os.uname().nodename, **where_am_i(), "phase": "starting",
                                       "step": None,
                                       "step_started": time.time(), "steps_done": 0, "step_s": None,
                                       "local_s": None, "started": time.time()}
        self._local: deque[float] = deque(maxlen=8)
        self._steps: deque[float] = deque(maxlen=8)
        self._begin = 0.0
        self._stack_file = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True)
        self._gpu: GpuHealthSampler | None = None
        self._gpu_thread: threading.Thread | None = None

    def start(self) -> HealthMonitor:
        # With a node publisher the dump goes to a file on this node, which the node's sidecar reads after
        # SIGUSR1 and sends up the channel (the control plane writes artifacts/stacks/ from the text it receives).
        stacks = node_stacks_dir(os.environ[SOCKET_ENV]) if self._client is not None else \
            stacks_dir(self.run_dir, self.attempt)
        stacks.mkdir(parents=True, exist_ok=True)
        self._stack_file = open(stacks / stacks_file_name(self.rank, self.restart), "w")  # noqa: SIM115
        faulthandler.register(signal.SIGUSR1, file=self._stack_file, all_threads=True)
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        gpu = GpuHealthSampler.open()
        if isinstance(gpu, str):
            self._state["gpu"] = {"available": False, "reason": gpu}
        else:
            self._gpu = gpu
            self._sample_gpu()
        self._write()
        if self._client is not None:  # nobody to beat to otherwise
            self._thread.start()
            if self._gpu is not None:
                # Its own thread: an NVML call that hangs on a GPU that fell off the bus must not stop the beats
                # (each beat carries the latest sample, taken every heartbeat interval).
                self._gpu_thread = threading.Thread(target=self._gpu_loop, name="gpu-health", daemon=True)
                self._gpu_thread.start()
        return self

    def _sample_gpu(self) -> bool:
        """One NVML sample into the beat's state; True when a device just turned unhealthy."""
        assert self._gpu is not None
        try:
            sample = self._gpu.sample()
        except Exception as e:  # NVML itself failed (a driver in trouble): say so, the supervisor judges
            sample = {"available": False, "reason": f"NVML sample failed: {type(e).__name__}: {e}"}
        was = (self._state.get("gpu") or {}).get("healthy", True)
        self._state["gpu"] = sample
        return was is not False and sample.get("healthy") is False

    def _gpu_loop(self) -> None:
        while not self._stop.wait(self.policy.heartbeat_interval_s):
            if self._sample_gpu():
                logger.error("rank %d: GPU unhealthy: %s", self.rank, "; ".join(
                    r for d in self._state["gpu"]["devices"] for r in d["reasons"]))
                with contextlib.suppress(OSError):
                    self._write()  # news that must not wait for the next beat

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """While training, a notice means: checkpoint at the next step boundary (the loop agrees on it across
        ranks), bounded by the grace period. Outside training, or at a second notice, stop now."""
        if self.stop_requested or self._state["phase"] != "training":
            self.close("terminated")
            os._exit(128 + signum)
        self.stop_requested, self.stop_requested_at = True, time.time()
        self._state["phase_note"] = "termination notice received"
        self._write()
        timer = threading.Timer(self.policy.preemption_grace_s, lambda: os._exit(128 + signum))
        timer.daemon = True
        timer.start()

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.policy.heartbeat_interval_s):
            try:
                self._write()
            except OSError:  # the node's socket is gone: its publisher (and the supervision) too
                return
            if self._client is not None and self._client.lease_expired():
                # Nobody supervises this rank any more (its node's publisher went silent for a lease): stop.
                logger.error("rank %d: the node publisher's lease lapsed: stopping", self.rank)
                self.close("terminated")
                os._exit(143)

    def heartbeat(self) -> Heartbeat:
        """This rank's beat now, typed (a wrong field fails here, at the sender)."""
        return Heartbeat.model_validate({**self._state, "time": time.time()})

    def _write(self) -> None:
        if self._client is not None:
            self._client.heartbeat(**dump_event(self.heartbeat()))  # never blocks: a datagram, else buffered

    def set_phase(self, phase: str) -> None:
        self._state["phase"] = phase
        self._state["step_started"] = time.time()

    # -------------------------------------------------------------- the managed loop calls these
    def attach(self, ctx: Any, start_step: int) -> None:
        """The process group is up and the checkpoint restored: training starts at `start_step`."""
        self._ctx = ctx
        self._state.update(phase="training", step=start_step, resumed_from=start_step)

    def begin_step(self, step: int) -> None:
        self._begin = time.perf_counter()
        self._state.update(step=step, step_started=time.time())

    def local_done(self) -> None:
        """This rank's own work before the step's first collective (data, injected delays) is done."""
        self._local.append(time.perf_counter() - self._begin)
        self._state["local_s"] = statistics.median(self._local)

    def end_step(self, step: int, loss: float, grad_norm: float | None, step_s: float) -> bool:
        """Divergence per policy (raises DivergenceError) and the stop agreement: True = checkpoint now and end
        the segment (a termination notice reached some rank). One tiny all-reduce makes every rank agree."""
        self._steps.append(step_s)
        self._state.update(steps_done=self._state["steps_done"] + 1, step_s=statistics.median(self._steps),
                           step=step + 1, step_started=time.time())
        reason = self.detector.observe(loss, grad_norm)
        stop, diverged = self._agree(self.stop_requested, reason is not None)
        if diverged:
            raise DivergenceError(step, reason or "diverged on another rank", self.policy.divergence_action)
        if stop:
            self._state["phase"] = "preempted"
        return stop

    def _agree(self, stop: bool, diverged: bool) -> tuple[bool, bool]:
        ctx = self._ctx
        if ctx is None or ctx.world_size == 1:
            return stop, diverged
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(stop), float(diverged)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] > 0), bool(t[1] > 0)

    def close(self, phase: str = "done") -> None:
        self._state["phase"] = phase
        self._stop.set()
        # A beat the heartbeat thread was sending (built before the phase changed) must not arrive after the last
        # one and leave the rank `script` / `training` in the supervisor's eyes: let that send finish first.
        beat = self._thread
        if beat.is_alive() and beat is not threading.current_thread():
            beat.join(timeout=max(1.0, 2 * self.policy.heartbeat_interval_s))
        with contextlib.suppress(OSError):
            self._write()
        if self._client is not None:
            self._client.drain()  # the last beat (done / failed) must reach the publisher before this exits
        if self._gpu is not None:
            if self._gpu_thread is not None:
                self._gpu_thread.join(timeout=1.0)
            # Shut NVML down only once no sample is in flight (one hung on a dead GPU: the process exit frees it)
            if self._gpu_thread is None or not self._gpu_thread.is_alive():
                self._gpu.close()


class NullMonitor:
    """The loop's monitor when no worker started one (the trainer driven directly, e.g. in tests)."""

    stop_requested = False

    def __init__(self) -> None:
        self.detector = DivergenceDetector()

    def attach(self, ctx: Any, start_step: int) -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def local_done(self) -> None:
        pass

    def set_phase(self, phase: str) -> None:
        pass

    def end_step(self, step: int, loss: float, grad_norm: float | None, step_s: float) -> bool:
        reason = self.detector.observe(loss, grad_norm)
        if reason is not None:
            raise DivergenceError(step, reason, "stop")
        return False

    def close(self, phase: str = "done") -> None:
        pass


_CURRENT: HealthMonitor | None = None


def start_monitor(policy: HealthPolicy, run_dir: str | Path, rank: int, attempt: int | str, *,
                  handle_sigterm: bool = True) -> HealthMonitor:
    global _CURRENT
    _CURRENT = HealthMonitor(policy, run_dir, rank, attempt, handle_sigterm=handle_sigterm).start()
    return _CURRENT


def current_monitor() -> HealthMonitor | NullMonitor:
    return _CURRENT if _CURRENT is not None else NullMonitor()
