"""Provisioning the gang: all of a job's worker slots at once, or none; and elastic data-parallel resizing.

The live scheduler (trainforge.infra.scheduler.live) admits the gang against the cluster inventory shared by every
flow run on this host (SQLite in $TRAINFORGE_HOME); the local backend's inventory is this machine's worker slots.

Elastic jobs (`resources.max_gpus` > `min_gpus`) ask for up to max_gpus and accept any size down to min_gpus that
gives a valid data-parallel degree (`elastic_sizes`, pure, in trainforge/plan/elastic.py with `layout_for`). The
layout of a size keeps tp / pp and the global batch: dp = world / (tp * pp), and gradient accumulation (local
batch / micro-batch) absorbs the change, so the learning-rate schedule and the sample order (a function of the step
and the global batch only) are unchanged. The checkpoint reshards on load (DCP). Every change of size is a `resize`
event and an entry of the job record's `resizes`; the record's `allocation` is the gang the next segment runs on.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainforge.contract.events import CheckpointCommitted, Resize, Sender
from trainforge.events import EventWriter, read_typed_events
from trainforge.home import current_user
from trainforge.plan.cluster import default_cluster
from trainforge.plan.elastic import accumulation, elastic_sizes, layout_for
from trainforge.registry.jobs import JobRecord
from trainforge.spec import JobSpec

PROVISION_TIMEOUT_S = float(os.environ.get("TRAINFORGE_PROVISION_TIMEOUT_S", "600"))
QUEUE_WATCH_S = 2.0
"""How often a waiting gang looks at its place in the queue (a gang admitted sooner says nothing)."""


def live_scheduler():  # -> LiveScheduler
    """The scheduler of the configured cluster, with its teams' weights and quotas; state in
    $TRAINFORGE_SCHEDULER_URL (PostgreSQL in production) or SQLite in $TRAINFORGE_HOME."""
    from trainforge.infra.scheduler.live import LiveScheduler
    from trainforge.infra.scheduler.state import teams_from_spec

    cluster = default_cluster()
    teams = teams_from_spec(cluster)
    return LiveScheduler(cluster, os.environ.get("TRAINFORGE_SCHEDULER_URL") or None, teams=teams or None)


# ------------------------------------------------------------------------------------------- the gang


class RecoveryTimeout(TimeoutError):
    """A re-provisioning after a fault found no gang within `fault_tolerance.recovery_wait_s`: the message names the
    fault (the cut, the hosts lost) and the scheduler's reason. The job gives up (contract/controller.py)."""


def provision_gang(job_id: str, spec: JobSpec, layout: dict[str, Any],
                   on_wait: Callable[[QueueWait], None] | None = None,
                   timeout_s: float | None = None) -> dict[str, Any]:
    """Admit the whole gang with the plan's layout (TP groups within a node, pipelines within a rack). An elastic
    job asks for its largest size and accepts down to its smallest; the allocation says the size it got
    (`workers`), the layout for it and the scheduler's nodes in rank order. While the gang waits in the queue,
    `on_wait` hears its place and the scheduler's reason each time they change (`watching_queue`). It waits at most
    `timeout_s` (default PROVISION_TIMEOUT_S): SchedulingTimeout."""
    from trainforge.infra.scheduler.live import GangRequest

    sizes = elastic_sizes(spec, layout)
    top, floor = sizes[0], sizes[-1]
    request = GangRequest(
        job_id=job_id, team=spec.team, priority=spec.priority.value, gpu_type=spec.resources.gpu_type.value,
        num_gpus=top, min_gpus=floor if floor < top else None,
        gpus_per_node=min(spec.resources.gpus_per_node, top),
        tp=layout["tp"], pp=layout["pp"], dp=None if floor < top else top // (layout["tp"] * layout["pp"]),
        max_runtime_s=spec.max_runtime_s, user=current_user(),
    )
    scheduler = live_scheduler()
    with watching_queue(scheduler, job_id, on_wait):
        allocation = scheduler.request(request, timeout_s=PROVISION_TIMEOUT_S if timeout_s is None else timeout_s)
    return allocation_dict(spec, layout, sizes, job_id, allocation.num_gpus,
                           [name for name, _ in allocation.nodes], repr(allocation),
                           devices={name: list(gpus) for name, gpus in allocation.nodes})


@dataclass(frozen=True, slots=True)
class QueueWait:
    """Where a pending gang waits: its position among the pending gangs of its GPU type and why it waits."""

    position: int
    pending: int
    gpu_type: str
    reason: str

    def describe(self) -> str:
        return (f"position {self.position} of {self.pending} pending for {self.gpu_type}: "
                f"{self.reason or 'waiting for the scheduler'}")


def queue_wait(rows: Sequence[Mapping[str, Any]], job_id: str) -> QueueWait | None:
    """Pure: the job's place in the scheduler's queue rows (`LiveScheduler.queue()`), None unless it is pending.
    The position is the scheduler's own (the order its next pass considers the pending gangs of that GPU type:
    critical within quota, reserved gangs, then teams by fair share, each team's in its priority order)."""
    me = next((r for r in rows if r["job_id"] == job_id), None)
    if me is None or me["state"] != "pending":
        return None
    same = [r for r in rows if r["state"] == "pending" and r["gpu_type"] == me["gpu_type"]]
    position = me.get("position") or len(same)
    return QueueWait(int(position), len(same), str(me["gpu_type"]), str(me.get("reason") or ""))


@contextlib.contextmanager
def watching_queue(scheduler: Any, job_id: str, on_wait: Callable[[QueueWait], None] | None,
                   every_s: float = QUEUE_WATCH_S) -> Iterator[None]:
    """While the body blocks in `scheduler.request`, a thread reads the queue (read-only) every `every_s` and calls
    `on_wait` when the gang's place or reason changes. It runs in a copy of the caller's context (Prefect's
    settings and run context live in context variables), and stops with the body."""
    if on_wait is None:
        yield
        return
    stop = threading.Event()

    def watch() -> None:
        last = None
        while not stop.wait(every_s):
            try:
                wait = queue_wait(scheduler.queue(), job_id)
            except Exception:  # noqa: BLE001 - a busy database: look again next time; the request decides
                continue
            if wait is not None and wait != last:
                last = wait
                try:
                    on_wait(wait)
                except Exception:  # noqa: BLE001 - telling must never break the provisioning
                    continue

    thread = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True,
                              name=f"queue-watch-{job_id}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=every_s + 5)


def allocation_dict(spec: JobSpec, layout: dict[str, Any], sizes: list[int], job_id: str, gpus: int,
                    nodes: list[str], placement: str = "", devices: dict[str, list[int]] | None = None
                    ) -> dict[str, Any]:
    """What a segment runs on: the largest valid size within the GPUs granted (the scheduler may grant an elastic
    job a size whose dp does not divide the batch: the extra GPUs stay idle until the next resize). `devices`:
    node -> the GPU indices the scheduler gave the job there (its workers see only those)."""
    fitting = [s for s in sizes if s <= gpus]
    if not fitting:
        raise RuntimeError(f"job {job_id}: the scheduler granted {gpus} GPUs, fewer than the smallest size the job "
                           f"runs at ({sizes[-1]})")
    world = fitting[0]
    per_node = min(spec.resources.gpus_per_node, world)
    used_nodes = nodes[: math.ceil(world / per_node)] if nodes else []
    return {"job_id": job_id, "workers": world, "gpus": gpus, "nodes": used_nodes, "sizes": sizes,
            "gpu_type": spec.resources.gpu_type.value,
            "devices": {n: devices.get(n, []) for n in used_nodes} if devices else {},
            "layout": layout_for(layout, world, spec.training.global_batch_size), "placement": placement}


def record_allocation(record: JobRecord, allocation: dict[str, Any], reason: str, spec: JobSpec) -> dict | None:
    """Keep the gang the next segment runs on in the job record; a change of size is a resize: an event
    (`resize`: from -> to workers, dp, accumulation, the step it resumes from) and an entry of `resizes`."""
    record.reload()
    before = record.data.get("allocation")
    record.update(allocation=allocation)
    if before is None or before.get("workers") == allocation["workers"]:
        return None
    batch = spec.training.global_batch_size
    # The newest checkpoint the workers committed: the step the resized gang resumes from.
    committed = [e.step for e in read_typed_events(record.events_path, only=(CheckpointCommitted,))[0]
                 if isinstance(e, CheckpointCommitted)]
    entry = {
        "time": time.time(), "reason": reason, "from_workers": before["workers"], "to_workers": allocation["workers"],
        "from_dp": before["layout"]["dp"], "to_dp": allocation["layout"]["dp"],
        "accumulation": [accumulation(before["layout"], batch), accumulation(allocation["layout"], batch)],
        "micro_batch_size": allocation["layout"]["micro_batch_size"], "global_batch_size": batch,
        "nodes": allocation.get("nodes", []), "after_step": max(committed, default=None),
    }
    record.update(resizes=[*record.data.get("resizes", []), entry])
    EventWriter(record.folder, True, Sender(job=record.job_id)).publish(
        Resize(**{k: v for k, v in entry.items() if k != "time"}))
    return entry


def release_gang(job_id: str, outcome: str = "ended") -> None:
    """Give the gang back: `completed` (the scheduler learns the job's runtime), `stopped` (preempted: it waits
    again in its place) or `ended` (failed, cancelled)."""
    live_scheduler().release(job_id, outcome)


def report_checkpoint(job_id: str) -> str | None:
    """Tell the live scheduler that the job committed a checkpoint, so that preemption victims are picked by the
    work a preemption would lose (since the last commit), not by time since start. A commit never fails for it:
    returns why the report did not reach the scheduler (said in the flow log), None when it did. A job the
    scheduler does not know (released, or admitted elsewhere) is a no-op there."""
    try:
        live_scheduler().checkpointed(job_id)
    except Exception as exc:  # the database unreachable or busy: victims fall back to time since the last report
        return f"{type(exc).__name__}: {exc}"
    return None
