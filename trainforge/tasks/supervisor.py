"""The segment supervisor: the control plane's side of failure detection, and the recovery bookkeeping.

`run_segment` polls a `SegmentSupervisor` while the gang runs. Everything it knows about the workers comes up the
segment attempt's channel (trainforge/contract/channel.py): their events, failure reports, and one heartbeat per
rank in every batch of its node's publisher (each parsed as the typed `Heartbeat`); everything it asks of them
goes down as channel commands that the node's sidecar carries out. It needs no worker's process id and no
shared disk. It applies the policy:
- rank lost: the node's sidecar saw the rank's process gone (kill -9, OOM killer), or the rank's heartbeat is
  older than `heartbeat_timeout_s` (SIGSTOP, frozen host; the age is measured on the publisher's and this
  reader's clocks, never compared with the worker's wall clock), or no batch came from its node for the
  channel's `lost_after_s` (a lost node). An unresponsive rank is killed (`kill_rank`) so torchrun's agent
  restarts the gang (tier 1) or the segment fails and is retried (tier 2).
- hang: no rank made step progress for the hang timeout: every rank's Python stack is dumped (`dump_stacks`:
  faulthandler on SIGUSR1) into artifacts/stacks/, the rank that is not waiting in a collective is named with
  its line, and it is killed (same recovery).
- straggler: a rank's local time per step persistently above `straggler_ratio` x the median of ranks: reported
  with the evidence; with `straggler_action: evict` the segment ends at the next committed checkpoint.
- network cut: the gang's node agents probe each other (infra/backends/reach_probe.py) and some pairs of hosts
  cannot reach each other while the channel still hears every host (both sides reach the store and this control
  plane): the cut is named (plan/reach.py `find_cut`), the gang stopped, and the hosts outside the largest group
  that all reach each other are recorded lost (scope `node`), so the retry is placed without them.
- preemption: the scheduler marks the job `preempting` (or a worker got a termination notice): the
  `preemption_notice` command, which the workers turn into a checkpoint at the next step boundary and a clean end.
Every detection and recovery is an event in events.jsonl (with timestamps) and in the job record, so detection
latency, MTTR (detection -> first step completed after the restore) and lost steps are computed from records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainforge.contract.channel import LEASE_TTL_S, Batch, ChannelReader, CommandWriter
from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import (
    FATAL_INCIDENTS,
    CheckpointCommitted,
    EventError,
    FailureReport,
    FaultDetected,
    Heartbeat,
    Metrics,
    Profile,
    Recovered,
    Sender,
    StackDump,
    dump_event,
    parse_event,
)
from trainforge.events import EventWriter, append_records, read_typed_events
from trainforge.infra.storage import ObjectStore
from trainforge.plan.reach import Cut
from trainforge.registry.jobs import JobRecord
from trainforge.registry.manifest import committed_steps, read_manifest, step_prefix
from trainforge.trainer.health import HealthPolicy, heartbeat_path, stacks_dir, stacks_file_name
from trainforge.trainer.profiling import summary_key

logger = logging.getLogger(__name__)

PREEMPTION_CHECK_S = 2.0
STACKS_WAIT_S = 6.0
"""How long a hang's stack dump waits for every rank's answer: the sidecar's own wait for a dump (3 s), a flush of
its publisher and a read of the channel."""
FATAL = FATAL_INCIDENTS
NODE_SIDE = ("age_s", "alive", "dead_at")
"""What a node's side adds to a rank's beat in the batch envelope (the publisher: the beat's age; the sidecar: its
check of the rank's process), not part of the rank's own `Heartbeat`."""


@dataclass(frozen=True)
class RankBeat:
    """One rank's last heartbeat as the channel delivered it: the rank's own typed `Heartbeat` and what its node
    added. `age_s` is the beat's age now: its age when its batch was taken (the publisher's clock) plus the time
    since that batch arrived (this reader's clock), so no clock of another host enters."""

    beat: Heartbeat
    node: str
    """The channel node (publisher) that carried it."""
    host: str | None
    """The launch's node of the rank (several "nodes" on one host), else the host the rank reports."""
    age_s: float
    alive: bool = True
    """False once the node's sidecar saw the rank's process gone without a last `done` / `failed` beat."""


def rank_beats(channel: ChannelReader, rank_hosts: Mapping[int, str] | None = None) -> dict[int, RankBeat]:
    """Every rank's latest beat from the channel's latest batch of each node, typed. A beat that does not parse
    as a `Heartbeat` is skipped with a warning that names its node, rank and field."""
    status = channel.status()
    out: dict[int, RankBeat] = {}
    for node, ranks in channel.heartbeats.items():
        since = status[node].age_s if node in status else 0.0
        for key, info in ranks.items():
            if not str(key).isdigit():  # not a rank's beat (a publisher's own, in tools and benches)
                continue
            rank = int(key)
            try:
                beat = parse_event({"type": "heartbeat", **{k: v for k, v in info.items() if k not in NODE_SIDE}})
            except EventError as e:
                logger.warning("channel node %s: skipping rank %d's heartbeat: %s", node, rank, e)
                continue
            assert isinstance(beat, Heartbeat)
            out[rank] = RankBeat(beat, node, (rank_hosts or {}).get(rank, beat.host),
                                 float(info.get("age_s") or 0.0) + since, info.get("alive", True) is not False)
    return out


@dataclass
class Incident:
    kind: str
    """rank_lost | hang | straggler | straggler_evicted | preemption | resize | gpu_unhealthy | network_cut"""
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
    restart: int = 0
    """torchrun's restart generation of the gang when it was detected (a node loss is one per generation)."""
    hosts: list[str] = field(default_factory=list)
    """Scope `node`: every host this incident lost. Hosts lost together (detected within one heartbeat timeout
    of each other in the same generation: a rack's switch, a power feed) are one incident, `host` the first."""


def incident_hosts(incident: dict[str, Any]) -> list[str]:
    """The hosts a recorded incident (a job record's `incidents` entry) lost whole: none unless scope `node`."""
    if incident.get("scope") != "node":
        return []
    return list(incident.get("hosts") or ([incident["host"]] if incident.get("host") else []))


class SegmentSupervisor:
    def __init__(self, record: JobRecord, attempt: int, policy: HealthPolicy, *, channel: ChannelReader,
                 commands: CommandWriter, scheduler_status: Callable[[], dict[str, Any] | None] | None = None,
                 rank_hosts: dict[int, str] | None = None, world: int | None = None,
                 sizes: list[int] | None = None, stop_on_lost_node: bool = False):
        self.record, self.attempt, self.policy = record, attempt, policy
        # Across machines (the hosts backend) a node behind a broken link or stopped whole ends no process the
        # launcher sees: its silence in the channel is the only sign, and the survivors would wait in their next
        # collective until its timeout. So there a node the channel lost stops the gang at once. On one host the
        # launcher sees an agent die directly, and a silence alone (a loaded machine) is only recorded.
        self.stop_on_lost_node = stop_on_lost_node
        # The channel (contract/channel.py): the workers' events, heartbeats and failure reports come up through
        # it and the notices and kills go down as commands, so the workers share neither this host's disk nor
        # its process ids.
        self.channel, self.commands = channel, commands
        self._beats: dict[int, RankBeat] = {}
        self._lost_nodes: set[str] = set()
        self._stack_dumps: list[StackDump] = []  # received, not yet taken by dump_stacks
        self._lease_renewed = 0.0
        self.world, self.sizes = world, sorted(sizes or [], reverse=True)  # elastic: the sizes it can run at
        self.resize_to: int | None = None
        self.rank_hosts = rank_hosts or {}  # the launch's node of each rank (several "nodes" on one host)
        self.run_dir = record.folder
        self.events = EventWriter(record.folder, True, Sender(job=record.job_id, attempt=attempt))
        self.scheduler_status = scheduler_status
        self.started = time.time()
        self.incidents: list[Incident] = []
        self._written: set[tuple[Any, ...]] = set()  # the keys of the incidents finish() put in the record
        self._handled: set[tuple[str, int, int]] = set()  # (kind, rank, restart generation) already acted on
        self._progress: tuple[Any, ...] = ()
        self._progress_at = self.started
        self._restarts = 0
        self._fatal_gen: int | None = None  # the restart generation that already had a fatal incident
        self._slow_counts: dict[int, int] = {}
        self._slow_seen: dict[int, int] = {}
        self._last_preempt_check = 0.0
        self._preempt_seen: float | None = None  # when a preemption at a later checkpoint boundary was first seen
        self.preempting = False
        self.terminate_requested: str | None = None
        self.gang_broken = False
        """The stop is for a node the channel lost: the survivors wait in a collective with it and can save
        nothing, so they get no grace (run_segment)."""
        self._evict_after: float | None = None
        self._evict_rank: int | None = None
        self._evict_host: str | None = None
        self._pending = record.data.get("pending_recovery")

    # ------------------------------------------------------------------ polling
    def poll(self) -> str | None:
        """One supervision pass. Returns a reason when the gang must be stopped now (e.g. straggler eviction)."""
        if self.terminate_requested is not None:  # stopped by policy: the ranks' notices and deaths from now on
            self._renew_lease()  # are that stop, not faults (only what they send is still journalled)
            self._journal(self.channel.poll())
            return self.terminate_requested
        now = time.time()
        beats = self._read_beats()
        restarts = max((b.beat.restart for b in beats.values()), default=0)
        if restarts > self._restarts:  # torchrun restarted the gang: a fresh start-up budget
            self._restarts, self._progress_at = restarts, now
        current = {r: b for r, b in beats.items() if b.beat.restart == restarts}
        if self._fatal_gen != restarts:  # after a fatal incident the peers' deaths are its consequence
            self._check_liveness(current, now)
            self._check_progress(current, now)
        self._check_node_scope(current, now)
        self._check_gpu_health(current)
        if self.terminate_requested is not None:
            return self.terminate_requested
        self._check_stragglers(current, now)
        self._check_preemption(current, now)
        self._check_recovered(current, now)
        if self._evict_after is not None and self.terminate_requested is None \
                and self._checkpoint_since(self._evict_after):
            self._evict_straggler(current)
        return self.terminate_requested

    def _evict_straggler(self, beats: dict[int, RankBeat]) -> None:
        """The checkpoint after the straggler's detection is committed: end the segment, and record the straggler's
        node as lost (scope `node`), so that the re-provisioning marks it unhealthy in the scheduler and places the
        gang without it, as for a lost node (tasks/steps.py `reprovision`)."""
        rank, host = self._evict_rank, self._evict_host
        inc = self._record("straggler_evicted", rank, f"straggler rank {rank} evicted at the checkpoint committed "
                           f"after its detection: node {host or '?'} is excluded from the next gang", beats,
                           action="end the segment; re-provision without the node", host=host)
        if host:
            inc.scope = "node"
        self.terminate_requested = "straggler evicted at the committed checkpoint"
        self.finish()  # the incident is in the record before the segment's failure is handled

    def network_cut(self, cut: Cut) -> None:
        """The gang's hosts are cut into groups that cannot reach each other (both still reach the store and the
        channel): stop the gang now (its ranks wait in collectives across the cut: no grace), and record the hosts
        outside the kept group as lost together (scope `node`), so the re-provisioning places the gang on hosts
        that all reach each other. The stopped attempt can commit nothing after that: the retry advances the
        job's fence (registry/fence.py)."""
        if self.terminate_requested is not None:
            return
        ranks = sorted(r for r, h in self.rank_hosts.items() if h in cut.exclude)
        inc = self._record("network_cut", ranks[0] if ranks else None, f"network cut: {cut.describe()}",
                           self._beats, host=cut.exclude[0], evidence={**cut.to_dict(), "ranks": ranks},
                           action=f"stop the gang; re-place it on hosts that all reach each other, without "
                                  f"{', '.join(cut.exclude)}")
        inc.scope, inc.hosts = "node", list(cut.exclude)
        self.terminate_requested = inc.message
        self.gang_broken = True
        self.finish()  # the incident is in the record before the segment's failure is handled

    def _check_gpu_health(self, beats: dict[int, RankBeat]) -> None:
        """A rank's beat says NVML found its node's GPU failing (uncorrected ECC, a page retirement waiting for a
        reset, a critical Xid, hardware slowdown): drain the node. The gang stops now, without an emergency
        checkpoint (state computed on that GPU since the last commit cannot be trusted), the node is recorded
        (scope `node`) so that the re-provisioning marks it unhealthy in the scheduler, and the retry resumes from
        the last committed checkpoint on other nodes."""
        for rank, b in sorted(beats.items()):
            gpu = b.beat.gpu
            if gpu is None or not gpu.available or gpu.healthy is not False or not b.host:
                continue
            bad = [d for d in gpu.devices if not d.healthy]
            why = "; ".join(f"GPU {d.index}: {', '.join(d.reasons) or 'unhealthy'}" for d in bad)
            inc = self._record("gpu_unhealthy", rank, f"node {b.host} drained: NVML reports {why} (rank {rank}'s "
                               "heartbeat)", beats, host=b.host,
                               action="stop the gang now; resume from the last committed checkpoint without the "
                                      "node",
                               evidence={"node": b.node, "devices": [d.model_dump() for d in bad]})
            inc.scope = "node"
            self.terminate_requested = f"GPU unhealthy on node {b.host}"
            self.finish()  # the incident is in the record before the segment's failure is handled
            return

    # ------------------------------------------------------------------ the channel
    def _read_beats(self) -> dict[int, RankBeat]:
        self._renew_lease()
        self._journal(self.channel.poll())
        self._beats = rank_beats(self.channel, self.rank_hosts)
        new = [node for node in self.channel.lost_nodes() if node not in self._lost_nodes]
        self._lost_nodes.update(new)
        everyone = set(self.rank_hosts.values())
        # Every node silent at once is the store's outage or this side's, not the nodes': the gang is not stopped
        # for it (the survivors' collectives and the nodes' lease decide).
        outage = len(everyone) > 1 and everyone <= self._lost_nodes
        for node in new:  # no batch for lost_after_s: the node (its publisher too) is gone
            self.node_lost(node, f"no batch from its publisher for {self.channel.lost_after_s:g}s")
            if self.stop_on_lost_node and self.terminate_requested is None and not outage:
                self.terminate_requested = (f"node {node} lost: no batch from its publisher for "
                                            f"{self.channel.lost_after_s:g}s")
                self.gang_broken = True
                self.finish()  # the incident is in the record before the segment's failure is handled
        return self._beats

    @property
    def lost_nodes(self) -> frozenset[str]:
        """Nodes the channel has lost (no batch for lost_after_s): nothing is to be waited for from them."""
        return frozenset(self._lost_nodes)

    def _journal(self, batches: list[Batch]) -> None:
        """What came up the channel, kept in the job's folder: events appended to the job's events.jsonl (the
        control plane is its only writer), failure reports into failures/ (read by tasks/segment.py), stack
        dumps into artifacts/stacks/ (the journal keeps the event without the text) and a profile's uploaded
        trace into profiles/."""
        events = []
        for _node, _seq, _i, rec in self.channel.records(batches):
            try:
                report = parse_event(rec)
            except EventError:  # not ours to judge here: the journal keeps it, its readers name the problem
                report = None
            if isinstance(report, FailureReport):
                folder = self.record.folder / "failures"
                write_json(folder / f"segment-{self.attempt}-rank-{report.rank:05d}.json", rec)
            elif isinstance(report, StackDump):
                events.append(self._keep_stacks(report))
            else:
                if isinstance(report, Profile):
                    self._keep_profile(report)
                events.append(rec)
        append_records(self.record.events_path, events)

    def _keep_stacks(self, dump: StackDump) -> dict[str, Any]:
        """A rank's stack dump: its text appended to the job's artifacts/stacks/segment-N/ file of that rank (what
        users and the hang report read), kept for the culprit naming; the journal gets the event without it."""
        path = stacks_dir(self.run_dir, self.attempt) / stacks_file_name(dump.rank, dump.restart)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(dump.text)
        self._stack_dumps.append(dump)
        del self._stack_dumps[:-4096]  # dumps nobody waits for (a `dump_stacks` sent by hand) do not pile up
        return dump_event(dump.model_copy(update={"text": "",
                                                   "artifact": str(path.relative_to(self.record.folder))}))

    def _keep_profile(self, profile: Profile) -> None:
        """A rank's profiler window, uploaded by the rank into the job's store: its trace and summary are copied
        into the job's profiles/ folder, which the flow merges and logs as run artifacts (flows/train_job.py)."""
        if not profile.trace:
            return
        folder = self.record.folder / "profiles"
        folder.mkdir(parents=True, exist_ok=True)
        for key in (profile.trace, summary_key(profile.trace)):
            try:
                self.channel.store.get_file(key, folder / key.rsplit("/", 1)[-1])
            except Exception as e:  # the store is busy or the object gone: the profile is lost, the job is not
                logger.warning("could not fetch rank %d's profile %s from the job's store: %s: %s",
                               profile.rank, key, type(e).__name__, e)

    def _renew_lease(self) -> None:
        if time.monotonic() - self._lease_renewed < LEASE_TTL_S / 3:
            return
        try:
            self.commands.renew_lease(LEASE_TTL_S)
            self._lease_renewed = time.monotonic()
        except Exception as e:  # the store is busy: the lease has 2/3 of its time left, try on the next pass
            logger.warning("renewing the workers' lease failed: %s: %s", type(e).__name__, e)

    def drain(self, timeout_s: float = 15.0, gone: Collection[str] = ()) -> None:
        """After the gang ended (and its publishers closed): read the channel to its end, so the journal holds
        every event the workers sent before the caller reads it. `gone`: nodes the launcher saw die whole, whose
        publishers died with them: what they sent is read, but their closing batch is not waited for (the channel
        would call them lost only lost_after_s after their last batch)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = self.channel.poll()
            self._journal(batches)
            states = [st.state for node, st in self.channel.status().items() if node not in gone]
            if not batches and all(st in ("closed", "lost") for st in states):
                break
            if not batches:
                time.sleep(0.1)

    def report_unreported_commits(self, store: ObjectStore, job_prefix: str) -> list[int]:
        """After the gang is gone: journal a `checkpoint` event for each checkpoint this attempt committed (its
        manifest is in the store and names this attempt) whose report never came up the channel, so the flow books
        it before a retry resumes from it (the retry's workers take the newest manifest in the store). Returns those
        steps. The store, not the channel, says what was committed: rank 0 writes the manifest, then reports it,
        and a rank killed in between (its node lost, the survivors stopped by `run_segment`) reports nothing."""
        try:
            steps = committed_steps(store, job_prefix)
        except Exception as e:  # the store is busy or down: the next segment's end lists it again
            logger.warning("listing the committed checkpoints of segment %d failed: %s: %s", self.attempt,
                           type(e).__name__, e)
            return []
        events, _, _ = read_typed_events(self.record.events_path, only=(CheckpointCommitted,))
        reported = {e.step for e in events if isinstance(e, CheckpointCommitted)}
        found: list[int] = []
        for step in steps:
            if step in reported:
                continue
            prefix = step_prefix(job_prefix, step)
            try:
                manifest = read_manifest(store, prefix)
            except Exception as e:
                logger.warning("reading the manifest of checkpoint step %d failed: %s: %s", step, type(e).__name__, e)
                continue
            if manifest is None or manifest.get("segment_attempt") != self.attempt:
                continue  # another attempt's (the end of that segment booked it), or not a manifest
            logger.warning("checkpoint step %d was committed by segment %d but its report never arrived (rank 0 "
                           "died after writing the manifest): booked from the store", step, self.attempt)
            self.events.publish(CheckpointCommitted(step=step, prefix=prefix, metrics=manifest.get("metrics", {})))
            found.append(step)
        return found

    def _to_rank(self, kind: str, rank: int, beat: RankBeat) -> None:
        """A command for one rank (`kill_rank`, `dump_stacks`): to its node, whose sidecar signals it."""
        self._send(kind, nodes=[beat.node], rank=rank)

    def _send(self, kind: str, *, nodes: list[str] | None = None, **args: Any) -> None:
        try:
            self.commands.send(kind, nodes=nodes, **args)
        except Exception as e:
            logger.warning("sending %s to the workers failed: %s: %s", kind, type(e).__name__, e)

    def _check_liveness(self, beats: dict[int, RankBeat], now: float) -> None:
        for rank, b in beats.items():
            if b.beat.phase in ("done", "failed"):
                continue
            if not b.alive:
                why = "its process died without a report (killed by a signal, the OOM killer or a lost node)"
            elif b.age_s > self.policy.heartbeat_timeout_s and not (_warming_up(b) or b.beat.phase == "closing"):
                # closing (the final commit, the process group's shutdown) stalls the beat thread too (3.5 s
                # after the segment's end under load 85): like start-up, the start-up budget judges it
                why = (f"no heartbeat for {b.age_s:.1f}s (> {self.policy.heartbeat_timeout_s:g}s): frozen or "
                       "unreachable")
            else:
                continue
            if self._once("rank_lost", rank, b.beat.restart):
                self._record("rank_lost", rank, f"rank {rank} lost: {why}", beats,
                             action="SIGKILL, then restart" if b.alive
                             else "restart (torchrun in segment, else segment retry)",
                             host=b.host, evidence={"node": b.node, "heartbeat_age_s": round(b.age_s, 2),
                                                    "alive": b.alive})
                if b.alive:
                    self._to_rank("kill_rank", rank, b)

    def node_lost(self, host: str, why: str = "its agent and workers died without a report") -> None:
        """The launcher saw the host's agent die of a signal, or the channel got no batch from the node: every
        incident of that host is a node loss (a pass of the supervisor may have seen only some of its ranks gone
        before the segment ended)."""
        if self.terminate_requested is not None:  # the policy stopped the gang: its agents died of that
            return
        if not self._lose_node(host):
            ranks = sorted(r for r, h in self.rank_hosts.items() if h == host)
            self._record("rank_lost", ranks[0] if ranks else None, f"node {host} lost: {why}", self._beats,
                         action="segment retry on a replacement node", host=host, evidence={"ranks": ranks})
            self._lose_node(host)

    def _lose_node(self, host: str) -> bool:
        """The host was lost whole: its ranks' losses in this restart generation (an earlier restart's loss on the
        host was another fault) become one incident of scope `node`, the first (its detection time), naming every
        rank of the host in `evidence.ranks`; the later ones are folded into it. A partitioned host's ranks go
        silent together and may pass the heartbeat timeout in the same pass, and counting one lost machine once
        per rank would double its share of the incident counts and the MTTR figures. False: no loss to scope."""
        lost = [i for i in self.incidents if i.kind == "rank_lost" and i.host == host
                and i.restart == self._restarts]
        if not lost:
            return False
        first = lost[0]
        ranks = {r for r, h in self.rank_hosts.items() if h == host}
        for inc in lost:
            ranks.update(inc.evidence.get("ranks", []))
            if inc.rank is not None:
                ranks.add(inc.rank)
        first.scope, first.evidence["ranks"] = "node", sorted(ranks)
        first.hosts = sorted(set(first.hosts) | {host})
        folded = lost[1:]
        # Another host lost in the same generation within a heartbeat timeout of this one: lost together, one
        # incident (the earlier), one recovery.
        together = [i for i in self.incidents if i.scope == "node" and i is not first and i.host != host
                    and i.restart == self._restarts and abs(i.detected_at - first.detected_at)
                    <= self.policy.heartbeat_timeout_s]
        if together:
            keep = min([first, *together], key=lambda i: i.detected_at)
            for inc in [first, *together]:
                if inc is keep:
                    continue
                keep.hosts = sorted(set(keep.hosts) | set(inc.hosts or [inc.host]))
                keep.evidence["ranks"] = sorted(set(keep.evidence.get("ranks", [])) | set(inc.evidence["ranks"]))
                folded.append(inc)
            keep.evidence["hosts"] = keep.hosts
            keep.message = (f"nodes {', '.join(keep.hosts)} lost together (the first detected: "
                            f"{keep.message.split(': ', 1)[-1]})")
            first = keep
        ids = {id(i) for i in folded}
        self.incidents = [i for i in self.incidents if id(i) not in ids]
        pending = self._pending
        if pending and any((pending.get("kind"), pending.get("rank"), pending.get("detected_at"))
                           == (i.kind, i.rank, i.detected_at) for i in folded):
            # the recovery is measured from the loss the record keeps (its MTTR from the node's first detection)
            self._pending = {**pending, "rank": first.rank, "detected_at": first.detected_at, "step": first.step}
            self.record.update(pending_recovery=self._pending)
        return True

    def _check_node_scope(self, beats: dict[int, RankBeat], now: float) -> None:
        """A host with a lost rank whose every rank is now gone was lost whole: its incidents get scope `node`
        (the ranks of a dying node are not all gone in the same pass, so this is checked again every pass)."""
        hosts = {i.host for i in self.incidents if i.kind == "rank_lost" and i.scope == "process" and i.host}
        for host in hosts:
            on_host = [b for b in beats.values() if b.host == host]
            if len(on_host) > 1 and all(
                    b.beat.phase not in ("done", "failed")
                    and (not b.alive or b.age_s > self.policy.heartbeat_timeout_s)
                    for b in on_host):
                self._lose_node(host)

    def _check_progress(self, beats: dict[int, RankBeat], now: float) -> None:
        # The first step of a (re)start is start-up too (the data loader's first batch, lazy imports, the first
        # collectives' connections: 10.8 s on the loaded 2-core host against ~1.5 s after): until every rank
        # finished one, the start-up budget applies, not the hang window.
        warm = not any(_warming_up(b) for b in beats.values())
        training = {r: b for r, b in beats.items() if b.beat.phase == "training"} if warm else {}
        signature = tuple(sorted((r, b.beat.restart, b.beat.step, b.beat.steps_done) for r, b in beats.items()))
        if signature != self._progress:
            self._progress, self._progress_at = signature, now
            return
        if not training:  # starting up or committing the last checkpoint: the longer budget applies
            if beats and all(_warming_up(b) or b.beat.phase == "closing" for b in beats.values()) \
                    and now - self._progress_at > self.policy.startup_timeout_s:
                self._on_hang(beats, now, now - self._progress_at, startup=True)
            return
        steps = [b.beat.step_s for b in training.values() if b.beat.step_s]
        timeout = self.policy.hang_timeout(statistics.median(steps) if steps else None)
        if now - self._progress_at > timeout:
            self._on_hang(beats, now, now - self._progress_at)

    def _on_hang(self, beats: dict[int, RankBeat], now: float, stalled_s: float, startup: bool = False) -> None:
        key = ("hang", -1, hash(self._progress))
        if key in self._handled:
            return
        self._handled.add(key)
        folder = stacks_dir(self.run_dir, self.attempt)
        folder.mkdir(parents=True, exist_ok=True)  # the workers' own disk may be elsewhere: the report goes here
        plain = {r: dump_event(b.beat) for r, b in beats.items()}  # the stack tools read beats as JSON objects
        stacks = self.dump_stacks(beats)
        rank, where = name_culprit(stacks, plain)
        what = "start-up / final commit" if startup else "step progress"
        message = (f"hang: no {what} on any rank for {stalled_s:.1f}s; rank {rank} is stuck at {where} "
                   f"(the others wait in collectives); stacks of every rank: {folder}")
        self._record("hang", rank, message, beats, action="dump stacks, SIGKILL the stuck rank, restart",
                     host=beats[rank].host if rank in beats else None,
                     evidence={"stalled_s": round(stalled_s, 2), "where": where, "stacks": str(folder),
                               "frames": {r: s[:6] for r, s in stacks.items()}})
        (folder / "hang-report.txt").write_text(message + "\n" + "\n".join(
            f"rank {r}: " + " <- ".join(s[:6]) for r, s in sorted(stacks.items())) + "\n")
        if rank in beats:
            self._to_rank("kill_rank", rank, beats[rank])

    def dump_stacks(self, beats: dict[int, RankBeat], wait_s: float = STACKS_WAIT_S) -> dict[int, list[str]]:
        """Every rank's stacks, through the channel: one `dump_stacks` command to the ranks' nodes (each sidecar
        signals its ranks and sends each rank's faulthandler text back as a `StackDump`), then the channel is
        read (and journaled) until every rank answered or `wait_s` passed. The main thread's frames per rank,
        innermost first, as 'path:line in func'; a rank that did not answer has none."""
        nodes = sorted({b.node for b in beats.values()})
        try:
            seq = self.commands.send("dump_stacks", nodes=nodes or None)
        except Exception as e:
            logger.warning("asking the workers for their stacks failed: %s: %s", type(e).__name__, e)
            return {}
        expected = {r for r, b in beats.items() if b.alive and b.beat.phase not in ("done", "failed", "terminated")}
        deadline = time.monotonic() + wait_s
        texts: dict[int, str] = {}
        while time.monotonic() < deadline:
            self._journal(self.channel.poll())
            for dump in self._stack_dumps:
                if dump.cmd_seq == seq:
                    texts[dump.rank] = texts.get(dump.rank, "") + dump.text
            self._stack_dumps = [d for d in self._stack_dumps if d.cmd_seq != seq]
            if expected <= set(texts):
                break
            time.sleep(0.1)
        return {rank: main_thread_frames(text) for rank, text in texts.items()}

    def _check_stragglers(self, beats: dict[int, RankBeat], now: float) -> None:
        local = {r: b.beat.local_s for r, b in beats.items() if b.beat.phase == "training" and b.beat.local_s}
        if len(local) < 2:
            return
        for rank, value in local.items():
            med = statistics.median(v for r, v in local.items() if r != rank)  # the others: 2 ranks work too
            done = beats[rank].beat.steps_done
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
                             host=beats[rank].host,
                             evidence={"local_s": {str(r): round(v, 4) for r, v in local.items()}})
                if evict:
                    self._evict_after, self._evict_rank, self._evict_host = now, rank, beats[rank].host

    def _check_preemption(self, beats: dict[int, RankBeat], now: float) -> None:
        noticed = [r for r, b in beats.items() if b.beat.phase_note == "termination notice received"]
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
            at = status.get("preempt_at")
            if at is not None and now < at:
                # Stopped at its next checkpoint boundary (a starving gang's preemption): train on until then,
                # or until the commit that comes first, so the preemption loses no work.
                if self._preempt_seen is None:
                    self._preempt_seen = now
                if not self._checkpoint_since(self._preempt_seen):
                    return
            self.preempting = True
            self._record("preemption", None, f"the scheduler preempts this job (deadline "
                         f"{status.get('preempt_deadline')}{', at its checkpoint boundary' if at else ''}): "
                         "termination notice to every worker", beats, action="emergency checkpoint")
            self._send("preemption_notice", deadline_s=status.get("preempt_deadline"))
        elif status and status.get("state") == "running":
            self._check_resize(int(status.get("gpus") or 0), beats)

    def _check_resize(self, gpus: int, beats: dict[int, RankBeat]) -> None:
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
        if not beats or any(b.beat.phase != "training" for b in beats.values()):
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
        self._send("resize_notice", num_nodes=None, workers=target)

    def _check_recovered(self, beats: dict[int, RankBeat], now: float) -> None:
        """MTTR ends at the first step completed after a restore that followed the detection."""
        pending = self._pending
        if pending is None:
            return
        # A short retried segment may finish between two passes: ranks already closing or done count too.
        fresh = [b.beat for b in beats.values() if b.beat.phase in ("training", "closing", "done")
                 and b.beat.steps_done >= 1 and (b.beat.started or 0) > pending["detected_at"]]
        if len(fresh) < max(1, len(beats)) or not beats:
            return
        resumed = min(int(b.resumed_from or 0) for b in fresh)
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
    def _once(self, kind: str, rank: int, generation: int) -> bool:
        key = (kind, rank, generation)
        if key in self._handled:
            return False
        self._handled.add(key)
        return True

    def _record(self, kind: str, rank: int | None, message: str, beats: dict[int, RankBeat], *, action: str,
                host: str | None = None, evidence: dict[str, Any] | None = None) -> Incident:
        step = max((b.beat.step or 0 for b in beats.values()), default=None)
        inc = Incident(kind, rank, time.time(), message, action, self.attempt, step, host=host,
                       evidence=evidence or {}, restart=self._restarts)
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
        inc = Incident(kind, rank, detected_at, message, action, self.attempt, step, restart=self._restarts)
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
        # The last beat of each rank (the typed Heartbeat), kept in the job's folder for the post-mortem
        # (trainer/health.py read_heartbeats).
        for rank, b in self._beats.items():
            with contextlib.suppress(OSError):
                write_json(heartbeat_path(self.run_dir, self.attempt, rank), dump_event(b.beat))
        # This segment's incidents are written whole each time, in place of what the last call wrote: an incident
        # written before may since have become a node loss (its scope) or been folded into one (_lose_node).
        current = [asdict(i) for i in self.incidents]
        keys = {_incident_key(d) for d in current}
        if not current and not self._written:
            return
        self.record.reload()
        history = [d for d in self.record.data.get("incidents", []) if _incident_key(d) not in self._written]
        history.extend(current)
        self.record.update(incidents=history)
        self._written = keys


def _incident_key(d: dict[str, Any]) -> tuple[Any, ...]:
    return d.get("attempt"), d.get("kind"), d.get("rank"), d.get("detected_at")


def _warming_up(b: RankBeat) -> bool:
    """Starting, or in the first step of its (re)start. Both hold the GIL in long C calls (`import torch` runs
    libtorch's initialisation, the first step lazy imports and the first collectives' set-up), which stop the
    beat thread: gaps of 2.3-4.3 s at load 35, and 3-4 s false `rank_lost`s of healthy gangs under heavier load,
    all at step 0 or the first step after a restore. The first step also carries the data loader's start-up
    (10.8 s against ~1.5 s after on the loaded host). A warming-up rank's liveness is its node's process watch;
    a stuck warm-up is the start-up budget's (`startup_timeout_s`), not the heartbeat or hang window's."""
    return b.beat.phase == "starting" or (b.beat.phase == "training" and not b.beat.steps_done)


# ---------------------------------------------------------------------- stacks


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


# ---------------------------------------------------------------------- divergence and the give-up report


def offending_samples(config: SegmentConfig, step: int, skip: list[int]) -> list[int]:
    """The global batch of 0-based step `step`, in the order the workers used (same construction as the
    trainer's DataFeed, with the skip list that was in force)."""
    from trainforge.datasets.sampler import SampleOrder

    ds = config.dataset
    batch = config.training.global_batch_size
    if ds.in_place:  # its samples are counted as they are read: walk the order as the workers did
        from trainforge.datasets.training_data import open_training_data

        data = open_training_data(ds.path, ds.ref, eval_fraction=ds.eval_fraction, seed=config.training.seed,
                                  seq_len=config.training.seq_len, skip=skip, tokenizer_name=ds.tokenizer)
        try:
            return data.order.global_indices(step * batch, batch)
        finally:
            data.close()
    order = SampleOrder(ds.num_samples, ds.eval_fraction, ds.version or "", config.training.seed,
                        skip=frozenset(skip))
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
