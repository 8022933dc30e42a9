"""The Python SDK: submit a job spec and follow the job from code, as the CLI does (the CLI is a layer over this).

    from trainforge import submit
    job = submit("examples/tiny-cpu.yaml", overrides={"training.max_steps": 20})
    print(job.status, job.metrics()[-1].loss, job.logs(rank=0)[-500:])

`submit` validates the spec (with its overrides applied) before anything starts and raises `SpecError` naming every
problem. Then, by backend:
  local       the train-job flow in this process (returns when the job ended), or with `detach=True` in a
              background process of this host (returns at once; its pid is recorded so `Job.cancel` stops it);
  deployment  a run of the `train-job/train-job` Prefect deployment (needs a Prefect server and a worker on the
              `trainforge` pool); the job id is chosen here, so `get_job` finds it once the worker starts it.
A `Job` reads what the job wrote in its folder ($TRAINFORGE_HOME/jobs/<id>/: job.json, events.jsonl, logs/), so
`get_job(id)` in another process sees the same job. Detached controllers keep their pid, submission and output
under $TRAINFORGE_HOME/detached/<id>/ (the job folder is the flow's to create).

Heavy modules (prefect, the flow, torch through it) are imported only when a job is run or cancelled.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainforge.contract.events import Metrics
from trainforge.home import home
from trainforge.spec import JobSpec, Problem, SpecError

Backend = Literal["local", "deployment"]
BACKENDS: tuple[str, ...] = ("local", "deployment")
DEPLOYMENT = "train-job/train-job"
FINAL_STATES = ("completed", "failed", "cancelled")
POLL_S = 0.5
EPHEMERAL_STARTUP_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_STARTUP_S = 120
EMBEDDED_SERVER_ENV = {
    # Without a Prefect server the flow starts a temporary one, which Prefect gives 20 s to come up: a fresh
    # PREFECT_HOME's database migrations alone took 20.6 s on a 2-core host, and the job failed before it began.
    EPHEMERAL_STARTUP_ENV: str(EPHEMERAL_STARTUP_S),
    # Its telemetry service posts to prefect.io and logs an ERROR where there is no internet; analytics also made
    # spurious "database is locked" errors on SQLite. DO_NOT_TRACK turns off the client's own usage events.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
}

# Prefect's state names -> the job's states (a deployment run whose job record is on another host).
_PREFECT_STATES = {"SCHEDULED": "pending", "PENDING": "pending", "RUNNING": "running", "COMPLETED": "completed",
                   "FAILED": "failed", "CRASHED": "failed", "CANCELLED": "cancelled", "CANCELLING": "running",
                   "PAUSED": "running"}


class JobNotFound(LookupError):
    """No job with this id (or name) in this $TRAINFORGE_HOME."""


# ------------------------------------------------------------------ overrides


def parse_overrides(overrides: Mapping[str, Any] | Iterable[str] | None) -> list[tuple[str, Any]]:
    """`{"training.max_steps": 20}` or `["training.max_steps=20"]` (the CLI's --set) as (dotted key, value) pairs.
    A string value is read as YAML, as in the spec file: `20` is an int, `true` a bool, `[1, 2]` a list."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    pairs = []
    for item in overrides:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError([Problem(key or str(item), "an override is KEY=VALUE with a dotted key", item,
                                     "e.g. --set training.max_steps=100")], "--set")
        try:
            value = yaml.safe_load(text) if text.strip() else text
        except yaml.YAMLError as exc:
            raise SpecError([Problem(key, f"the value is not valid YAML ({exc.problem})", text,
                                     "quote it, e.g. --set 'name=\"my job\"'")], "--set") from None
        pairs.append((key, value))
    return pairs


def apply_overrides(doc: Any, overrides: Mapping[str, Any] | Iterable[str] | None) -> Any:
    """A copy of the spec document with each dotted key set (missing mappings are created; the validation that
    follows judges the result like the file, so an unknown key or a bad value is reported under its own key)."""
    return _apply(doc, parse_overrides(overrides))


def _apply(doc: Any, pairs: list[tuple[str, Any]]) -> Any:
    if not pairs:
        return doc
    if not isinstance(doc, dict):
        raise SpecError([Problem("<spec>", "the spec is not a mapping, so it has no keys to override", None,
                                 "fix the spec file first")], "--set")
    out = json.loads(json.dumps(doc, default=str))  # a deep copy of plain data
    for key, value in pairs:
        parts = key.split(".")
        node: Any = out
        for depth, part in enumerate(parts[:-1]):
            here = ".".join(parts[:depth + 1])
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict):
                if node.get(part) is None:
                    node[part] = {}
                node = node[part]
            else:
                raise SpecError([Problem(key, f"{'.'.join(parts[:depth]) or 'the spec'} is "
                                              f"{type(node).__name__}, not a mapping: it has no field {part!r}",
                                         value, f"check the key against `trainforge schema` (at {here})")], "--set")
            if not isinstance(node, dict | list):
                raise SpecError([Problem(key, f"{here} is a {type(node).__name__} value, not a mapping: it has no "
                                              f"field {parts[depth + 1]!r}", value,
                                         "check the key against `trainforge schema`")], "--set")
        last = parts[-1]
        if isinstance(node, list):
            if not (last.isdigit() and int(last) < len(node)):
                raise SpecError([Problem(key, f"{'.'.join(parts[:-1])} is a list of {len(node)}: {last!r} is not "
                                              "an index of it", value, "use an index from 0")], "--set")
            node[int(last)] = value
        else:
            node[last] = value
    return out


# ------------------------------------------------------------------ submission


@dataclass
class Submission:
    """A validated job, ready to run: the document (overrides applied), where it came from, its validation."""

    doc: Any
    source: str
    base_dir: str
    job_id: str
    resume: bool
    report: Any  # trainforge.validate.ValidationReport

    @property
    def spec(self) -> JobSpec:
        return self.report.spec


def prepare(spec_or_path: str | Path | Mapping[str, Any] | JobSpec | None, *,
            overrides: Mapping[str, Any] | Iterable[str] | None = None, job_id: str | None = None,
            resume: str | None = None) -> Submission:
    """Read, override and validate a spec (a file, a parsed document or a JobSpec) and choose the job id. Raises
    SpecError with every problem. `resume`: continue that job (its stored spec when `spec_or_path` is None)."""
    from trainforge.registry.jobs import JobStore, new_job_id
    from trainforge.spec import read_document  # looked up at call time (tests count the reads)
    from trainforge.validate import validate_document

    base_dir = Path.cwd()
    if spec_or_path is None:
        if not resume:
            raise ValueError("give a job spec (a file, a document or a JobSpec), or resume=JOB_ID")
        record = _store_get(resume)
        resume = record.job_id
        source = record.data.get("source", "<spec>")
        stored = Path(source)
        if stored.parent.is_dir() and source != "<spec>":
            base_dir = stored.resolve().parent
        if record.data.get("spec") is not None:  # the very document it ran (overrides included)
            doc = record.data["spec"]
        elif stored.is_file():
            doc = read_document(stored)
        else:
            raise ValueError(f"the spec file of job {resume} ({source}) is gone; pass it: "
                             f"submit(SPEC, resume={resume!r})")
    elif isinstance(spec_or_path, str | Path):
        path = Path(spec_or_path)
        doc, source, base_dir = read_document(path), str(path), path.resolve().parent
    elif isinstance(spec_or_path, JobSpec):
        doc, source = spec_or_path.model_dump(mode="json", exclude_none=True), "<JobSpec>"
    elif isinstance(spec_or_path, Mapping):
        doc, source = dict(spec_or_path), "<spec>"
    else:
        raise TypeError(f"submit() takes a spec file path, a spec document (dict) or a JobSpec, not "
                        f"{type(spec_or_path).__name__}")
    pairs = parse_overrides(overrides)
    doc = _apply(doc, pairs)
    # Problems are reported against the file and its overrides; the job records the file itself.
    label = source + (f" (with {', '.join(k + '=' + json.dumps(v, default=str) for k, v in pairs)})" if pairs else "")
    report = validate_document(doc, label, base_dir)
    if not report.ok():
        raise SpecError(report.errors(), label, report.unreadable)
    if resume:
        JobStore().get(resume)  # a resume names a job that exists (LookupError otherwise)
    return Submission(doc, source, str(base_dir), resume or job_id or new_job_id(report.spec.name), bool(resume),
                      report)


def submit(spec_or_path: str | Path | Mapping[str, Any] | JobSpec | None, *, backend: Backend = "local",
           detach: bool = False, overrides: Mapping[str, Any] | Iterable[str] | None = None,
           job_id: str | None = None, resume: str | None = None) -> Job:
    """Validate and start a job; returns its `Job`. Not detached, the local backend returns when the job ended
    (`job.status` says how; a failure does not raise: `job.error` says why); detached, or through the deployment,
    it returns once the job is started. An invalid spec raises SpecError before anything starts."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: use one of {', '.join(BACKENDS)} (the kubernetes backend is "
                         "`trainforge submit --backend kubernetes`)")
    sub = prepare(spec_or_path, overrides=overrides, job_id=job_id, resume=resume)
    return launch(sub, backend=backend, detach=detach)


def launch(sub: Submission, *, backend: Backend = "local", detach: bool = False) -> Job:
    """Start a prepared submission (see `submit`)."""
    if backend == "deployment":
        job = _trigger_deployment(sub)
        if not detach:
            job.wait()
        return job
    if detach:
        return _start_detached(sub)
    return run_here(sub)


def run_flow(sub: Submission) -> dict[str, Any]:
    """The train-job flow in this process, reusing the submission's validation; its result, or what it raised."""
    for key, value in EMBEDDED_SERVER_ENV.items():  # read by the temporary server Prefect starts (a child process)
        os.environ.setdefault(key, value)
    from trainforge.flows.train_job import reusing_validation, train_job

    with reusing_validation(sub.report):  # validated here already: the flow does not validate it again
        return train_job(sub.doc, sub.source, sub.base_dir, sub.job_id, sub.resume)


def run_here(sub: Submission) -> Job:
    """The train-job flow in this process, as a Job (a failure is its state, not an exception). Ctrl-C
    (KeyboardInterrupt) stops every worker, records the job cancelled and is raised again."""
    job = Job(sub.job_id)
    try:
        job._result = run_flow(sub)
    except KeyboardInterrupt:
        job._outcome = ("cancelled", "cancelled by KeyboardInterrupt (Ctrl-C)")
        raise
    except Exception as exc:  # the job failed: said by the Job, as for a detached one
        job._outcome = ("failed", str(exc))
    return job


def _trigger_deployment(sub: Submission) -> Job:
    from prefect.deployments import run_deployment

    run = run_deployment(DEPLOYMENT, parameters={"spec": sub.doc, "source": sub.source, "base_dir": sub.base_dir,
                                                 "job_id": sub.job_id, "resume": sub.resume}, timeout=0)
    return Job(sub.job_id, flow_run_id=str(run.id))


def detached_dir(job_id: str) -> Path:
    return home() / "detached" / job_id


def _prefect_api_url() -> str | None:
    """The Prefect API this process uses, when it has one (a server, or a test harness): the background job
    reports to the same API, so the caller sees its flow run and can cancel it there."""
    if "prefect" not in sys.modules:
        return None
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().api.url
    except Exception:
        return None


def _start_detached(sub: Submission) -> Job:
    import psutil

    folder = detached_dir(sub.job_id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "submission.json").write_text(json.dumps(
        {"doc": sub.doc, "source": sub.source, "base_dir": sub.base_dir, "job_id": sub.job_id,
         "resume": sub.resume}, default=str))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    api = _prefect_api_url()
    if api and not env.get("PREFECT_API_URL"):
        env["PREFECT_API_URL"] = api
    with open(folder / "controller.log", "ab") as out:
        # Its own session: a Ctrl-C in the submitting terminal does not reach it; `Job.cancel` does.
        proc = subprocess.Popen([sys.executable, "-m", "trainforge.sdk", str(folder / "submission.json")],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=os.getcwd())
    try:
        started = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        started = None
    _write_json(folder / "process.json", {"pid": proc.pid, "create_time": started, "started_at": time.time()})
    job = Job(sub.job_id)
    job._popen = proc
    return job


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def _store_get(job_id: str) -> Any:
    from trainforge.registry.jobs import JobStore

    try:
        return JobStore().get(job_id)
    except LookupError as exc:
        raise JobNotFound(str(exc)) from None


# ------------------------------------------------------------------ jobs


def get_job(job_id: str) -> Job:
    """The job with this id (or the newest job of this name); JobNotFound otherwise. A detached job that has not
    created its record yet is found by its full id."""
    try:
        return Job(_store_get(job_id).job_id)
    except JobNotFound:
        if (detached_dir(job_id) / "process.json").is_file():
            return Job(job_id)
        raise


@dataclass
class Job:
    """A submitted job, read from its folder each time (another process may be running it)."""

    id: str
    flow_run_id: str | None = None
    _result: dict[str, Any] | None = field(default=None, repr=False)
    _outcome: tuple[str, str] | None = field(default=None, repr=False)  # in-process end before any record
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    # -- where it is

    def record(self) -> Any | None:
        """The job's record (trainforge.registry.jobs.JobRecord), None before the flow created it."""
        from trainforge.registry.jobs import JobStore

        path = JobStore().root / self.id / "job.json"
        if not path.is_file():
            return None
        return JobStore().get(self.id)

    @property
    def folder(self) -> Path:
        from trainforge.registry.jobs import JobStore

        return JobStore().root / self.id

    def _process(self) -> dict[str, Any] | None:
        path = detached_dir(self.id) / "process.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _controller_alive(self, info: dict[str, Any]) -> bool:
        if self._popen is not None:
            self._popen.poll()  # reap our own child: a zombie is not alive
        import psutil

        from trainforge.infra.procs import pid_alive

        pid = info.get("pid")
        if not pid_alive(pid):
            return False
        try:  # the same process, not a later one that got its pid
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return False
        return info.get("create_time") is None or abs(created - info["create_time"]) < 1.0

    # -- what it is doing

    @property
    def status(self) -> str:
        """pending / running / completed / failed / cancelled. A detached job whose controller process is gone
        while its record says otherwise is failed (the controller's output: `Job.error`)."""
        if self._outcome is not None and self.record() is None:
            return self._outcome[0]
        record = self.record()
        info = self._process()
        if record is not None:
            state = record.data.get("state", "pending")
            if state not in FINAL_STATES and info is not None and not self._controller_alive(info):
                time.sleep(0.2)  # the controller may have written its last state just as it exited
                record.reload()
                state = record.data.get("state", state)
                if state not in FINAL_STATES:
                    return "failed"
            return state
        if info is not None:
            return "pending" if self._controller_alive(info) else "failed"
        if self.flow_run_id:
            return self._prefect_state()
        return "pending"

    def _prefect_state(self) -> str:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.flow_run_id).state
        return _PREFECT_STATES.get(state.type.value if state is not None else "PENDING", "pending")

    @property
    def done(self) -> bool:
        return self.status in FINAL_STATES

    @property
    def error(self) -> str | None:
        """Why the job failed or was cancelled (the record's error, else the controller's last output lines)."""
        record = self.record()
        if record is not None and record.data.get("error"):
            return record.data["error"]
        if self._outcome is not None:
            return self._outcome[1]
        log = detached_dir(self.id) / "controller.log"
        if self.status == "failed" and log.is_file():
            return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) or None
        return None

    @property
    def result(self) -> dict[str, Any]:
        """What the job produced: state, MLflow run, committed checkpoints, registered model, Prefect flow run."""
        if self._result is not None:
            return self._result
        record = self.record()
        data = record.data if record is not None else {}
        return {"job_id": self.id, "state": self.status, "mlflow_run_id": data.get("mlflow_run_id"),
                "model": data.get("model"), "checkpoints": sorted(int(s) for s in data.get("checkpoints", {})),
                "flow_run_id": data.get("flow_run_id") or self.flow_run_id}

    def wait(self, timeout: float | None = None) -> str:
        """Block until the job ends; its final state. TimeoutError after `timeout` seconds (the job goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.status) not in FINAL_STATES:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still {state} after {timeout:.0f} s")
            time.sleep(POLL_S)
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=30)  # its exit after the last record write
        return state

    def metrics(self) -> list[Metrics]:
        """Every step's metrics (rank 0's), from the job's events."""
        from trainforge.events import read_typed_events

        path = self.folder / "events.jsonl"
        if not path.is_file():
            return []
        events, _, _ = read_typed_events(path, only=(Metrics,))
        return [e for e in events if isinstance(e, Metrics)]

    def logs(self, rank: int | None = None) -> str:
        """The workers' output (torchrun's per-rank stdout and stderr, every segment); `rank` keeps one rank,
        otherwise each line is prefixed `[rank N]`."""
        return "".join(_format_line(r, line, rank) for r, path in rank_log_files(self.folder / "logs", rank)
                       for line in path.read_text(errors="replace").splitlines(keepends=True))

    def follow_logs(self, rank: int | None = None, poll_s: float = POLL_S,
                    until: Callable[[], bool] | None = None) -> Iterator[str]:
        """The workers' output lines as they are written, until the job ends (or `until()` is true), then what is
        left."""
        offsets: dict[Path, int] = {}
        partial: dict[Path, str] = {}
        while True:
            finished = self.done if until is None else until()
            for r, path in rank_log_files(self.folder / "logs", rank):
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    chunk = f.read()
                offsets[path] = offsets.get(path, 0) + len(chunk)
                text = partial.pop(path, "") + chunk.decode(errors="replace")
                lines = text.splitlines(keepends=True)
                if lines and not lines[-1].endswith("\n") and not finished:
                    partial[path] = lines.pop()  # a line still being written
                for line in lines:
                    yield _format_line(r, line, rank)
            if finished:
                return
            time.sleep(poll_s)

    def cancel(self, timeout: float = 60.0) -> str:
        """Stop the job: every worker is stopped, the last committed checkpoint kept (resume it with
        `submit(None, resume=job.id)`). A detached job's controller gets SIGINT (SIGKILL for it and every process
        it started if it has not stopped after `timeout` s); another job is cancelled through its Prefect flow run.
        Returns the state it ended in (a job already ended keeps its state)."""
        state = self.status
        if state in FINAL_STATES:
            return state
        info = self._process()
        if info is not None and self._controller_alive(info):
            os.kill(info["pid"], signal.SIGINT)
            try:
                return self.wait(timeout)
            except TimeoutError:
                _kill_tree(info["pid"])
                record = self.record()
                if record is not None:
                    record.update(state="cancelled", error=f"cancelled: the controller did not stop in "
                                                           f"{timeout:.0f} s and was killed")
                return "cancelled"
        record = self.record()
        flow_run_id = (record.data.get("flow_run_id") if record is not None else None) or self.flow_run_id
        if not flow_run_id:
            raise RuntimeError(f"job {self.id} is {state} but has no flow run or controller process to stop yet; "
                               "try again in a few seconds")
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        with get_client(sync_client=True) as client:  # the flow's event pump sees it within seconds
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        try:
            return self.wait(timeout)
        except TimeoutError:
            return self.status


def _kill_tree(pid: int) -> None:
    """SIGKILL a controller and every process under it (torchrun agents and sidecars run in sessions of their own,
    so its process group alone would leave them behind)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def _format_line(rank: int, line: str, only: int | None) -> str:
    return line if only is not None else f"[rank {rank}] {line}"


def rank_log_files(log_root: Path, rank: int | None = None) -> list[tuple[int, Path]]:
    """(global rank, file) of every worker log under a job's logs/, in the order they were written: by segment,
    then torchrun restart attempt, then rank; stdout before stderr. Single-node: `segment-S/<run>/attempt_A/<local
    rank>/{stdout,stderr}.log`; one agent per node: under `segment-S/node-<i>/` (global = node * per node + local)."""
    def number(p: Path, prefix: str) -> int:
        tail = p.name[len(prefix):]
        return int(tail) if tail.isdigit() else -1

    found: list[tuple[int, int, int, int, int, Path]] = []
    if not log_root.is_dir():
        return []
    for segment in log_root.glob("segment-*"):
        seg = number(segment, "segment-")
        nodes = sorted(segment.glob("node-*"), key=lambda p: number(p, "node-"))
        trees = [(number(n, "node-"), n) for n in nodes] or [(0, segment)]
        per_node = 1
        if nodes:
            per_node = len({p.name for p in nodes[0].glob("*/attempt_*/*") if p.name.isdigit()}) or 1
        for node, tree in trees:
            for local_dir in tree.glob("*/attempt_*/*"):
                if not local_dir.name.isdigit():
                    continue
                global_rank = node * per_node + int(local_dir.name) if nodes else int(local_dir.name)
                if rank is not None and global_rank != rank:
                    continue
                attempt = number(local_dir.parent, "attempt_")
                for order, name in enumerate(("stdout.log", "stderr.log")):
                    path = local_dir / name
                    if path.is_file():
                        found.append((seg, attempt, global_rank, order, path.stat().st_mtime_ns, path))
    found.sort(key=lambda t: t[:4])
    return [(t[2], t[5]) for t in found]


# ------------------------------------------------------------------ the detached controller


def _run_detached(submission_file: Path) -> int:
    """The background process of a detached job: run the flow. Its exit status is for its own log only (0 completed,
    1 otherwise): readers take the job's state from the record."""
    # Inherited SIG_IGN (a background shell) would make the job uncancellable: SIGINT and SIGTERM both cancel.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    from trainforge.registry.jobs import JobStore
    from trainforge.validate import validate_document

    data = json.loads(submission_file.read_text())
    report = validate_document(data["doc"], data["source"], Path(data["base_dir"]))
    if not report.ok():
        print(SpecError(report.errors(), data["source"]), flush=True)
        return 1
    sub = Submission(data["doc"], data["source"], data["base_dir"], data["job_id"], data["resume"], report)
    try:
        job = run_here(sub)
    except KeyboardInterrupt:
        print(f"job {sub.job_id} cancelled: every worker was stopped", flush=True)
        path = JobStore().root / sub.job_id / "job.json"
        if path.is_file():
            record = JobStore().get(sub.job_id)
            if record.data.get("state") not in FINAL_STATES:
                record.update(state="cancelled")
        return 1
    state = job.status
    print(f"job {sub.job_id} {state}" + (f": {job.error}" if job.error and state != "completed" else ""),
          flush=True)
    return 0 if state == "completed" else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m trainforge.sdk SUBMISSION.json (started by trainforge.sdk.submit(detach=True))")
    sys.exit(_run_detached(Path(sys.argv[1])))
