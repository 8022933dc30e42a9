"""Fault injection for tests and chaos drills: $TRAINFORGE_FAULT="kill:rank=1:step=25[,...]".

Kinds, each at the start of 0-based step `step` on rank `rank`:
- `kill`: SIGKILL this worker (a lost process);
- `raise`: an exception in the step (a user bug);
- `hang`: stop making progress inside the step (a stuck collective / deadlocked loader);
- `stop`: SIGSTOP this worker (a frozen host: no heartbeat, no exit);
- `nan`: poison this rank's weights with NaN (a bad batch / numerical blow-up: divergence);
- `sigterm`: a termination notice to this worker (spot reclamation);
- `slow`: sleep `ms` milliseconds in every step from `step` on (a straggler: every step of the segment attempt it
  first fires in, and of no later attempt unless `always=1`, as a slow device the re-provisioned gang left), before the
  step (the rank arrives late: its peers wait for it in collectives); or, with `pct=P`, make this rank's compute
  P% slower from `step` on (it sleeps P% of its own forward/backward and optimizer time, inside the step: a
  slower device, which the trainer's busy time and the straggler alert see);
- `node`: SIGKILL this worker's torchrun agent and every worker it runs (a whole node lost: with the local
  backend's multi-node layout each agent is one "node");
- `storeout`: the object store is down in this worker: every object-store write raises (an outage during a
  checkpoint upload; list it for every rank to take the whole store down). The window opens at the first write
  after the fault fires and lasts `s` seconds, or until this worker reaches step `until` (a window measured in
  training progress: the same uploads meet it however fast or slow the machine is);
- `park`: hold this rank at the start of its step until the worker gets its stop signal (a termination notice, the
  SIGTERM a cancel sends the gang), then go on with the step as any rank that got the notice mid-step; its peers
  wait in the step's collectives meanwhile. `s` bounds the wait: no stop signal within `s` seconds raises
  InjectedFault (the test that parked it never sent its cancel: a loud failure, not a silent full-speed run). With
  `durable=1` at a checkpoint step, the rank parks once that checkpoint is committed: a cancel then lands mid-training
  however late it comes, without slowing the steps before (the parked rank makes no step progress, so a test that
  parks longer than the hang watchdog's window sets $TRAINFORGE_HEALTH's hang and collective timeouts above `s`).
A fault fires once per job (a marker file in the run folder remembers it, with the time it fired: the chaos suite
measures detection latency from it), so the retried segment runs clean, as a replaced node would; `always=1`
fires it on every attempt (a persistent fault that exhausts the retry budget).

`durable=1` fires the fault only once this rank's checkpoints in flight are durable: written, replicated on a
peer and committed (the rank blocks at the fault's step until its background save finished; the peers block in
the step's collective meanwhile, as they would behind a slow rank). Without it, a fault a fixed number of steps
after a save races that save's background work: on a loaded host the save may still be in flight, the rank dies
with the only copy of its shard, and recovery rightly falls back to the checkpoint before (a full interval more
lost). `durable=1` makes "lost work after a fault is under one checkpoint interval" a deterministic check.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_VAR = "TRAINFORGE_FAULT"
_LOG = logging.getLogger(__name__)
KINDS = ("kill", "raise", "hang", "stop", "nan", "sigterm", "slow", "node", "storeout", "park")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    always: bool = False
    ms: int = 0
    s: float = 0.0
    """`storeout`: the outage window's seconds; `park`: the longest wait for the stop signal."""
    until: int | None = None
    durable: bool = False
    """Wait for this rank's in-flight checkpoints to be committed before firing (see the module docstring)."""
    pct: float = 0.0
    """`slow` only: this rank's compute made `pct` percent slower (instead of `ms` before each step)."""

    @property
    def marker(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}"


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, *params = item.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r} in ${ENV_VAR}={text!r}; kinds: {', '.join(KINDS)}")
        values = dict(p.split("=", 1) for p in params)
        until = int(values["until"]) if "until" in values else None
        if kind == "storeout" and not (float(values.get("s", 0)) > 0 or until is not None):
            raise ValueError(f"storeout needs a window in ${ENV_VAR}={text!r}: s=SECONDS or until=STEP")
        if kind == "park" and not float(values.get("s", 0)) > 0:
            raise ValueError(f"park needs a bound in ${ENV_VAR}={text!r}: s=SECONDS")
        faults.append(Fault(kind, int(values.get("rank", 0)), int(values["step"]), values.get("always") == "1",
                            int(values.get("ms", 0)), float(values.get("s", 0)), until, values.get("durable") == "1",
                            float(values.get("pct", 0))))
    return faults


def fired_at(run_dir: str | Path) -> dict[str, float]:
    """marker -> time.time() the fault fired (for detection latency)."""
    folder = Path(run_dir) / "faults"
    out = {}
    for path in folder.glob("*") if folder.is_dir() else ():
        try:
            out[path.name] = float(path.read_text().split()[-1])
        except (ValueError, IndexError):
            continue
    return out


class FaultInjector:
    def __init__(self, faults: list[Fault], run_dir: str, rank: int):
        self.faults = [f for f in faults if f.rank == rank]
        self.marker_dir = Path(run_dir) / "faults"
        self._slow: dict[str, bool] = {}

    def slow_on(self, fault: Fault) -> bool:
        """A `slow` fault slows its rank in the segment attempt it first fired in, like a slow device that the
        retry leaves behind (the re-provisioned gang runs elsewhere); with `always=1` in every attempt. Its marker
        holds that attempt and the time it fired."""
        if fault.always:
            return True
        known = self._slow.get(fault.marker)
        if known is None:
            attempt = os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0")
            marker = self.marker_dir / fault.marker
            if marker.exists():
                known = marker.read_text().split()[0] == attempt
            else:
                self.marker_dir.mkdir(parents=True, exist_ok=True)
                marker.write_text(f"{attempt} {time.time()}")
                known = True
            self._slow[fault.marker] = known
        return known

    @classmethod
    def from_env(cls, run_dir: str, rank: int) -> FaultInjector:
        return cls(parse_faults(os.environ.get(ENV_VAR, "")), run_dir, rank)

    def maybe_fire(self, step: int, model: Any = None, settle: Callable[[], None] | None = None) -> None:
        """Fire this rank's faults of `step`; `settle` (the checkpointer's wait for its in-flight saves) runs
        first for a `durable` fault."""
        for fault in self.faults:
            if fault.kind == "slow":
                if step >= fault.step and not fault.pct and self.slow_on(fault):
                    time.sleep(fault.ms / 1000)
                continue
            if fault.kind == "storeout" and fault.until is not None and step == fault.until:
                end_store_outage()
            if fault.step != step:
                continue
            marker = self.marker_dir / fault.marker
            if not fault.always and marker.exists():
                continue
            if fault.durable and settle is not None:
                settle()
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(time.time()))
            self._fire(fault, step, model)

    @staticmethod
    def _fire(fault: Fault, step: int, model: Any) -> None:
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "raise":
            raise InjectedFault(f"injected failure at step {step}")
        elif fault.kind == "hang":
            time.sleep(3600)
        elif fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "node":
            kill_node()
        elif fault.kind == "storeout":
            store_outage(fault.s if fault.until is None else float("inf"))
        elif fault.kind == "park":
            park(fault.s)
        elif fault.kind == "nan" and model is not None:
            import torch

            with torch.no_grad():
                next(iter(model.parameters())).fill_(float("nan"))


class FaultHook:
    """The chaos harness's step hook (trainer/engine.py StepHook): fires this rank's faults at the start of their
    step. `nan` writes a parameter outside the optimizer step, so it first waits for the last save's host copy."""

    def __init__(self, injector: FaultInjector):
        self.injector = injector
        self.nan_steps = {f.step for f in injector.faults if f.kind == "nan"}
        self.slower = [f for f in injector.faults if f.kind == "slow" and f.pct > 0]
        self.slowed = False

    def before_step(self, step: int, engine: Any) -> None:
        if step in self.nan_steps:
            engine.wait_for_staging()
        due = [f for f in self.slower if step >= f.step] if not self.slowed else []
        if due and any(self.injector.slow_on(f) for f in due):
            self.slowed = True
            slow_compute(engine, max(f.pct for f in due))
        self.injector.maybe_fire(step, engine.model, settle=lambda: _settle(engine))


def slow_compute(engine: Any, pct: float) -> None:
    """Make the engine's forward/backward and optimizer step `pct` percent slower: each sleeps that share of its own
    duration after it ran (inside the timed step, so the rank's busy time grows as on a slower device)."""
    def slowed(inner: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                time.sleep((time.perf_counter() - t0) * pct / 100)

        return call

    engine.forward_backward = slowed(engine.forward_backward)
    engine.step = slowed(engine.step)


def _settle(engine: Any) -> None:
    """Block until the engine's background checkpoint saves are committed (a `durable` fault fires after). A save
    that failed does not stop the fault: its failure is the checkpointer's to report, the fault still fires."""
    ckpt = getattr(engine, "ckpt", None)
    if ckpt is None:
        return
    try:
        ckpt.wait()
    except Exception:
        _LOG.warning("a checkpoint in flight failed before a durable fault fired", exc_info=True)


def step_hooks_from_env(run_dir: str, rank: int) -> list[FaultHook]:
    """The hooks the chaos harness installs through $TRAINFORGE_FAULT: none when it is unset (production)."""
    injector = FaultInjector.from_env(run_dir, rank)
    return [FaultHook(injector)] if injector.faults else []


def park(bound_s: float, stopped: Callable[[], bool] | None = None, poll_s: float = 0.05) -> None:
    """Block until `stopped()` (default: this worker's HealthMonitor got its termination notice, the SIGTERM a
    cancel sends); InjectedFault after `bound_s` seconds without it. The signal handler runs in this (main) thread
    between the sleeps, and the heartbeat and checkpoint threads go on meanwhile."""
    done = stopped if stopped is not None else _stop_requested
    deadline = time.monotonic() + bound_s
    while not done():
        if time.monotonic() >= deadline:
            raise InjectedFault(f"parked for {bound_s:g}s and no stop signal came (the cancel it waits for was "
                                f"never sent)")
        time.sleep(poll_s)


def _stop_requested() -> bool:
    """This worker's termination notice came (trainer/health.py HealthMonitor's SIGTERM handler)."""
    from trainforge.trainer.health import current_monitor

    return bool(current_monitor().stop_requested)


def kill_node() -> None:
    """SIGKILL the torchrun agent that runs this worker, then every worker of that agent, this one last: nothing of
    the node reports anything (as when a host loses power)."""
    import psutil

    me = psutil.Process()
    agent = me.parent()
    peers = [p for p in agent.children(recursive=True) if p.pid != me.pid] if agent is not None else []
    for proc in ([agent] if agent is not None else []) + peers:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue
    os.kill(os.getpid(), signal.SIGKILL)


class StoreOutage(OSError):
    pass


_OUTAGE_UNTIL: float | None = 0.0
_OUTAGE_SECONDS = 0.0


def store_outage(seconds: float) -> None:
    """Arm an outage: from the first object-store write after the fault fires, every write in this process raises
    for `seconds` (local and S3 backends alike); reads work. Starting the window at the first write (not at the
    fault's step) makes the next checkpoint's upload meet the outage however slow the steps are."""
    global _OUTAGE_UNTIL, _OUTAGE_SECONDS
    from trainforge.infra.storage.local import LocalObjectStore
    from trainforge.infra.storage.s3 import S3ObjectStore

    _OUTAGE_SECONDS, _OUTAGE_UNTIL = seconds, None
    for cls in (LocalObjectStore, S3ObjectStore):
        for name in ("put_bytes", "put_file"):
            original = getattr(cls, name)
            if not getattr(original, "_outage", False):
                setattr(cls, name, _refusing(original))


def end_store_outage() -> None:
    """Close the outage window (a `storeout` fault with `until=STEP` reaching that step)."""
    global _OUTAGE_UNTIL, _OUTAGE_SECONDS
    _OUTAGE_SECONDS, _OUTAGE_UNTIL = 0.0, 0.0


def _refusing(original: Any) -> Any:
    def put(self: Any, key: str, *args: Any, **kwargs: Any) -> None:
        global _OUTAGE_UNTIL
        if _OUTAGE_UNTIL is None and _OUTAGE_SECONDS:
            _OUTAGE_UNTIL = time.time() + _OUTAGE_SECONDS  # the window opens at the first write
        if _OUTAGE_UNTIL is not None and time.time() < _OUTAGE_UNTIL:
            left = _OUTAGE_UNTIL - time.time()
            raise StoreOutage(f"injected object-store outage: PUT {key} refused"
                              + (f" ({left:.1f}s left)" if left != float("inf") else ""))
        original(self, key, *args, **kwargs)

    put._outage = True  # type: ignore[attr-defined]
    return put
