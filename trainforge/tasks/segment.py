"""Launching and supervising one training segment on the local backend.

A segment is one launch of the whole gang (torchrun + workers). It ends when training ends, at
`segment_max_steps`, at a preemption (emergency checkpoint first), at a failure, or when the run is cancelled.
While it runs, a SegmentSupervisor (tasks/supervisor.py) watches the ranks' heartbeats and step progress.
A failure is turned into a `SegmentFailed` that names the rank, the exception (or the supervisor's finding: lost
rank, hang with the stuck line) and the last lines of that rank's log, and says whether it is the user's fault
(`user`: not worth retrying), the infrastructure's (`infra`: retried from the last committed checkpoint) or a
divergence (`divergence`: retried from the last good checkpoint with the offending batch's samples skipped).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.contract.channel import ChannelReader, CommandWriter, channel_root
from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import FailureKind, FailureReport, SegmentEnd, from_file
from trainforge.events import last_of
from trainforge.infra.backends.hosts import (
    HostsGang,
    HostUnreachable,
    InputsUnavailable,
    RemoteNode,
    StartCancelled,
    agent_command,
    remove_job_folders,
    runner_command,
)
from trainforge.infra.backends.local import LocalGang, LocalMultiNodeGang, SidecarSpec, free_port
from trainforge.infra.backends.node_agent import NodeProgram
from trainforge.infra.backends.node_folders import SWEEP_FLOOR_H
from trainforge.infra.backends.node_logs import FETCH_TIMEOUT_S, fetch_node_logs
from trainforge.infra.launch import (
    GangNode,
    NodeLaunch,
    allocator_environment,
    gang_launch,
    node_environment,
    worker_environment,
)
from trainforge.infra.storage import open_store
from trainforge.plan.cluster import LauncherSpec
from trainforge.plan.layout import Layout
from trainforge.registry.fence import advance_attempt
from trainforge.registry.jobs import JobRecord, JobStore
from trainforge.registry.manifest import job_fence, manifest_steps
from trainforge.tasks.supervisor import SegmentSupervisor, incident_hosts, offending_samples
from trainforge.trainer.health import HealthPolicy, collective_timeout_for

LOG_TAIL_LINES = 20
BROKEN_GANG_GRACE_S = 0.5
"""A stop after a node was lost: the survivors block in a collective with it and cannot act on a SIGTERM, so the
grace is short (a partitioned node's survivors waited out a policy stop's 5 s, the backends' default, stop 54)."""

logger = logging.getLogger(__name__)


class SegmentFailed(RuntimeError):
    def __init__(self, message: str, kind: str, rank: int | None):
        super().__init__(message)
        self.kind = kind
        self.rank = rank


class SegmentCancelled(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SegmentResult:
    attempt: int
    exit_code: int
    duration_s: float
    last_step: int | None
    reason: str | None


Gang = LocalGang | LocalMultiNodeGang | HostsGang

# Gangs alive in this process, so a cancel or Ctrl-C can stop every worker (no orphans).
_LIVE: dict[str, Gang] = {}
_LIVE_LOCK = threading.Lock()


def terminate_job(job_id: str) -> None:
    with _LIVE_LOCK:
        gang = _LIVE.pop(job_id, None)
    if gang is not None:
        gang.terminate()


def terminate_all() -> None:
    for job_id in list(_LIVE):
        terminate_job(job_id)


atexit.register(terminate_all)


def next_attempt(record: JobRecord) -> int:
    attempts = record.data.get("segments", [])
    return len(attempts)


def health_policy(record: JobRecord, env: dict[str, str] | None = None) -> HealthPolicy:
    """The policy's defaults, the collective timeout from the plan's predicted step time, then $TRAINFORGE_HEALTH."""
    predicted = (record.data.get("plan") or {}).get("predicted") or {}
    base = HealthPolicy(collective_timeout_s=collective_timeout_for(predicted.get("step_time_s")))
    return base.with_env(env)


def segment_config(record: JobRecord, config: SegmentConfig, attempt: int, policy: HealthPolicy,
                   layout: dict[str, Any] | None = None) -> Path:
    """This attempt's worker config: the job's, plus the health policy, the samples divergence rollbacks
    skip (the job record keeps the list, so every later segment replays the same order) and, for an elastic job
    resized to another data-parallel degree, that size's layout (tasks/provision.py `layout_for`)."""
    attempt_config = config.for_attempt(attempt, policy, record.data.get("skip_samples", []),
                                        Layout(**layout) if layout else None)
    return attempt_config.write(record.folder / f"worker-config-segment-{attempt}.json")


def run_segment(record: JobRecord, config_path: Path, config: SegmentConfig, *, nproc: int, max_restarts: int,
                extra_env: dict[str, str] | None = None, cancel: threading.Event | None = None,
                scheduler_status: Callable[[], dict[str, Any] | None] | None = None, nnodes: int = 1,
                node_names: list[str] | None = None, layout: dict[str, Any] | None = None,
                sizes: list[int] | None = None, hosts: list[GangNode] | None = None,
                launcher: LauncherSpec | None = None, gpu_type: str = "cpu") -> SegmentResult:
    """One launch of the gang. `nnodes` > 1 runs one torchrun agent per node (`nproc` / `nnodes` workers each)
    on this host, sharing one rendezvous; `node_names` (the scheduler's placement, in rank order) names them, so
    a lost node is reported under the name the scheduler knows. With a `hosts` launcher, `hosts` are the gang's
    machines (the allocation's nodes with their addresses): one node agent each, started through the runner
    (infra/backends/hosts.py). `layout` is this size's layout (elastic jobs); `sizes` the sizes the job can run
    at: when the scheduler grows or shrinks the allocation to another of them, the segment ends at an emergency
    checkpoint with reason `resize` (the caller re-provisions)."""
    if cancel is not None and cancel.is_set():  # a retry scheduled before the cancel: start nothing
        raise SegmentCancelled(f"{config.job_id} was cancelled before segment {next_attempt(record)} started")
    # Checked before anything is recorded: a bad TRAINFORGE_ALLOCATOR fails here, leaving no segment behind.
    allocator = allocator_environment(dict(os.environ) | (extra_env or {}))  # jemalloc: RSS tracks live memory
    store = open_store(config.storage_url)
    # The job's fence names this attempt before any of its workers starts: from now on the store refuses an older
    # attempt's commits (registry/fence.py). A fence already past the record's count (the record was rebuilt for a
    # job whose store lived on) moves the numbering past it: attempts only grow.
    fence = job_fence(store, config.storage_prefix)
    attempt = max(next_attempt(record), fence.attempt + 1 if fence is not None else 0)
    advance_attempt(store, config.storage_prefix, attempt, lambda: manifest_steps(store, config.storage_prefix))
    segments = record.data.get("segments", [])
    # a hosts job's machines, per segment: its folders there are removed when the job ends (remove_node_folders)
    segments.append({"attempt": attempt, "started_at": time.time(), "state": "running",
                     **({"nodes": [h.name for h in hosts]} if hosts else {})})
    record.update(segments=segments, state="running")
    log_dir = record.folder / "logs" / f"segment-{attempt}"
    threads = max(1, (os.cpu_count() or 1) // nproc)
    base_env = dict(os.environ) | (extra_env or {})
    policy = health_policy(record, base_env)
    config_path = segment_config(record, config, attempt, policy, layout)
    env = worker_environment(base_env, config_path=str(config_path),
                             segment_attempt=attempt, threads_per_worker=threads)
    env.update(allocator)
    remote = launcher is not None and launcher.backend == "hosts"
    if remote:
        if not hosts:
            raise ValueError("the hosts launcher needs the gang's hosts (the allocation's nodes and their addresses)")
        nodes = list(hosts)
    else:
        nodes = [GangNode(name) for name in (node_names or [f"node-{i}" for i in range(nnodes)])]
    nnodes = len(nodes)
    # Every message between this control plane and the workers goes through the segment attempt's channel in
    # the job's store: one sidecar publisher per node, commands down; nothing through this host's disk or pids.
    root = f"{channel_root(config.storage_prefix)}/segment-{attempt}"
    token = uuid.uuid4().hex[:12]
    if remote:
        assert launcher is not None
        gang, launches = _hosts_gang(launcher, nodes, nproc // nnodes, max_restarts, config, config_path, attempt,
                                     env, extra_env or {}, store_root=root, token=token, log_dir=log_dir,
                                     gpu_type=gpu_type)
    else:
        gang, launches = _local_gang(nodes, nproc, max_restarts, env, config, root, token, log_dir)
    rank_hosts = {r: launch.node.name for launch in launches for r in launch.ranks} if nnodes > 1 else {}
    names = [launch.node.name for launch in launches]
    reader = ChannelReader(store, root, lost_after_s=policy.heartbeat_timeout_s,
                           flush_interval_s=SidecarSpec.flush_interval_s)
    supervisor = SegmentSupervisor(record, attempt, policy, scheduler_status=scheduler_status,
                                   rank_hosts=rank_hosts, world=nproc, sizes=sizes, channel=reader,
                                   commands=CommandWriter(store, root), stop_on_lost_node=remote)
    if isinstance(gang, HostsGang):
        gang.lost = lambda: supervisor.lost_nodes
    t0 = time.monotonic()
    started = time.time()
    try:
        if isinstance(gang, HostsGang):  # its nodes may fetch inputs for long: the job's cancel ends that too
            gang.start(should_stop=lambda: cancel is not None and cancel.is_set())
        else:
            gang.start()
    except StartCancelled as exc:  # every agent already started was stopped
        reader.close()
        _finish(record, attempt, "cancelled")
        raise SegmentCancelled(f"segment {attempt} of {config.job_id} cancelled while its nodes started") from exc
    except HostUnreachable as exc:  # every agent already started was stopped: the host is left out next time
        supervisor.node_lost(exc.host, str(exc).splitlines()[0])
        supervisor.finish()
        reader.close()
        _finish(record, attempt, "failed", error=str(exc))
        raise SegmentFailed(f"{exc}: treated as an infrastructure fault (recovery: a gang without {exc.host})",
                            "infra", None) from exc
    except InputsUnavailable as exc:  # the store lost or changed one: no host to blame, nothing started
        supervisor.finish()
        reader.close()
        _finish(record, attempt, "failed", error=str(exc))
        raise SegmentFailed(f"{exc}: treated as a platform fault (recovery: a retry fetches again)", "infra",
                            None) from exc
    except BaseException:  # an interrupt or a runner that cannot start: nothing was left running (start's own)
        reader.close()
        _finish(record, attempt, "cancelled")
        raise
    with _LIVE_LOCK:
        _LIVE[config.job_id] = gang
    try:
        while (code := gang.poll()) is None:
            if cancel is not None and cancel.is_set():
                gang.terminate()
                raise SegmentCancelled(f"segment {attempt} of {config.job_id} cancelled; workers stopped")
            if isinstance(gang, HostsGang) and (cut := gang.cut(_heard_at(reader))) is not None:
                supervisor.network_cut(cut)  # a cut between the gang's hosts: stopped below, re-placed by the retry
            if supervisor.poll() is not None:  # policy: stop the gang now (straggler eviction, GPU drain, a node
                # the channel lost: then the gang is broken and its survivors get no grace, as below)
                gang.terminate(BROKEN_GANG_GRACE_S) if supervisor.gang_broken else gang.terminate()
                code = gang.poll() if gang.poll() is not None else -1
                break
            time.sleep(0.2)
        if code != 0 and cancel is not None and cancel.is_set():  # the cancel's own stop ended the gang first:
            # not a failure to retry (the except below records the segment cancelled)
            raise SegmentCancelled(f"segment {attempt} of {config.job_id} cancelled; workers stopped")
        if code != 0 and nnodes > 1:
            supervisor.poll()  # who died first, before the survivors fail of the broken gang
            killed = [names[i] for i in gang.killed_nodes()]
            for name in killed:  # the agent itself died: the whole node was lost, not one process
                supervisor.node_lost(name)
            gang.terminate(grace_s=BROKEN_GANG_GRACE_S)  # a lost node: the survivors' gang is broken, stop them
            # (after the supervisor saw who died first)
            supervisor.drain(gone=killed)  # their publishers closed with the gang: journal the rest (events,
            # reports); a killed node's publisher died with it
        else:
            gang.stop_sidecar()  # their closing batches: everything the workers sent is in the channel now
            supervisor.drain()
            supervisor.poll()  # a rank torchrun saw die before our last pass
    except BaseException:
        gang.terminate()
        _finish(record, attempt, "cancelled")
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(config.job_id, None)
        gang.stop_sidecar()
        supervisor.finish()
        reader.close()
    # Every process of the gang is gone: a checkpoint it committed without its report reaching the channel (rank 0
    # killed between the manifest and the report, with its node or by the stop above) is booked now, before the
    # caller decides on a retry, which resumes from the newest manifest in the store.
    supervisor.report_unreported_commits(store, config.storage_prefix)
    if remote:  # the nodes' logs, uploaded by their agents before they reported their exits (node_logs.py)
        deadline = time.monotonic() + FETCH_TIMEOUT_S
        for i, name in enumerate(names):
            try:
                fetch_node_logs(store, node_logs_key(config, attempt, name), i, log_dir, deadline)
            except Exception as exc:  # the segment's own outcome matters more than its logs; the next node's
                # fetch would meet the same store
                logger.warning("job %s: the logs of node %s (segment %d) could not be fetched: %s",
                               config.job_id, name, attempt, exc)
                break
    duration = time.monotonic() - t0
    end = _last_segment_end(record, since=started)
    if code != 0 and not (supervisor.preempting and end is not None and end.reason == "preempted"):
        exc = _failure(record, attempt, log_dir, code, supervisor, config)
        _finish(record, attempt, "failed", error=str(exc))
        raise exc
    reason = end.reason if end is not None else None
    if reason == "preempted" and supervisor.resize_to is not None:  # our own notice: a resize, not a reclaim
        reason = "resize"
    _finish(record, attempt, {"preempted": "preempted", "resize": "resized"}.get(reason or "", "completed"))
    return SegmentResult(attempt, code, duration, end.step if end is not None else None, reason)


def _heard_at(reader: ChannelReader) -> Callable[[str], float | None]:
    """When the channel last heard each live node (time.monotonic; None: lost, or nothing heard yet)."""
    statuses: dict[str, Any] = {}

    def heard_at(node: str) -> float | None:
        if not statuses:
            statuses.update(reader.status())
        status = statuses.get(node)
        return None if status is None or status.state != "live" else time.monotonic() - status.age_s

    return heard_at


def _local_gang(nodes: list[GangNode], nproc: int, max_restarts: int, env: dict[str, str], config: SegmentConfig,
                root: str, token: str, log_dir: Path) -> tuple[LocalGang | LocalMultiNodeGang, list[NodeLaunch]]:
    """The local backend: every node's agent on this host (several: the static rendezvous, one port)."""
    nnodes = len(nodes)
    launches = gang_launch(nodes, nproc_per_node=nproc // nnodes, port=free_port(), run_id=token,
                           max_restarts=max_restarts,
                           log_dir=lambda i, _: str(log_dir if nnodes == 1 else log_dir / f"node-{i}"))
    gangs = [LocalGang(launch.launch, env | launch.env,
                       log_dir / ("agent.log" if i == 0 else f"agent-node-{i}.log"),
                       SidecarSpec(config.storage_url, root, launch.node.name, f"@trainforge-{token}-{i}"))
             for i, launch in enumerate(launches)]
    return (gangs[0] if nnodes == 1 else LocalMultiNodeGang(gangs)), launches


def _hosts_gang(launcher: LauncherSpec, nodes: list[GangNode], per_node: int, max_restarts: int,
                config: SegmentConfig, config_path: Path, attempt: int, env: dict[str, str],
                extra_env: dict[str, str], *, store_root: str, token: str, log_dir: Path,
                gpu_type: str) -> tuple[HostsGang, list[NodeLaunch]]:
    """The hosts backend: one node agent per machine through the runner; its config, environment and logs are the
    node's own (the program goes down the runner's stdin, logs stay in the node's work folder). Each node's config
    names its own run and staging folders (`for_node`); its workers fetch the inputs the flow published."""
    python = launcher.python or sys.executable  # default: the same environment at the same path on every host
    jobs = f"{launcher.work_dir.rstrip('/')}/{config.job_id}"  # a node's folder for the job, across segments
    work = f"{jobs}/segment-{attempt}"
    launches = gang_launch(nodes, nproc_per_node=per_node, port=launcher.rendezvous_port or 0,
                           run_id=f"{config.job_id}-{attempt}-{token}", max_restarts=max_restarts,
                           log_dir=lambda _, node: f"{work}/{node.name}/logs", python=python,
                           interface=launcher.interface, rendezvous="c10d")
    node_env = node_environment(env, extra_env)
    # This host's cores say nothing of a node's: each node divides its own, unless the user set the count.
    node_env.pop("OMP_NUM_THREADS", None)
    threads = extra_env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if threads:
        node_env["OMP_NUM_THREADS"] = threads
    racks = [launch.node.rack for launch in launches]
    # a rack is split when its nodes' ranks are not consecutive: between its first and last node, another rack's
    split = sorted({r for r in racks if r is not None
                    and len(racks) - racks[::-1].index(r) - racks.index(r) != racks.count(r)})
    if split:  # the scheduler meant each rack's nodes to be consecutive ranks; torch numbers them by address
        logger.warning("job %s: the nodes of rack(s) %s do not get consecutive ranks (torch's c10d rendezvous "
                       "numbers nodes by address): give each rack's hosts addresses that sort together",
                       config.job_id, ", ".join(split))
    attempt_config = SegmentConfig.load(config_path)
    sweep_after_s = 3600 * max(launcher.keep_node_folders_h, SWEEP_FLOOR_H)
    remote = []
    for i, launch in enumerate(launches):
        sidecar = SidecarSpec(config.storage_url, store_root, launch.node.name, f"@trainforge-{token}-{i}",
                              python=python)
        program = NodeProgram(node=launch.node.name, work_dir=f"{work}/{launch.node.name}", torchrun=launch.command(),
                              node_dir=f"{jobs}/{launch.node.name}", sweep_after_s=sweep_after_s,
                              sidecar=sidecar.command(), env=node_env | launch.env | {
                                  "TRAINFORGE_CHANNEL_SOCKET": sidecar.socket},
                              config=attempt_config.for_node(f"{jobs}/{launch.node.name}").dump_json(),
                              gpu_type=gpu_type, devices=list(launch.node.devices),
                              workers=per_node, pick_port=i == 0 and launcher.rendezvous_port is None,
                              logs_url=config.storage_url, logs_key=node_logs_key(config, attempt, launch.node.name))
        argv = runner_command(launcher.runner, launch.node.name, agent_command(python))
        remote.append(RemoteNode(launch.node.name, launch.node.address, argv, program,
                                 log_dir / f"runner-{launch.node.name}.log"))
    return HostsGang(remote, start_timeout_s=launcher.start_timeout_s,
                     inputs_timeout_s=launcher.inputs_timeout_s), launches


def remove_node_folders(record: JobRecord, launcher: LauncherSpec,
                        log: logging.Logger | logging.LoggerAdapter[Any] = logger) -> dict[str, str]:
    """When a `hosts` job ends: its folders on every host it ran a segment on (infra/backends/node_folders.py),
    unless the launcher keeps them for inspection. Never raises: a host that keeps them is said in `log` (the
    flow's; the next agent there sweeps them by age). Each host's outcome."""
    if launcher.backend != "hosts" or launcher.keep_node_folders_h > 0:
        return {}
    try:
        data = JobStore(record.folder.parent).get(record.job_id).data  # the tasks' writes
        ran = {node for seg in data.get("segments", []) for node in seg.get("nodes", [])}
        # A host the job lost (killed, partitioned) is not waited on at the job's end: it may not answer for the
        # whole timeout; when it is back, its next agent sweeps the folders by age. A host on the far side of a
        # network cut still answers its runner (the cut was between the gang's hosts): its folders go too.
        lost = {h for i in data.get("incidents", []) if i.get("kind") != "network_cut"
                for h in incident_hosts(i)} & ran
        hosts = sorted(ran - lost)
        outcomes = {host: "lost by the job: left to the host's next agent" for host in sorted(lost)}
        if hosts:
            outcomes |= remove_job_folders(launcher.runner, launcher.python or sys.executable, launcher.work_dir,
                                           record.job_id, hosts)
    except Exception as exc:  # the job's outcome stands whatever happens here
        log.warning("job %s: its folders on the hosts were not removed (%s: %s): each host's next agent "
                       "removes them once unused for %g h", record.job_id, type(exc).__name__, exc, SWEEP_FLOOR_H)
        return {}
    kept = {h: o for h, o in outcomes.items() if o not in ("removed", "absent")}
    if kept:
        log.warning("job %s: its folders were kept on %s; each host's next agent removes them once unused for "
                       "%g h", record.job_id, "; ".join(f"{h} ({o})" for h, o in sorted(kept.items())),
                       max(launcher.keep_node_folders_h, SWEEP_FLOOR_H))
    return outcomes


def node_logs_key(config: SegmentConfig, attempt: int, node: str) -> str:
    return f"{config.storage_prefix}/logs/segment-{attempt}/{node}"


def _finish(record: JobRecord, attempt: int, state: str, error: str | None = None) -> None:
    record.reload()
    segments = record.data.get("segments", [])
    for seg in segments:
        if seg["attempt"] == attempt:
            seg.update(state=state, ended_at=time.time(), **({"error": error[:2000]} if error else {}))
    record.update(segments=segments)


def _last_segment_end(record: JobRecord, since: float = 0.0) -> SegmentEnd | None:
    """This segment's end event (one written at or after `since`), or None when it did not end cleanly."""
    end = last_of(record.events_path, SegmentEnd)
    return end if end is not None and end.time >= since else None


KIND_ORDER: dict[FailureKind, int] = {"user": 0, "divergence": 1, "infra": 2}


def failure_reports(record: JobRecord, attempt: int) -> list[FailureReport]:
    """The ranks' failure reports of a segment attempt (journalled from the channel by the supervisor), typed, the
    root cause first: a user fault before a divergence before an infrastructure one, then the earliest; the others
    are usually peers dying of the lost connection. A report that does not parse is left out with a warning."""
    reports = []
    for path in sorted((record.folder / "failures").glob(f"segment-{attempt}-rank-*.json")):
        try:
            reports.append(from_file(FailureReport, json.loads(path.read_text())))
        except (OSError, ValueError) as e:  # EventError is a ValueError: it names the field
            logger.warning("ignoring the failure report %s: %s", path, e)
    return sorted(reports, key=lambda r: (KIND_ORDER[r.failure], r.time))


def _failure(record: JobRecord, attempt: int, log_dir: Path, code: int, supervisor: SegmentSupervisor | None = None,
             config: SegmentConfig | None = None) -> SegmentFailed:
    reports = failure_reports(record, attempt)
    root = supervisor.root_cause() if supervisor is not None else None
    if supervisor is not None and supervisor.terminate_requested:
        why = supervisor.terminate_requested
        if root is not None and root.message != why:  # the stop is often the root cause itself (a lost node)
            why = f"{why}; {root.message}"
        return SegmentFailed(f"segment {attempt} stopped by policy: {why}", "infra", root.rank if root else None)
    if reports and reports[0].failure == "divergence" and reports[0].step is not None and config is not None \
            and supervisor is not None:
        return _divergence(record, attempt, reports[0], supervisor, config)
    if root is not None and (not reports or reports[0].failure == "infra"):
        # The supervisor saw the cause (a lost or hung rank); the peers' reports are its consequences.
        tail = _log_tail(log_dir, root.rank) if root.rank is not None else _tail(log_dir / "agent.log")
        return SegmentFailed(f"{root.message}: treated as an infrastructure fault (recovery: {root.action})\n"
                             f"--- last lines of rank {root.rank}'s log ---\n{tail}", "infra", root.rank)
    if reports:
        first = reports[0]
        rank = first.rank
        tail = _log_tail(log_dir, rank)
        return SegmentFailed(
            f"rank {rank} failed ({first.failure} error): {first.exception}\n"
            f"--- last lines of rank {rank}'s log ({_rank_log(log_dir, rank)}) ---\n{tail}",
            first.failure, rank,
        )
    # No report: the process was killed (signal, OOM killer, lost node) before it could write one.
    rank, signal_text = _killed_rank(log_dir)
    tail = _log_tail(log_dir, rank) if rank is not None else _tail(log_dir / "agent.log")
    who = f"rank {rank}" if rank is not None else "a worker"
    return SegmentFailed(f"{who} died without a report ({signal_text or f'torchrun exit code {code}'}): "
                         f"treated as an infrastructure fault\n--- last lines ---\n{tail}", "infra", rank)


def _rank_log(log_dir: Path, rank: int) -> Path | None:
    """torchrun's log of a global rank: `<run>/attempt_N/<local rank>/stderr.log`, under `node-<i>/` when the
    segment ran one agent per node (global rank = node * ranks per node + local rank)."""
    nodes = {int(p.name.split("-")[1]): p for p in log_dir.glob("node-*") if p.name.split("-")[1].isdigit()}
    if nodes:  # by name: a node lost whole (or whose logs did not come back) leaves a gap, not a shift
        per_node = len({p.name for p in nodes[min(nodes)].glob("*/attempt_*/*") if p.name.isdigit()}) or 1
        node, local = divmod(rank, per_node)
        if node not in nodes:
            return None
        found = sorted(nodes[node].glob(f"*/attempt_*/{local}/stderr.log"))
    else:
        found = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))
    return found[-1] if found else None


def _tail(path: Path | None, n: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.is_file():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _log_tail(log_dir: Path, rank: int) -> str:
    return _tail(_rank_log(log_dir, rank))


def _killed_rank(log_dir: Path) -> tuple[int | None, str | None]:
    """torchrun's summary names the first failed rank and its exit code / signal: the first node's agent log that
    has one (`agent.log`, then each other node's `agent-node-<i>.log`)."""
    others = sorted(log_dir.glob("agent-node-*.log"),
                    key=lambda p: int(n) if (n := p.stem.rsplit("-", 1)[1]).isdigit() else 1 << 30)
    for path in [log_dir / "agent.log", *others]:
        rank, sig = None, None
        for line in _tail(path, 200).splitlines():
            line = line.strip()
            if line.startswith("rank") and ":" in line and rank is None:
                with contextlib.suppress(ValueError):
                    rank = int(line.split(":", 1)[1].split()[0])
            if ("exitcode" in line or "Signal" in line) and sig is None:
                sig = line
        if rank is not None or sig is not None:
            return rank, sig
    return None, None


def _divergence(record: JobRecord, attempt: int, report: FailureReport, supervisor: SegmentSupervisor,
                config: SegmentConfig) -> SegmentFailed:
    """Policy `rollback`: skip the offending batch's samples from now on (the job record keeps the list, each
    checkpoint manifest records it) and retry from the last good checkpoint; past `max_rollbacks`, stop."""
    record.reload()
    assert report.step is not None  # the caller routes only a divergence report with its step here
    step, reason = report.step, report.reason or ""
    skip = list(record.data.get("skip_samples", []))
    samples = offending_samples(config, step, skip)
    rollbacks = [*record.data.get("divergence", []), {"step": step, "reason": reason,
                                                      "samples": samples, "attempt": attempt, "time": report.time}]
    record.update(skip_samples=sorted(set(skip) | set(samples)), divergence=rollbacks)
    within = len(rollbacks) <= supervisor.policy.max_rollbacks
    supervisor.note("divergence", report.rank, f"divergence at step {step + 1}: {reason}",
                    action=f"roll back to the last good checkpoint, skip {len(samples)} samples" if within
                    else "stop: rollback budget spent", detected_at=report.time, step=step,
                    fatal=within)
    if not within:
        return SegmentFailed(f"training diverged {len(rollbacks)} times (max_rollbacks "
                             f"{supervisor.policy.max_rollbacks}); last at step {step + 1}: {reason}. "
                             "Lower the learning rate or inspect the skipped samples (job record: divergence)",
                             "user", report.rank)
    return SegmentFailed(f"divergence at step {step + 1} ({reason}): rolling back to the last "
                         f"committed checkpoint, skipping samples {samples}", "divergence", report.rank)
