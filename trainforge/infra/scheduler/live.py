"""The live scheduler: the pure policy over state kept in a database (SQLite in $TRAINFORGE_HOME by default,
PostgreSQL in production), safe under many concurrent requesters.

Every operation is one short write transaction that rebuilds the policy from the tables, applies the event, runs
a scheduling pass and writes back what changed. Writers are serialized by the database: `BEGIN IMMEDIATE` on
SQLite, a `SELECT ... FOR UPDATE` on a lock row elsewhere. So two requesters can never both see a GPU free.

No request is lost to contention. Inside one process the writers of a database queue on a first-come first-served
lock before they open their transaction: SQLite's busy handler is sleep-and-retry, not a queue, and with 32
threads polling, one of them waited 31 s for `BEGIN IMMEDIATE` while the others took turns (measured), long enough
under load to reach the busy timeout, raise "database is locked" and kill that requester's thread with its gangs.
A transaction that still meets contention (another process, a PostgreSQL deadlock or serialization failure) is
rolled back and run again from the start; only when the database stays busy past `busy_timeout_s` does the
operation raise `SchedulerBusy`, which names the database. Tables are created under a lock too (concurrent
`CREATE TABLE` on PostgreSQL fails with a duplicate key in its catalog).

The flow's provision task calls `request(GangRequest, timeout_s)`, which blocks (polling with a bounded backoff)
until the gang is admitted (`submit` + `poll` without blocking), `checkpointed(job_id)` at each commit, and
`release(job_id, outcome)` when the job completes, fails or stops for a preemption.

The live path learns as the simulator does (one policy, one estimator): the runtimes of completed jobs are kept in
the database (`sched_history`: they survive a restart of the control plane) and each request's runtime estimate
comes from them (`RuntimeHistory`: the user's similar jobs first, then the team's, then everyone's; never past the
job's own `max_runtime`); each job's checkpoint interval is learned from the commits it reports, so a starving gang
preempts a victim at the victim's next checkpoint boundary (`preempt_at` in its status), not "checkpoint now".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa

from trainforge.infra.scheduler.estimates import RuntimeHistory
from trainforge.infra.scheduler.model import (
    Boost,
    Job,
    JobRequest,
    JobState,
    Placement,
    SchedulerConfig,
    TeamPolicy,
    priority_name,
)
from trainforge.infra.scheduler.placement import compute_quality
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import ClusterState
from trainforge.plan.cluster import ClusterSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class GangRequest:
    job_id: str
    team: str
    priority: str = "normal"
    gpu_type: str = "any"
    """A GPU type of the cluster, several joined by `|`, or `any`; the job always gets one type."""
    num_gpus: int
    gpus_per_node: int | None = None
    """None = placement chooses (fewest nodes, a multiple of tp)."""
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    """None = num_gpus / (tp * pp)."""
    max_runtime_s: float | None = None
    """The job's limit (it is stopped there). The scheduler's estimate is the learned runtime of similar jobs,
    never more than this; with neither, `RuntimeHistory.default_s`."""
    min_gpus: int | None = None
    """Elastic jobs: the smallest size they accept (None = not elastic)."""
    checkpoint_interval_s: float | None = None
    """None (the flow's): learned from the commits the job reports (`checkpointed`)."""
    user: str = ""
    """Who submitted it (estimates look at the user's own jobs first)."""

    def __post_init__(self) -> None:
        if self.dp is not None and self.dp * self.tp * self.pp != self.num_gpus:
            raise ValueError(f"job {self.job_id}: dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = "
                             f"{self.dp * self.tp * self.pp} != num_gpus ({self.num_gpus})")
        if self.max_runtime_s is not None and not self.max_runtime_s > 0:
            raise ValueError(f"job {self.job_id}: max_runtime_s ({self.max_runtime_s}) must be > 0")
        self.to_job_request(self.max_runtime_s or 1.0)  # validates

    def to_job_request(self, estimate_s: float) -> JobRequest:
        """The policy's request, with the runtime estimate the scheduler made for it."""
        return JobRequest(job_id=self.job_id, team=self.team, priority=self.priority, gpu_type=self.gpu_type,
                          num_gpus=self.num_gpus, min_gpus=self.min_gpus, gpus_per_node=self.gpus_per_node,
                          tp=self.tp, pp=self.pp, max_runtime_s=estimate_s,
                          checkpoint_interval_s=self.checkpoint_interval_s, user=self.user)


@dataclass(frozen=True, slots=True)
class Allocation:
    job_id: str
    gpu_type: str
    nodes: list[tuple[str, list[int]]]
    """(node name, GPU indices), in rank order."""
    quality: dict[str, int] = field(default_factory=dict)
    """num_nodes, num_racks, tp_groups_spanning_nodes (0), pp_groups_spanning_racks, ..."""

    @property
    def num_gpus(self) -> int:
        return sum(len(g) for _, g in self.nodes)


class SchedulingTimeout(TimeoutError):
    """The gang was not admitted within the timeout; the message says why it still waits."""

    def __init__(self, job_id: str, timeout_s: float, reason: str, position: int, queued: int):
        self.job_id, self.reason, self.position = job_id, reason, position
        super().__init__(f"job {job_id} not admitted after {timeout_s:g}s: {reason} (position {position} of "
                         f"{queued} pending); the request was withdrawn, submit again to re-queue")


class SchedulerBusy(RuntimeError):
    """The scheduler's database stayed locked by other writers for longer than `busy_timeout_s`."""


class _FifoLock:
    """A lock granted in arrival order: the waiter that came first is handed the lock by the releaser, so no
    writer of this process starves (threading.Lock and SQLite's busy handler let a newcomer overtake)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held = False
        self._waiters: deque[threading.Event] = deque()

    def acquire(self, timeout: float) -> bool:
        with self._guard:
            if not self._held and not self._waiters:
                self._held = True
                return True
            turn = threading.Event()
            self._waiters.append(turn)
        turn.wait(max(0.0, timeout))
        with self._guard:
            if turn.is_set():  # handed over (possibly just after the wait timed out): we hold it
                return True
            self._waiters.remove(turn)
            return False

    def release(self) -> None:
        with self._guard:
            if self._waiters:
                self._waiters.popleft().set()  # hand over: _held stays True
            else:
                self._held = False


_writers_guard = threading.Lock()
_writers: dict[str, _FifoLock] = {}


def _database_key(url: sa.URL) -> str:
    if url.get_backend_name() == "sqlite":
        return f"sqlite:{os.path.realpath(url.database or '')}"
    return url.render_as_string(hide_password=True)


def _writer_lock(key: str) -> _FifoLock:
    """The process-wide writer queue of one database (every LiveScheduler on it shares it). Looked up per
    transaction, not kept: after a fork the child gets fresh queues, also for the schedulers it inherited."""
    with _writers_guard:
        return _writers.setdefault(key, _FifoLock())


def _reset_writer_locks() -> None:
    # a child forked while another thread held a writer lock would otherwise inherit it held, forever
    global _writers_guard, _writers
    _writers_guard, _writers = threading.Lock(), {}


os.register_at_fork(after_in_child=_reset_writer_locks)

# PostgreSQL: serialization_failure, deadlock_detected, lock_not_available; SQLite: "database is locked" (the
# busy timeout ran out). Each means the transaction was rolled back having done nothing, so it may run again.
_PG_RETRY_CODES = frozenset({"40001", "40P01", "55P03"})


def _is_contention(exc: sa.exc.DBAPIError) -> bool:
    if getattr(exc.orig, "pgcode", None) in _PG_RETRY_CODES:
        return True
    return isinstance(exc, sa.exc.OperationalError) and "is locked" in str(exc.orig)


T = TypeVar("T")

_meta = sa.MetaData()
JOBS = sa.Table(
    "sched_jobs", _meta,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("team", sa.String(200), nullable=False),
    sa.Column("priority", sa.String(20), nullable=False),
    sa.Column("submit_time", sa.Float, nullable=False),
    sa.Column("runtime", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False, default=""),
    sa.Column("last_seen", sa.Float, nullable=False),
)
NODES = sa.Table(
    "sched_nodes", _meta,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("healthy", sa.Boolean, nullable=False),
)
HISTORY = sa.Table(
    "sched_history", _meta,
    sa.Column("job_id", sa.String(200), primary_key=True),
    sa.Column("team", sa.String(200), nullable=False, index=True),
    sa.Column("user", sa.String(200), nullable=False),
    sa.Column("num_gpus", sa.Integer, nullable=False),
    sa.Column("size_class", sa.Integer, nullable=False),
    sa.Column("gpu_seconds", sa.Float, nullable=False),  # held so far, over every run (a preempted job runs again)
    sa.Column("ended_at", sa.Float, nullable=True, index=True),  # when it completed; NULL while it has not
    sa.Column("runtime_s", sa.Float, nullable=True),  # gpu_seconds / num_gpus at completion: runtime at full size
)
META = sa.Table(
    "sched_meta", _meta,
    sa.Column("key", sa.String(50), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),
)


_READ_ONLY = "trainforge_read_only"


def _engine(url: str, attempt_s: float = 10.0) -> sa.Engine:
    if not url.startswith("sqlite"):
        return sa.create_engine(url, pool_pre_ping=True)
    # SQLite's busy timeout bounds one attempt; LiveScheduler retries a locked attempt until its busy_timeout_s.
    engine = sa.create_engine(url, connect_args={"timeout": attempt_s, "check_same_thread": False})

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None  # let the "begin" hook issue BEGIN IMMEDIATE itself
        dbapi_conn.execute("PRAGMA journal_mode=WAL")
        dbapi_conn.execute(f"PRAGMA busy_timeout={int(attempt_s * 1000)}")

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        # readers (queue, status) take no write lock: under WAL they read a snapshot beside the writer
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(_READ_ONLY) else "BEGIN IMMEDIATE")

    return engine


class LiveScheduler:
    def __init__(self, cluster: ClusterSpec, db_url: str | None = None, *,
                 teams: dict[str, TeamPolicy] | None = None, config: SchedulerConfig | None = None,
                 stale_after_s: float = 300.0, busy_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.time, history: RuntimeHistory | None = None):
        if db_url is None:
            from trainforge.home import home

            db_url = f"sqlite:///{home() / 'scheduler.db'}"
        self.cluster = cluster
        self.teams = teams
        self.config = config or SchedulerConfig()
        self.stale_after_s = stale_after_s
        self.busy_timeout_s = busy_timeout_s
        """How long an operation keeps retrying a database locked by other writers before SchedulerBusy."""
        self.clock = clock
        """The policy's time (wall clock; a test replaying a simulation gives the simulation's)."""
        self.history = history or RuntimeHistory()
        """The estimator's settings; what it learned is read from `sched_history` at each submit."""
        self.engine = _engine(db_url, attempt_s=min(10.0, busy_timeout_s / 4))
        self._sqlite = db_url.startswith("sqlite")
        self._db_key = _database_key(self.engine.url)
        self._attempt("create the scheduler tables", self._create_tables)

    def _create_tables(self, conn: sa.Connection) -> None:
        if self.engine.dialect.name == "postgresql":
            # CREATE TABLE IF NOT EXISTS is not atomic there: two creators collide in pg_type; so is the lock row
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(7463207)"))
        _meta.create_all(conn)
        if conn.execute(sa.select(META.c.key).where(META.c.key == "lock")).first() is None:
            conn.execute(META.insert().values(key="lock", value=0))

    # -- transactions -------------------------------------------------------------------------------------
    def _attempt(self, what: str, body: Callable[[sa.Connection], T]) -> T:
        """Run `body` in one write transaction, after this process's earlier writers; a transaction that meets
        contention did nothing and is run again, until `busy_timeout_s`, then SchedulerBusy."""
        deadline = time.monotonic() + self.busy_timeout_s
        pause = 0.01
        while (writer := _writer_lock(self._db_key)).acquire(deadline - time.monotonic()):
            try:
                with self.engine.begin() as conn:
                    return body(conn)
            except sa.exc.DBAPIError as exc:
                if not _is_contention(exc):
                    raise
                logger.info("scheduler database busy (%s), retrying: %s", what, exc.orig)
            finally:
                writer.release()
            if time.monotonic() >= deadline:
                break
            time.sleep(pause * random.uniform(0.5, 1.5))  # another process holds it: let it finish
            pause = min(pause * 2, 0.5)
        raise SchedulerBusy(f"could not {what}: the scheduler database {self.engine.url.render_as_string()} "
                            f"stayed locked by other writers for {self.busy_timeout_s:g}s (busy_timeout_s); "
                            f"nothing was changed: call again, or find the process that holds it")

    def _tx(self, what: str, body: Callable[[sa.Connection, Scheduler], T]) -> T:
        """Rebuild the policy from the tables, apply `body`, write back what changed: one transaction. `body` may
        run more than once (a retried transaction), so it does nothing outside the database."""

        def run(conn: sa.Connection) -> T:
            if not self._sqlite:
                conn.execute(sa.select(META.c.value).where(META.c.key == "lock").with_for_update())
            sched, rows = self._load(conn)
            out = body(conn, sched)
            self._save(conn, sched, rows)
            return out

        return self._attempt(what, run)

    def _load(self, conn: sa.Connection) -> tuple[Scheduler, dict[str, dict[str, Any]]]:
        state = ClusterState.from_spec(self.cluster)
        for name, healthy in conn.execute(sa.select(NODES.c.name, NODES.c.healthy)):
            if name in state.by_name and not healthy:
                state.set_healthy(state.by_name[name], False)
        sched = Scheduler(state, self.teams, self.config)
        rows = {r.job_id: dict(r._mapping) for r in conn.execute(sa.select(JOBS).order_by(JOBS.c.seq))}
        jobs = [self._job_from_row(state, r) for r in rows.values()]
        for job in sorted(jobs, key=lambda j: (j.state is JobState.PENDING, j.seq)):
            sched.adopt(job)
        return sched, rows

    def _save(self, conn: sa.Connection, sched: Scheduler, rows: dict[str, dict[str, Any]]) -> None:
        now = self.clock()
        for job_id in rows.keys() - sched.jobs.keys():
            conn.execute(JOBS.delete().where(JOBS.c.job_id == job_id))
        for job_id, job in sched.jobs.items():
            new = self._row_from_job(sched.state, job)
            old = rows.get(job_id)
            if old is None:
                conn.execute(JOBS.insert().values(**new, last_seen=now))
            elif any(old[k] != v for k, v in new.items()):
                conn.execute(JOBS.update().where(JOBS.c.job_id == job_id).values(**new))

    @staticmethod
    def _placement_json(state: ClusterState, pl: Placement | None) -> Any:
        if pl is None:
            return None
        return {"gpu_type": pl.gpu_type, "nodes": [[state.nodes[n].name, list(g)] for n, g in pl.assignments]}

    @staticmethod
    def _placement_from(state: ClusterState, data: Any, req: JobRequest) -> Placement | None:
        if data is None:
            return None
        assignments = tuple((state.by_name[name], tuple(g)) for name, g in data["nodes"])
        return Placement(data["gpu_type"], assignments, compute_quality(state, assignments, req.tp, req.pp))

    def _row_from_job(self, state: ClusterState, job: Job) -> dict[str, Any]:
        runtime = {
            "boost": int(job.boost), "placement": self._placement_json(state, job.placement),
            "planned": self._placement_json(state, job.planned), "waiting_on": sorted(job.waiting_on),
            "start_time": _num(job.start_time), "last_checkpoint": _num(job.last_checkpoint),
            "preempt_deadline": _num(job.preempt_deadline), "num_preemptions": job.num_preemptions,
            "num_requeues": job.num_requeues, "reserved_since": _num(job.reserved_since), "rank": job.rank,
            "last_commit": _num(job.last_commit), "checkpoint_every": _num(job.checkpoint_every),
            "preempt_at": _num(job.preempt_at),
            "room_retry_at": job.room_retry_at if math.isfinite(job.room_retry_at) else None,
        }
        return {"job_id": job.job_id, "seq": job.seq, "request": json.dumps(_request_dict(job.req)),
                "state": job.state.value, "team": job.req.team, "priority": job.req.priority,
                "submit_time": job.submit_time, "runtime": json.dumps(runtime, sort_keys=True),
                "reason": job.reason}

    def _job_from_row(self, state: ClusterState, row: dict[str, Any]) -> Job:
        req = JobRequest(**json.loads(row["request"]))
        rt = json.loads(row["runtime"])
        job = Job(req, row["submit_time"], row["seq"], state=JobState(row["state"]), boost=Boost(rt["boost"]))
        job.placement = self._placement_from(state, rt["placement"], req)
        job.planned = self._placement_from(state, rt["planned"], req)
        job.waiting_on = frozenset(rt["waiting_on"])
        job.start_time = _nan(rt["start_time"])
        job.last_checkpoint = _nan(rt["last_checkpoint"])
        job.preempt_deadline = _nan(rt["preempt_deadline"])
        job.num_preemptions, job.num_requeues = rt["num_preemptions"], rt["num_requeues"]
        job.reserved_since = _nan(rt.get("reserved_since"))  # rows written before standing reservations: none
        job.rank = rt.get("rank", req.rank)  # a critical job over its team's critical quota runs as high
        job.last_commit = _nan(rt.get("last_commit"))  # rows written before the live path learned: none
        job.checkpoint_every = _nan(rt.get("checkpoint_every"))
        job.preempt_at = _nan(rt.get("preempt_at"))
        job.room_retry_at = rt.get("room_retry_at") or -math.inf
        job.reason = row["reason"]
        return job

    def _expire_stale(self, conn: sa.Connection, sched: Scheduler, now: float, keep: str | None = None) -> None:
        stale = conn.execute(sa.select(JOBS.c.job_id).where(JOBS.c.state == JobState.PENDING.value,
                                                             JOBS.c.last_seen < now - self.stale_after_s))
        for (job_id,) in stale:
            if job_id != keep:
                logger.warning("dropping pending job %s: its requester stopped polling", job_id)
                sched.finish(job_id, now)

    # -- API ----------------------------------------------------------------------------------------------
    def submit(self, request: GangRequest) -> Allocation | None:
        """Queue the gang (or find it queued, e.g. a preemption victim that stopped) and run a pass: its allocation
        if admitted now, else None (then `poll` until it is: a requester that stops polling for `stale_after_s`
        is dropped from the queue)."""
        out = self._tx(f"request job {request.job_id}", lambda conn, sched: self._poll(conn, sched, request))
        assert not isinstance(out, SchedulingTimeout)
        return out

    def poll(self, job_id: str) -> Allocation | None:
        """A pass, then the job's allocation if it is admitted (None while it waits). KeyError if the scheduler does
        not know the job (dropped, released or never submitted)."""
        def body(conn: sa.Connection, sched: Scheduler) -> Allocation | None:
            if job_id not in sched.jobs:
                raise KeyError(f"job {job_id} is neither queued nor running in this scheduler")
            out = self._poll(conn, sched, job_id)
            assert not isinstance(out, SchedulingTimeout)
            return out

        return self._tx(f"poll job {job_id}", body)

    def _poll(self, conn: sa.Connection, sched: Scheduler, job: GangRequest | str,
              timeout_s: float | None = None) -> Allocation | SchedulingTimeout | None:
        """One pass inside a transaction, for one requester: a request (`GangRequest`) not known yet is submitted
        first; with `timeout_s`, a job the pass did not admit is withdrawn (SchedulingTimeout, returned)."""
        now = self.clock()
        if isinstance(job, GangRequest):
            request, job_id = job, job.job_id
            if job_id not in sched.jobs:
                self._expire_stale(conn, sched, now, keep=job_id)
                estimate = self._estimate(conn, request.team, request.user, request.num_gpus, request.max_runtime_s)
                sched.submit(request.to_job_request(estimate), now)
        else:
            job_id = job
        sched.schedule(now)
        mine = sched.jobs[job_id]
        conn.execute(JOBS.update().where(JOBS.c.job_id == job_id).values(last_seen=now))
        if mine.state is not JobState.PENDING:
            return self._allocation(sched.state, mine)
        if timeout_s is None:
            return None
        same = sched.queue_order(mine.req.gpu_type)
        position = next((i for i, j in enumerate(same, 1) if j is mine), len(same))
        reason = mine.reason
        sched.finish(job_id, now)  # withdrawn in the same transaction that decides the timeout
        return SchedulingTimeout(job_id, timeout_s, reason, position, len(same))

    def request(self, request: GangRequest, timeout_s: float, *, poll_s: float = 0.05,
                max_poll_s: float = 1.0) -> Allocation:
        """Queue the gang (or find it queued) and block until it is admitted, at most `timeout_s` seconds.
        Raises SchedulingTimeout (a TimeoutError) saying why it still waits; the request is then withdrawn."""
        deadline = time.monotonic() + timeout_s
        wait = poll_s

        def poll(conn: sa.Connection, sched: Scheduler) -> Allocation | SchedulingTimeout | None:
            late = timeout_s if time.monotonic() >= deadline else None
            return self._poll(conn, sched, request, late)  # queued again if it was dropped meanwhile

        while True:
            out = self._tx(f"request job {request.job_id}", poll)
            if isinstance(out, Allocation):
                return out
            if out is not None:
                raise out
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
            wait = min(wait * 2, max_poll_s)

    def schedule(self) -> None:
        """One pass with no event (what each waiting requester's poll runs): deadlines that passed, patience that
        ran out."""
        def body(_conn: sa.Connection, sched: Scheduler) -> None:
            sched.schedule(self.clock())

        self._tx("run a scheduling pass", body)

    def release(self, job_id: str, outcome: str = "ended") -> None:
        """Free the job's GPUs. `outcome`: `completed` (its runtime is learned), `stopped` (a preemption victim
        checkpointed and stopped: it waits again in its old place, its next `request` finds it queued) or `ended`
        (failed, cancelled: forgotten)."""
        if outcome not in RELEASE_OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; use one of {', '.join(RELEASE_OUTCOMES)}")

        def body(conn: sa.Connection, sched: Scheduler) -> None:
            now = self.clock()
            job = sched.jobs.get(job_id)
            if job is not None:
                self._account(conn, job, now, completed=outcome == "completed")
                if outcome == "stopped" and job.state is JobState.PREEMPTING:
                    sched.stopped(job_id, now)  # pending again: seen now, or the next submit drops it as stale
                    conn.execute(JOBS.update().where(JOBS.c.job_id == job_id).values(last_seen=now))
                else:
                    sched.finish(job_id, now)
            sched.schedule(now)

        self._tx(f"release job {job_id}", body)

    # -- what the live path learns ------------------------------------------------------------------------
    def _account(self, conn: sa.Connection, job: Job, now: float, *, completed: bool) -> None:
        """Add the GPU-seconds of the job's run that ends now to its history row; at completion its runtime at
        full size (GPU-seconds / requested GPUs: an elastic job that ran smaller took longer) is learned."""
        held = job.gpus * max(0.0, now - job.start_time) if job.state is not JobState.PENDING else 0.0
        req = job.req
        if not held and not completed:
            return  # withdrawn before it ran: nothing to learn
        row = conn.execute(sa.select(HISTORY.c.gpu_seconds).where(HISTORY.c.job_id == req.job_id)).first()
        total = (row.gpu_seconds if row else 0.0) + held
        values: dict[str, Any] = {"gpu_seconds": total}
        if completed:
            values.update(ended_at=now, runtime_s=total / req.num_gpus)
        if row is None:
            size = RuntimeHistory.size_class(req.num_gpus)
            conn.execute(HISTORY.insert().values(job_id=req.job_id, team=req.team, user=req.user,
                                                 num_gpus=req.num_gpus, size_class=size, **values))
        else:
            conn.execute(HISTORY.update().where(HISTORY.c.job_id == req.job_id).values(**values))

    def _estimate(self, conn: sa.Connection, team: str, user: str, num_gpus: int,
                  max_runtime_s: float | None) -> float:
        """The estimator as the simulator's would stand had it seen the same jobs end: for each of its scopes for
        this request, that scope's most recent completed runtimes (its window), observed in the order they ended."""
        h = HISTORY.c
        rows: dict[str, tuple[float, str, float, str, str, int]] = {}
        for scope in RuntimeHistory.scopes(team, user, num_gpus):
            q = (sa.select(h.ended_at, h.job_id, h.runtime_s, h.team, h.user, h.num_gpus)
                 .where(h.ended_at.is_not(None), *(h[k] == v for k, v in scope.items()))
                 .order_by(h.ended_at.desc(), h.job_id.desc()).limit(self.history.window))
            for r in conn.execute(q):
                rows[r.job_id] = tuple(r)
        learned = dataclasses.replace(self.history, _runs={})
        for _, _, runtime_s, t, u, g in sorted(rows.values()):
            learned.observe(team=t, user=u, num_gpus=g, runtime_s=runtime_s)
        return learned.estimate(team=team, user=user, num_gpus=num_gpus, max_runtime_s=max_runtime_s)

    def estimate(self, team: str, user: str, num_gpus: int, max_runtime_s: float | None = None) -> float:
        """The runtime estimate a request like this would get now (read-only)."""
        with self.engine.connect().execution_options(**{_READ_ONLY: True}) as conn:
            return self._estimate(conn, team, user, num_gpus, max_runtime_s)

    def policy(self) -> Scheduler:
        """The policy as the next transaction will see it, rebuilt from the tables (read-only: a copy)."""
        with self.engine.connect().execution_options(**{_READ_ONLY: True}) as conn:
            return self._load(conn)[0]

    def status(self, job_id: str) -> dict[str, Any] | None:
        """The job's row: state (`preempting` means checkpoint now and release before `preempt_deadline`)."""
        return next((r for r in self.queue() if r["job_id"] == job_id), None)

    def checkpointed(self, job_id: str) -> None:
        """The job committed a checkpoint (the flow reports each): its work since then is what a preemption loses,
        and the gaps between commits are its checkpoint interval."""
        self._tx(f"record a checkpoint of job {job_id}", lambda _conn, sched: sched.checkpointed(job_id, self.clock()))

    def node_failed(self, node: str, reason: str = "node failure") -> None:
        def body(conn: sa.Connection, sched: Scheduler) -> None:
            now = self.clock()
            sched.fail_node(node, now, reason)
            self._set_node(conn, node, False)
            sched.schedule(now)

        self._tx(f"mark node {node} failed", body)

    def node_restored(self, node: str) -> None:
        def body(conn: sa.Connection, sched: Scheduler) -> None:
            sched.restore_node(node)
            self._set_node(conn, node, True)
            sched.schedule(self.clock())

        self._tx(f"mark node {node} restored", body)

    def _set_node(self, conn: sa.Connection, node: str, healthy: bool) -> None:
        conn.execute(NODES.delete().where(NODES.c.name == node))
        conn.execute(NODES.insert().values(name=node, healthy=healthy))

    def queue(self) -> list[dict[str, Any]]:
        """Running and pending jobs, per team, with why each pending job waits (read-only)."""
        now = self.clock()
        with self.engine.connect().execution_options(**{_READ_ONLY: True}) as conn:
            sched, by_id = self._load(conn)  # the policy, for the positions of the pending jobs
            rows = sorted(by_id.values(), key=lambda r: (r["team"], r["seq"]))
        positions = {j.job_id: i for cls in {j.req.gpu_type for j in sched.pending()}
                     for i, j in enumerate(sched.queue_order(cls), 1)}
        out = []
        for r in rows:
            req, rt = json.loads(r["request"]), json.loads(r["runtime"])
            pl = rt["placement"]
            running = r["state"] != JobState.PENDING.value
            out.append({
                "job_id": r["job_id"], "team": r["team"], "priority": r["priority"],
                "scheduled_as": priority_name(sched.jobs[r["job_id"]].rank), "state": r["state"],
                "gpu_type": pl["gpu_type"] if pl else req["gpu_type"],
                "gpus": sum(len(g) for _, g in pl["nodes"]) if pl else req["num_gpus"],
                "nodes": len(pl["nodes"]) if pl else 0,
                "since_s": round(now - (rt["start_time"] if running and rt["start_time"] else r["submit_time"]), 1),
                "reason": "" if r["state"] == JobState.RUNNING.value else r["reason"],
                "preempt_deadline": rt["preempt_deadline"],
                "preempt_at": rt.get("preempt_at"),
                "estimate_s": req["max_runtime_s"],
                "checkpoint_every_s": rt.get("checkpoint_every"),
                "position": positions.get(r["job_id"]),
            })
        return out

    def _allocation(self, state: ClusterState, job: Job) -> Allocation:
        pl = job.placement
        return Allocation(job.job_id, pl.gpu_type, [(state.nodes[n].name, list(g)) for n, g in pl.assignments],
                          pl.quality.to_dict())


RELEASE_OUTCOMES = ("completed", "stopped", "ended")


def _request_dict(req: JobRequest) -> dict[str, Any]:
    return {k: getattr(req, k) for k in req.__slots__}


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def _nan(x: float | None) -> float:
    return math.nan if x is None else x
