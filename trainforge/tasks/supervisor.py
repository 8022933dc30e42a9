"""The segment supervisor: the control plane's side of failure detection, and the recovery bookkeeping.

`run_segment` polls a `SegmentSupervisor` while the gang runs. It reads the per-rank heartbeats that
trainer/health.py writes and applies the policy:
- rank lost: the heartbeat's pid is gone (kill -9, OOM killer) or its heartbeat is older than
  `heartbeat_timeout_s` (SIGSTOP, frozen host, lost node). An unresponsive rank is SIGKILLed so torchrun's agent
  restarts the gang (tier 1) or the segment fails and is retried (tier 2).
- hang: no rank made step progress for the hang timeout: every rank's Python stack is dumped (faulthandler on
  SIGUSR1) into artifacts/stacks/, the rank that is not waiting in a collective is named with its line, and it
  is killed (same recovery).
- straggler: a rank's local time per step persistently above `straggler_ratio` x the median of ranks: reported
  with the evidence; with `straggler_action: evict` the segment ends at the next committed checkpoint.
- preemption: the scheduler marks the job `preempting` (or a worker got a termination notice): SIGTERM to the
  workers, which checkpoint at the next step boundary and end the segment cleanly.
Every detection and recovery is an event in events.jsonl (with timestamps) and in the job record, so detection
latency, MTTR (detection -> first step completed after the restore) and lost steps are computed from records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from trainforge.contract.channel import LEASE_TTL_S, ChannelReader, CommandWriter
from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import CheckpointCommitted, FaultDetected, Metrics, Recovered, Sender
from trainforge.events import EventWriter, append_records, read_typed_events
from trainforge.registry.jobs import JobRecord
from trainforge.trainer.health import HealthPolicy, heartbeat_path, read_heartbeats, stacks_dir

logger = logging.getLogger(__name__)

PREEMPTION_CHECK_S = 2.0
FATAL = ("rank_lost", "hang", "straggler_evicted")


@dataclass
class Incident:
    kind: str
    """rank_lost | hang | straggler | straggler_evicted | preemption | resize | gpu_unhealthy"""
    rank: int | None
    detected_at: float
    message: str
    action: str
    attempt: int
    step: int | None = None
    """The furthest step any rank had completed when it was detected (lost work is measured from it)."""
    scope: str = "process"
    """`process`, or `node` when every rank of a host went silent together (the node is reported unhealthy)."""
    host: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


class SegmentSupervisor:
    def __init__(self, record: JobRecord, attempt: int, policy: HealthPolicy, *,
                 scheduler_status: Callable[[], dict[str, Any] | None] | None = None,
                 rank_hosts: dict[int, str] | None = None, world: int | None = None,
                 sizes: list[int] | None = None, channel: ChannelReader | None = None,
                 commands: CommandWriter | None = None):
        self.record, self.attempt, self.policy = record, attempt, policy
        # The channel (contract/channel.py): the workers' events, heartbeats and failure reports come up through
        # it and the notices go down as commands, so the workers need not share this host's disk nor its pids.
        # Without one (a supervisor driven on files, as in unit tests) the heartbeat files and pids are used.
        self.channel, self.commands = channel, commands
        self._beats: dict[int, dict[str, Any]] = {}
        self._lost_nodes: set[str] = set()
        self._lease_renewed = 0.0
        self.world, self.sizes = world, sorted(sizes or [], reverse=True)  # elastic: the sizes it can run at
        self.resize_to: int | None = None
        self.rank_hosts = rank_hosts or {}  # the launch's node of each rank (several "nodes" on one host)
        self.run_dir = record.folder
        self.events = EventWriter(record.folder, True, Sender(job=record.job_id, attempt=attempt))
        self.scheduler_status = scheduler_status
        self.started = time.time()
        self.incidents: list[Incident] = []
        self._written = 0
        self._handled: set[tuple[str, int, int]] = set()  # (kind, rank, pid) already acted on
        self._progress: tuple[Any, ...] = ()
        self._progress_at = self.started
        self._restarts = 0
        self._fatal_gen: int | None = None  # the restart generation that already had a fatal incident
        self._slow_counts: dict[int, int] = {}
        self._slow_seen: dict[int, int] = {}
        self._last_preempt_check = 0.0
        self.preempting = False
        self.terminate_requested: str | None = None
        self._evict_after: float | None = None
        self._pending = record.data.get("pending_recovery")

    # ------------------------------------------------------------------ polling
    def poll(self) -> str | None:
        """One supervision pass. Returns a reason when the gang must be stopped now (e.g. straggler eviction)."""
        now = time.time()
        beats = self._read_beats()
        for rank, beat in beats.items():
            if rank in self.rank_hosts:
                beat["host"] = self.rank_hosts[rank]
        restarts = max((b.get("restart", 0) for b in beats.values()), default=0)
        if restarts > self._restarts:  # torchrun restarted the gang: a fresh start-up budget
            self._restarts, self._progress_at = restarts, now
        current = {r: b for r, b in beats.items() if b.get("restart", 0) == restarts}
        if self._fatal_gen != restarts:  # after a fatal incident the peers' deaths are its consequence
            self._check_liveness(current, now)
            self._check_progress(current, now)
        self._check_node_scope(current, now)
        self._check_stragglers(current, now)
        self._check_preemption(current, now)
        self._check_recovered(current, now)
        if self._evict_after is not None and self._checkpoint_since(self._evict_after):
            self.terminate_requested = "straggler evicted at the committed checkpoint"
        return self.terminate_requested

    # ------------------------------------------------------------------ the channel
    def _read_beats(self) -> dict[int, dict[str, Any]]:
        if self.channel is None:
            return read_heartbeats(self.run_dir, self.attempt)
        self._renew_lease()
        self._journal(self.channel.poll())
        beats: dict[int, dict[str, Any]] = {}
        for node, ranks in self.channel.heartbeats.items():
            for rank, info in ranks.items():
                if str(rank).isdigit() and "pid" in info:
                    beats[int(rank)] = {**info, "rank": int(rank), "node": node}
        self._beats = beats
        for node in self.channel.lost_nodes():
            if node not in self._lost_nodes:  # no batch for lost_after_s: the node (its publisher too) is gone
                self._lost_nodes.add(node)
                self.node_lost(node, f"no batch from its publisher for {self.channel.lost_after_s:g}s")
        return beats

    def _journal(self, batches: list[Any]) -> None:
        """What came up the channel, kept in the job's folder: events appended to the job's events.jsonl (the
        control plane is its only writer), failure reports into failures/ (read by tasks/segment.py)."""
        assert self.channel is not None
        events = []
        for _node, _seq, _i, rec in self.channel.records(batches):
            if rec.get("type") == "failure" and "rank" in rec:
                folder = self.record.folder / "failures"
                write_json(folder / f"segment-{self.attempt}-rank-{int(rec['rank']):05d}.json", rec)
            else:
                events.append(rec)
        append_records(self.record.events_path, events)

    def _renew_lease(self) -> None:
        if self.commands is None or time.monotonic() - self._lease_renewed < LEASE_TTL_S / 3:
            return
        try:
            self.commands.renew_lease(LEASE_TTL_S)
            self._lease_renewed = time.monotonic()
        except Exception as e:  # the store is busy: the lease has 2/3 of its time left, try on the next pass
            logger.warning("renewing the workers' lease failed: %s: %s", type(e).__name__, e)

    def drain(self, timeout_s: float = 15.0) -> None:
        """After the gang ended (and its publishers closed): read the channel to its end, so the journal holds
        every event the workers sent before the caller reads it."""
        if self.channel is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = self.channel.poll()
            self._journal(batches)
            states = [st.state for st in self.channel.status().values()]
            if not batches and all(st in ("closed", "lost") for st in states):
                break
            if not batches:
                time.sleep(0.1)

    def _signal(self, rank: int, beat: dict[str, Any], sig: int) -> None:
        """A signal to one rank: a channel command its node's sidecar delivers (no pid here), or the pid."""
        if self.commands is not None:
            kind = {signal.SIGKILL: "kill_rank", signal.SIGUSR1: "dump_stacks"}[sig]
            node = beat.get("node")
            self._send(kind, nodes=[node] if node else None, rank=rank)
        else:
            _kill(int(beat["pid"]), sig)

    def _notice(self, beats: dict[int, dict[str, Any]], kind: str, **args: Any) -> None:
        """A termination notice to every rank (preemption, resize): SIGTERM on the ranks' side."""
        if self.commands is not None:
            self._send(kind, **args)
        else:
            for beat in beats.values():
                _kill(int(beat["pid"]), signal.SIGTERM)

    def _send(self, kind: str, *, nodes: list[str] | None = None, **args: Any) -> None:
        assert self.commands is not None
        try:
            self.commands.send(kind, nodes=nodes, **args)
        except Exception as e:
            logger.warning("sending %s to the workers failed: %s: %s", kind, type(e).__name__, e)

    def _alive(self, beat: dict[str, Any]) -> bool:
        """The node's own view through the channel (its sidecar watches its ranks' processes), else the pid."""
        if self.channel is not None:
            return beat.get("alive", True) is not False
        return _alive(int(beat["pid"]))

    def _check_liveness(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        for rank, beat in beats.items():
            if beat.get("phase") in ("done", "failed"):
                continue
            pid = int(beat["pid"])
            alive = self._alive(beat)
            age = now - float(beat["time"])
            if not alive:
                why = "its process died without a report (killed by a signal, the OOM killer or a lost node)"
            elif age > self.policy.heartbeat_timeout_s and not (_warming_up(beat) or beat.get("phase") == "closing"):
                # closing (the final commit, the process group's shutdown) stalls the beat thread too (3.5 s
                # after the segment's end under load 85): like start-up, the start-up budget judges it
                why = f"no heartbeat for {age:.1f}s (> {self.policy.heartbeat_timeout_s:g}s): frozen or unreachable"
            else:
                continue
            if self._once("rank_lost", rank, pid):
                inc = self._record("rank_lost", rank, f"rank {rank} lost: {why}", beats,
                                   action="restart (torchrun in segment, else segment retry)" if alive is False
                                   else "SIGKILL, then restart",
                                   host=beat.get("host"), evidence={"pid": pid, "heartbeat_age_s": round(age, 2)})
                if alive:
                    self._signal(rank, beat, signal.SIGKILL)
                inc.evidence["pid_alive"] = alive

    def node_lost(self, host: str, why: str = "its agent and workers died without a report") -> None:
        """The launcher saw the host's agent die of a signal: every incident of that host is a node loss (a pass of
        the supervisor may have seen only some of its ranks gone before the segment ended)."""
        found = False
        for inc in self.incidents:
            if inc.kind == "rank_lost" and inc.host == host:
                inc.scope, found = "node", True
        if not found:
            ranks = sorted(r for r, h in self.rank_hosts.items() if h == host)
            beats = self._beats if self.channel is not None else read_heartbeats(self.run_dir, self.attempt)
            inc = self._record("rank_lost", ranks[0] if ranks else None,
                               f"node {host} lost: {why}", beats,
                               action="segment retry on a replacement node", host=host,
                               evidence={"ranks": ranks})
            inc.scope = "node"

    def _check_node_scope(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        """A host with a lost rank whose every rank is now gone was lost whole: its incidents get scope `node`
        (the ranks of a dying node are not all gone in the same pass, so this is checked again every pass)."""
        hosts = {i.host for i in self.incidents if i.kind == "rank_lost" and i.scope == "process" and i.host}
        for host in hosts:
            on_host = [b for b in beats.values() if b.get("host") == host]
            if len(on_host) > 1 and all(
                    b.get("phase") not in ("done", "failed")
                    and (not self._alive(b) or now - float(b["time"]) > self.policy.heartbeat_timeout_s)
                    for b in on_host):
                for inc in self.incidents:
                    if inc.kind == "rank_lost" and inc.host == host:
                        inc.scope = "node"

    def _check_progress(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        # The first step of a (re)start is start-up too (the data loader's first batch, lazy imports, the first
        # collectives' connections: 10.8 s on the loaded 2-core host against ~1.5 s after): until every rank
        # finished one, the start-up budget applies, not the hang window.
        warm = not any(_warming_up(b) for b in beats.values())
        training = {r: b for r, b in beats.items() if b.get("phase") == "training"} if warm else {}
        signature = tuple(sorted((r, b.get("restart"), b.get("step"), b.get("steps_done")) for r, b in beats.items()))
        if signature != self._progress:
            self._progress, self._progress_at = signature, now
            return
        if not training:  # starting up or committing the last checkpoint: the longer budget applies
            if beats and all(_warming_up(b) or b.get("phase") == "closing" for b in beats.values()) \
                    and now - self._progress_at > self.policy.startup_timeout_s:
                self._on_hang(beats, now, now - self._progress_at, startup=True)
            return
        steps = [b["step_s"] for b in training.values() if b.get("step_s")]
        timeout = self.policy.hang_timeout(statistics.median(steps) if steps else None)
        if now - self._progress_at > timeout:
            self._on_hang(beats, now, now - self._progress_at)

    def _on_hang(self, beats: dict[int, dict[str, Any]], now: float, stalled_s: float, startup: bool = False) -> None:
        key = ("hang", -1, hash(self._progress))
        if key in self._handled:
            return
        self._handled.add(key)
        folder = stacks_dir(self.run_dir, self.attempt)
        stacks = dump_stacks(beats, folder, signal_rank=self._signal)
        rank, where = name_culprit(stacks, beats)
        what = "start-up / final commit" if startup else "step progress"
        message = (f"hang: no {what} on any rank for {stalled_s:.1f}s; rank {rank} is stuck at {where} "
                   f"(the others wait in collectives); stacks of every rank: {folder}")
        self._record("hang", rank, message, beats, action="dump stacks, SIGKILL the stuck rank, restart",
                     host=beats.get(rank, {}).get("host"),
                     evidence={"stalled_s": round(stalled_s, 2), "where": where, "stacks": str(folder),
                               "frames": {r: s[:6] for r, s in stacks.items()}})
        (folder / "hang-report.txt").write_text(message + "\n" + "\n".join(
            f"rank {r}: " + " <- ".join(s[:6]) for r, s in sorted(stacks.items())) + "\n")
        if rank in beats:
            self._signal(rank, beats[rank], signal.SIGKILL)

    def _check_stragglers(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        local = {r: b["local_s"] for r, b in beats.items() if b.get("phase") == "training" and b.get("local_s")}
        if len(local) < 2:
            return
        for rank, value in local.items():
            med = statistics.median(v for r, v in local.items() if r != rank)  # the others: 2 ranks work too
            done = beats[rank].get("steps_done", 0)
            if self._slow_seen.get(rank) == done:
                continue
            self._slow_seen[rank] = done
            slow = value > self.policy.straggler_ratio * med and value - med > self.policy.straggler_min_excess_s
            self._slow_counts[rank] = self._slow_counts.get(rank, 0) + 1 if slow else 0
            if self._slow_counts[rank] >= self.policy.straggler_patience and self._once("straggler", rank, 0):
                evict = self.policy.straggler_action == "evict"
                self._record("straggler", rank, f"straggler: rank {rank} spends {value:.3f}s of local work per step, "
                             f"{value / max(med, 1e-9):.1f}x the median of the other ranks ({med:.3f}s), for "
                             f"{self._slow_counts[rank]} steps", beats,
                             action="evict at the next committed checkpoint" if evict else "report",
                             host=beats[rank].get("host"),
                             evidence={"local_s": {str(r): round(v, 4) for r, v in local.items()}})
                if evict:
                    self._evict_after = now

    def _check_preemption(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        noticed = [r for r, b in beats.items() if b.get("phase_note") == "termination notice received"]
        if noticed and self.resize_to is None and self._once("preemption", noticed[0], 0):  # not our resize notice
            self.preempting = True
            self._record("preemption", noticed[0], f"termination notice on rank {noticed[0]}: emergency checkpoint "
                         "at the next step boundary, then the segment ends", beats, action="emergency checkpoint")
        if self.scheduler_status is None or self.preempting or now - self._last_preempt_check < PREEMPTION_CHECK_S:
            return
        self._last_preempt_check = now
        try:
            status = self.scheduler_status()
        except Exception:  # the scheduler's database is busy or gone: try again next time
            return
        if status and status.get("state") == "preempting":
            self.preempting = True
            self._record("preemption", None, f"the scheduler preempts this job (deadline "
                         f"{status.get('preempt_deadline')}): termination notice to every worker", beats,
                         action="emergency checkpoint")
            deadline = status.get("preempt_deadline")
            self._notice(beats, "preemption_notice", deadline_s=deadline)
        elif status and status.get("state") == "running":
            self._check_resize(int(status.get("gpus") or 0), beats)

    def _check_resize(self, gpus: int, beats: dict[int, dict[str, Any]]) -> None:
        """Elastic jobs: the scheduler shrank the allocation (to make room for another job) or grew it into idle
        capacity. Shrinking must happen now (the GPUs are promised away); growing is worth a restart only when
        a larger valid size fits. Either way: emergency checkpoint at the next step boundary (the termination
        notice), the segment ends `resize`, and the flow re-provisions at the new size (0 lost steps)."""
        if not self.sizes or self.world is None or not gpus or gpus == self.world:
            return
        fitting = [s for s in self.sizes if s <= gpus]
        target = fitting[0] if fitting else None
        if target is None or target == self.world:
            return
        if not beats or any(b.get("phase") != "training" for b in beats.values()):
            return  # the notice handler is installed once training runs: ask again on the next pass
        if self._pending is not None:
            return  # a recovery in progress is measured first (its MTTR ends at the first step after the restore)
        self.preempting, self.resize_to = True, target
        grow = target > self.world
        self._record("resize", None, f"the scheduler {'grew' if grow else 'shrank'} the allocation to {gpus} GPUs: "
                     f"resizing from {self.world} to {target} workers at the next step boundary", beats,
                     action="emergency checkpoint, re-provision at the new size",
                     evidence={"gpus": gpus, "from": self.world, "to": target})
        # the sizes are in workers; the node count is the scheduler's to choose at re-provisioning
        self._notice(beats, "resize_notice", num_nodes=None, workers=target)

    def _check_recovered(self, beats: dict[int, dict[str, Any]], now: float) -> None:
        """MTTR ends at the first step completed after a restore that followed the detection."""
        pending = self._pending
        if pending is None:
            return
        # A short retried segment may finish between two passes: ranks already closing or done count too.
        fresh = [b for b in beats.values() if b.get("phase") in ("training", "closing", "done")
                 and b.get("steps_done", 0) >= 1 and b.get("started", 0) > pending["detected_at"]]
        if len(fresh) < max(1, len(beats)) or not beats:
            return
        resumed = min(int(b.get("resumed_from") or 0) for b in fresh)
        mttr = now - pending["detected_at"]
        reached = self._reached_before(pending["detected_at"])
        lost = max(0, reached - resumed) if reached is not None else None
        self.events.publish(Recovered(fault=pending["kind"], rank=pending.get("rank"), mttr_s=round(mttr, 3),
                                      resumed_from=resumed, lost_steps=lost, attempt=self.attempt,
                                      tier="in-segment restart" if pending["attempt"] == self.attempt else
                                      "resume after preemption" if pending["kind"] == "preemption" else
                                      "resume after resize" if pending["kind"] == "resize" else "segment retry"))
        self._pending = None
        self.record.update(pending_recovery=None)

    # ------------------------------------------------------------------ bookkeeping
    def _once(self, kind: str, rank: int, pid: int) -> bool:
        key = (kind, rank, pid)
        if key in self._handled:
            return False
        self._handled.add(key)
        return True

    def _record(self, kind: str, rank: int | None, message: str, beats: dict[int, dict[str, Any]], *, action: str,
                host: str | None = None, evidence: dict[str, Any] | None = None) -> Incident:
        step = max((int(b.get("step") or 0) for b in beats.values()), default=None)
        inc = Incident(kind, rank, time.time(), message, action, self.attempt, step, host=host,
                       evidence=evidence or {})
        self.incidents.append(inc)
        logger.warning("%s", message)
        self.events.publish(FaultDetected(fault=kind, rank=rank, message=message, action=action, step=step,
                                          attempt=self.attempt, detected_at=inc.detected_at))
        if kind in FATAL:
            self._fatal_gen = self._restarts
        if kind in FATAL or kind in ("preemption", "resize"):
            self._pending = {"kind": kind, "rank": rank, "detected_at": inc.detected_at, "step": step,
                             "attempt": self.attempt}
            self.record.update(pending_recovery=self._pending)
        return inc

    def note(self, kind: str, rank: int | None, message: str, *, action: str, detected_at: float,
             step: int | None, fatal: bool) -> None:
        """A fault the workers reported themselves (divergence): recorded like the supervisor's own findings."""
        inc = Incident(kind, rank, detected_at, message, action, self.attempt, step)
        self.incidents.append(inc)
        self.events.publish(FaultDetected(fault=kind, rank=rank, message=message, action=action, step=step,
                                          attempt=self.attempt, detected_at=detected_at))
        if fatal:
            self._pending = {"kind": kind, "rank": rank, "detected_at": detected_at, "step": step,
                             "attempt": self.attempt}
            self.record.update(pending_recovery=self._pending)
        self.finish()

    def _reached_before(self, t: float) -> int | None:
        """The furthest step completed (metrics reported) before time t."""
        events, _, _ = read_typed_events(self.record.events_path, only=(Metrics,))
        return max((e.step for e in events if isinstance(e, Metrics) and e.time <= t), default=None)

    def _checkpoint_since(self, t: float) -> bool:
        events, _, _ = read_typed_events(self.record.events_path, only=(CheckpointCommitted,))
        return any(isinstance(e, CheckpointCommitted) and e.time > t for e in events)

    def root_cause(self) -> Incident | None:
        fatal = [i for i in self.incidents if i.kind in FATAL]
        return fatal[0] if fatal else None

    def finish(self) -> None:
        """Keep this segment's incidents in the job record (the give-up report lists them)."""
        if self.channel is not None:
            # The last beat of each rank, kept in the job's folder for the post-mortem readers (read_heartbeats).
            for rank, beat in self._beats.items():
                with contextlib.suppress(OSError):
                    write_json(heartbeat_path(self.run_dir, self.attempt, rank), beat)
        new = self.incidents[self._written:]
        if not new:
            return
        self.record.reload()
        history = self.record.data.get("incidents", [])
        history.extend(asdict(i) for i in new)
        self.record.update(incidents=history)
        self._written = len(self.incidents)


def _warming_up(beat: dict[str, Any]) -> bool:
    """Starting, or in the first step of its (re)start. Both hold the GIL in long C calls (`import torch` runs
    libtorch's initialisation, the first step lazy imports and the first collectives' set-up), which stop the
    beat thread: gaps of 2.3-4.3 s at load 35, and 3-4 s false `rank_lost`s of healthy gangs under heavier load,
    all at step 0 or the first step after a restore. The first step also carries the data loader's start-up
    (10.8 s against ~1.5 s after on the loaded host). A warming-up rank's liveness is its node's process watch;
    a stuck warm-up is the start-up budget's (`startup_timeout_s`), not the heartbeat or hang window's."""
    return beat.get("phase") == "starting" or (beat.get("phase") == "training" and not beat.get("steps_done"))


# ---------------------------------------------------------------------- stacks


def dump_stacks(beats: dict[int, dict[str, Any]], folder: Path, wait_s: float = 3.0,
                signal_rank: Callable[[int, dict[str, Any], int], None] | None = None) -> dict[int, list[str]]:
    """SIGUSR1 to every rank (faulthandler writes all its threads' Python stacks into its file under `folder`),
    then the main thread's frames per rank, innermost first, as 'path:line in func'. `signal_rank`: how the
    signal reaches a rank (the supervisor's channel command), by default its pid."""
    sizes = {}
    for rank, beat in beats.items():
        path = folder / f"rank-{rank:05d}-restart-{beat.get('restart', 0)}.txt"
        sizes[rank] = (path, path.stat().st_size if path.is_file() else 0)
    for rank, beat in beats.items():
        if signal_rank is not None:
            signal_rank(rank, beat, signal.SIGUSR1)
        else:
            _kill(int(beat["pid"]), signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(p.is_file() and p.stat().st_size > s for p, s in sizes.values()):
            break
        time.sleep(0.05)
    time.sleep(0.2)  # let the dump finish writing
    out = {}
    for rank, (path, size) in sizes.items():
        text = path.read_text(errors="replace")[size:] if path.is_file() else ""
        out[rank] = main_thread_frames(text)
    return out


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def main_thread_frames(dump: str) -> list[str]:
    """faulthandler prints each thread's frames innermost first; the main thread is the one whose outermost frame
    is a module's top level (the worker's entry point)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([])
        elif (m := _FRAME.match(line)) and blocks:
            blocks[-1].append(f"{m['file']}:{m['line']} in {m['func']}")
    for frames in blocks:
        if frames and frames[-1].endswith(("in <module>", "in _run_module_as_main", "in _run_code")):
            return frames
    return blocks[0] if blocks else []


def _in_collective(frames: list[str]) -> bool:
    return bool(frames) and ("/torch/" in frames[0] or "/threading.py" in frames[0])


def name_culprit(stacks: dict[int, list[str]], beats: dict[int, dict[str, Any]]) -> tuple[int | None, str]:
    """The rank that is not waiting inside torch (a collective, autograd's sync) is the one that hangs; when every
    rank waits in torch (a collective deadlock), the rank furthest behind."""
    if not beats:
        return None, "(no heartbeats)"
    stuck = [r for r, s in stacks.items() if s and not _in_collective(s)]
    if stuck:
        rank = min(stuck, key=lambda r: (beats[r].get("steps_done", 0), r))
    else:
        rank = min(beats, key=lambda r: (beats[r].get("steps_done", 0), r))
    frames = stacks.get(rank) or []
    own = [f for f in frames if "/torch/" not in f and "/python3" not in f]
    where = own[0] if own else (frames[0] if frames else "(stack not available: the process did not respond)")
    return rank, where


# ---------------------------------------------------------------------- processes


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# ---------------------------------------------------------------------- divergence and the give-up report


def offending_samples(config: SegmentConfig, step: int, skip: list[int]) -> list[int]:
    """The global batch of 0-based step `step`, in the order the workers used (same construction as the
    trainer's DataFeed, with the skip list that was in force)."""
    from trainforge.datasets.sampler import SampleOrder

    ds = config.dataset
    order = SampleOrder(ds.num_samples, ds.eval_fraction, ds.version or "", config.training.seed,
                        skip=frozenset(skip))
    batch = config.training.global_batch_size
    return order.global_indices(step * batch, batch)


def give_up_report(record: JobRecord, error: BaseException | str) -> str:
    """What failed, when, what was tried, and the work lost: written when the retry budget is spent."""
    record.reload()
    data = record.data
    lines = [f"job {record.job_id} failed after {len(data.get('segments', []))} segment attempt(s): {error}".strip(),
             "", "attempts:"]
    for seg in data.get("segments", []):
        took = seg.get("ended_at", time.time()) - seg["started_at"]
        lines.append(f"  segment {seg['attempt']}: {seg['state']} after {took:.1f}s"
                     + (f" - {seg['error'].splitlines()[0]}" if seg.get("error") else ""))
    incidents = data.get("incidents", [])
    if incidents:
        lines.append("detected:")
        for inc in incidents:
            when = time.strftime("%H:%M:%S", time.localtime(inc["detected_at"]))
            lines.append(f"  {when} segment {inc['attempt']}: {inc['kind']} (rank {inc['rank']}) -> {inc['action']}")
    rollbacks = data.get("divergence", [])
    for rb in rollbacks:
        lines.append(f"  divergence at step {rb['step'] + 1}: {rb['reason']} -> skipped {len(rb['samples'])} samples")
    committed = sorted(int(s) for s in data.get("checkpoints", {}))
    events, _, _ = read_typed_events(record.events_path, only=(Metrics,))
    reached = max((e.step for e in events if isinstance(e, Metrics)), default=0)
    last = committed[-1] if committed else 0
    lines.append(f"last committed checkpoint: step {last if committed else 'none'}; furthest step reached: "
                 f"{reached}; work lost if resumed: {max(0, reached - last)} steps")
    lines.append(f"resume with: trainforge submit JOB.yaml --resume {record.job_id}")
    text = "\n".join(lines)
    (record.folder / "failure-report.txt").write_text(text + "\n")
    record.update(failure_report=text)
    return text


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
