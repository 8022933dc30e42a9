"""The node agent: what the `hosts` backend starts on each machine of a gang for one segment.

Started through the cluster's runner (`ssh {host} {command}`) as `python -m trainforge.infra.backends.node_agent`,
it reads its program (`NodeProgram`, one JSON line) from stdin: the environment its processes get of the control
plane's, the segment's worker config, its node-local work folder, the sidecar's and torchrun's command lines. So
no secret is ever on a command line (`ps` on the host shows none) and nothing is read from the flow host's disk.

It then starts the node's channel publisher (sidecar) and its torchrun agent, each in its own session, and keeps
stdin open as the control plane's lease on the node:

- a `stop <grace_s>` line: SIGTERM the torchrun agent's whole process group, SIGKILL what is left after grace_s,
  then the sidecar (its closing batch); it exits.
- end of stdin (the control plane's process ended, whatever ended it, or the ssh connection dropped): the same
  stop with a short grace. So nothing a node runs for a segment outlives the process that launched it, past
  `ORPHAN_GRACE_S` + `SIDECAR_STOP_S`.
- the gang's lease lapsed (the sidecar's publisher heard no renewal from the control plane for the lease's TTL:
  the one stopping rule, contract/channel.py): the sidecar stops the node's ranks and writes `LEASE_MARKER`; the
  agent sees it and stops the node as for a `stop`, on its own, whatever its runner's connection does (a control
  plane cut off from the store, or frozen, still holds stdin open); torchrun would restart the stopped ranks.
- the torchrun agent exits by itself: the sidecar is stopped (its closing batch carries everything the ranks
  sent) and the agent's exit code is reported.

Before it starts anything it fetches the job's inputs from the store into the node's folder when the config names
some (`{"fetching": ...}` first), and, when the program says `hold`, reports `{"ready": {"port": ...}}` and waits
for a `go [port]` line: the `hosts` backend starts torchrun on no node before every node has its inputs.

Its stdout is the protocol back, JSON lines: `{"started": {...}}` once both processes run, `{"exit": code}` as
the last line (a negative code: the agent died of that signal). In a gang of several nodes (`probe`) the agent also
answers its peers' probes on a port of its own (in `ready`), probes theirs from the `go` line on (`go PORT
name=address:port,...`) and reports each change of the peers it cannot reach as `{"reach": {"unreachable": [...],
"failing_s": {...}}}` (infra/backends/reach_probe.py): how the control plane tells a cut between hosts. Anything else it has to say goes to stderr.
Both children also get PR_SET_PDEATHSIG (SIGTERM): if the node agent itself is killed, they are told at once.
The agent is its node's child subreaper (PR_SET_CHILD_SUBREAPER): torchrun starts each worker in a session of its
own, so a worker whose torchrun was killed re-parents to the agent, which kills whatever is left of its descendants
before it reports its exit. SIGTERM and SIGHUP to the agent are a stop.

The first node picks the rendezvous's port itself when the launcher names none (`pick_port`): a free port on its
own host, reported in `ready` (a held program; in `started` otherwise), which the control plane then gives the
other nodes in their `go` line.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, NoReturn

from trainforge._linux import PR_SET_CHILD_SUBREAPER, die_with_parent, prctl
from trainforge.infra.procs import stop_group, stop_process

ORPHAN_GRACE_S = 5.0
"""Grace the workers get (SIGTERM, then SIGKILL) when the control plane's end of stdin closes."""
SIDECAR_STOP_S = 15.0
"""How long the sidecar may take to write its closing batch before it is killed."""
REAP_GRACE_S = 2.0
"""Grace (SIGTERM, then SIGKILL) for what is left below the agent once torchrun ended by itself."""
CONFIG_NAME = "worker-config.json"
LEASE_MARKER = "lease-lapsed"
"""Written in the node's work folder by the sidecar when the gang's lease lapsed (sidecar.LEASE_MARKER_ENV)."""
LEASE_MARKER_ENV = "TRAINFORGE_LEASE_MARKER"  # sidecar.py's; not imported: the agent starts with no torch loaded


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeProgram:
    """One node's segment, as the control plane sends it (one JSON line on the agent's stdin)."""

    node: str
    work_dir: str
    """This segment's node-local folder: the worker config, torchrun's per-rank logs, the agent's log."""
    torchrun: list[str]
    sidecar: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    """What the node's processes get of the control plane's environment, on top of the host's own."""
    config: str | None = None
    """The segment's worker config (JSON); written to work_dir and named by $TRAINFORGE_JOB_CONFIG."""
    gpu_type: str = "cpu"
    devices: list[int] = field(default_factory=list)
    """The accelerators the scheduler gave the job on this node, narrowed within the host's own
    CUDA_VISIBLE_DEVICES here, where it is known (infra/launch.py `device_environment`)."""

    workers: int = 1
    """Workers on this node: OMP_NUM_THREADS is the node's cores divided among them, unless `env` sets it."""
    pick_port: bool = False
    """Pick a free port here for the rendezvous this node hosts (torchrun's `--rdzv-endpoint=ADDR:0`)."""
    hold: bool = False
    """Start nothing until the control plane says `go`: once the inputs are fetched, report `ready` (with the port
    picked) and wait for a `go [port]` line, the port being the first node's for a rendezvous left to it. So every
    node fetches at once, and torchrun starts only when all have their inputs (the `hosts` backend's barrier)."""
    logs_url: str | None = None
    """The job's object store: the node's logs go up there when the segment ends (infra/backends/node_logs.py)."""
    logs_key: str | None = None
    """Their key there (`{job prefix}/logs/segment-{attempt}/{node}`)."""
    node_dir: str | None = None
    """The node's folder for the job across segments (`{launcher work_dir}/{job}/{node}`): held while the agent runs
    (infra/backends/node_folders.py), so the job's end removes it only once no agent of the job runs here."""
    sweep_after_s: float | None = None
    """At start, remove this node's folders of other jobs that no agent holds and nobody used for this long."""
    probe: bool = False
    """Measure which gang peers this node reaches (infra/backends/reach_probe.py): a probe port opened before
    `ready` (its port in that report), the peers' probed from the `go` line on, each change reported as
    `{"reach": ...}`. Only with `hold` (the peers' ports come with `go`)."""

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":")) + "\n"

    @classmethod
    def from_line(cls, line: str) -> NodeProgram:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("the node program is not a JSON object")
        return cls(**data)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the node agent dies."""
    die_with_parent(signal.SIGTERM)


def _children() -> list[int]:
    """This process's direct children (with the subreaper bit: every orphan of its tree too)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            out.append(int(entry))
    return out


def _reap_all(grace_s: float) -> None:
    """SIGTERM (when `grace_s`), then SIGKILL, everything still below the agent, and reap it: nothing of the node
    outlives it. Each pass signals the children found then: a killed worker's own children (its output pump, a
    data-loader worker, a script's subprocess) re-parent here only once it is gone."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if not wait:
            continue
        signalled: set[int] = set()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            pids = _children()
            if not pids:
                return
            for pid in set(pids) - signalled:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                signalled.add(pid)
            time.sleep(0.05)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])




_EMIT_LOCK = threading.Lock()  # the prober reports from a thread of its own


def _emit(out: IO[str], **message: Any) -> None:
    with _EMIT_LOCK:
        out.write(json.dumps(message) + "\n")
        out.flush()


class _Lines:
    """Lines from a raw descriptor (no read-ahead buffer hiding a command from `select`)."""

    def __init__(self, fd: int):
        self.fd, self.buffer, self.eof = fd, b"", False

    def ready(self, timeout_s: float) -> bool:
        return b"\n" in self.buffer or self.eof or bool(select.select([self.fd], [], [], timeout_s)[0])

    def _fill(self) -> None:
        chunk = os.read(self.fd, 4096)
        self.eof = not chunk
        self.buffer += chunk

    def read(self) -> list[str]:
        """The complete lines now available (one read unless some are buffered); `eof` once the other end closed."""
        if b"\n" not in self.buffer and not self.eof:
            self._fill()
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode(errors="replace") for line in lines]

    def first(self) -> str | None:
        """The first line (blocking), the rest left buffered; None when the other end closed before one."""
        while b"\n" not in self.buffer and not self.eof:
            self._fill()
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")


def run(program: NodeProgram, stdin: _Lines, out: IO[str]) -> int:
    from trainforge.infra.launch import device_environment, with_rendezvous_port

    if program.node_dir is not None:
        failed = _hold_node_folder(program, out)
        if failed is not None:
            return failed
    work = Path(program.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ) | program.env
    # workers x threads must not exceed the node's cores, or every step slows down (ENVIRONMENT.md)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, program.workers))))
    env.update(device_environment(program.gpu_type, program.devices, os.environ))
    config = None
    if program.config is not None:
        config = work / CONFIG_NAME
        config.write_text(program.config)
        env["TRAINFORGE_JOB_CONFIG"] = str(config)
    torchrun, port = program.torchrun, None
    # Until something runs, SIGTERM/SIGHUP is a stop like a `stop` line: reported, then out at once
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: _stopped_before_start(out))
    if config is not None and _names_inputs(program.config):
        failed = _fetch_inputs(program, config, stdin, out)
        if failed is not None:
            return failed
    if program.pick_port:  # picked after the fetch: the port is free for the shortest time before torch binds it
        port = _free_port()
    listener = prober = None
    peers: dict[str, tuple[str, int]] = {}
    if program.hold:
        if program.probe:
            from trainforge.infra.backends.reach_probe import ProbeListener

            listener = ProbeListener()
        _emit(out, ready={"node": program.node, "port": port,
                          **({"probe_port": listener.port} if listener is not None else {})})
        go = _wait_for_go(stdin)
        if go is None:  # stopped, or the control plane went away, before anything started
            _stopped_before_start(out)
        port = port or go[0]
        peers = {name: where for name, where in go[1].items() if name != program.node}
    if port:
        torchrun = with_rendezvous_port(torchrun, port)
    sidecar = agent = None
    lease_marker = work / LEASE_MARKER
    lease_marker.unlink(missing_ok=True)  # a former segment's on this node
    env[LEASE_MARKER_ENV] = str(lease_marker)
    try:
        if program.sidecar:
            with open(work / "sidecar.log", "ab") as slog:
                sidecar = subprocess.Popen(program.sidecar, env=env, cwd=work, stdout=slog, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True,
                                           preexec_fn=_die_with_parent)
        with open(work / "agent.log", "ab") as log:
            # cwd: the node's folder, never wherever the runner landed (a worker's sys.path[0] and the user's
            # relative paths resolve against it)
            agent = subprocess.Popen(torchrun, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as exc:
        stop_group(sidecar, 0.0)
        _emit(out, error=f"node {program.node}: could not start: {exc}")
        return 127
    _emit(out, started={"node": program.node, "agent_pid": agent.pid, "host_pid": os.getpid(), "port": port})
    if listener is not None and peers:
        from trainforge.infra.backends.reach_probe import Prober

        prober = Prober(peers, lambda down, failing_s: _emit(
            out, reach={"node": program.node, "unreachable": down, "failing_s": failing_s})).start()
    stopped = False  # an exception in _supervise stopped nothing: what runs gets the SIGTERM grace below
    try:
        code, stopped = _supervise(agent, sidecar, stdin, lease_marker)
    finally:
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a stop now must not cost the exit line (the node is done)
            signal.signal(sig, signal.SIG_IGN)
        # A worker whose torchrun died first (its own session) re-parented here. After a stop it already had its
        # SIGTERM and grace (torchrun passed the stop's SIGTERM on): it is killed at once. A worker blocked in a
        # collective of a broken gang never acts on a SIGTERM, and a second grace only delayed the node's exit.
        _reap_all(grace_s=0.0 if stopped else REAP_GRACE_S)
        if prober is not None:
            prober.stop()
        if listener is not None:
            listener.close()
    if program.logs_url and program.logs_key:  # before the exit line: the flow reads them once it has that
        from trainforge.infra.backends.node_logs import upload_bounded

        _adopt_store_environment(program)
        upload_bounded(program.logs_url, program.logs_key, work)
    _release_node_folder()  # before the exit line: the job's end may remove the folder once it has that
    _emit(out, exit=code)
    return code


_HELD: int | None = None
"""The node folder's descriptor (its shared lock) while this agent runs (infra/backends/node_folders.py)."""


def _hold_node_folder(program: NodeProgram, out: IO[str]) -> int | None:
    """Lock the job's folder on this node for the agent's lifetime; then, in the background (a large removal must
    not count against the start's timeout), sweep this node's folders of other jobs abandoned here. None when
    held; else the exit it reported."""
    global _HELD
    from trainforge.infra.backends.node_folders import FolderBusy, hold, sweep

    assert program.node_dir is not None
    node_dir = Path(program.node_dir)
    try:
        _HELD = hold(node_dir)
    except (FolderBusy, OSError) as exc:
        # e.g. a file system without flock on folders: said, and this host is left out (the flow names it)
        _emit(out, error=f"node {program.node}: its folder {node_dir} could not be made or locked: {exc}")
        _emit(out, exit=1)
        return 1
    if program.sweep_after_s is not None:
        max_age_s = program.sweep_after_s

        def clean() -> None:
            swept = sweep(node_dir.parent.parent, program.node, node_dir.parent.name, max_age_s)
            if swept:
                print(f"node agent: removed this node's folders of {len(swept)} job(s) unused for "
                      f"{max_age_s / 3600:g} h: {', '.join(swept)}", file=sys.stderr)

        threading.Thread(target=clean, name="sweep", daemon=True).start()
    return None


def _release_node_folder() -> None:
    global _HELD
    if _HELD is not None:
        from trainforge.infra.backends.node_folders import release

        release(_HELD)
        _HELD = None


STOPPED_BEFORE_START = -int(signal.SIGTERM)
"""The exit an agent reports when it was stopped before it started anything (while fetching, or held)."""


def _stopped_before_start(out: IO[str]) -> NoReturn:
    """Report the stop and leave now: nothing was started, and a fetch in flight (a download's pool threads, which
    the interpreter would join at exit) must not keep the agent, and the node's inputs lock, past the stop."""
    with contextlib.suppress(Exception):
        _release_node_folder()
        _emit(out, exit=STOPPED_BEFORE_START)
    os._exit(128 - STOPPED_BEFORE_START)


def _adopt_store_environment(program: NodeProgram) -> None:
    """The store's address and the job's identity, as the workers get them, for the agent's own store calls (the
    fetch of the inputs, the upload of the logs): its own environment is a login's."""
    os.environ.update({k: v for k, v in program.env.items() if k.startswith(("AWS_", "TRAINFORGE_"))})


def _names_inputs(config: str | None) -> bool:
    try:
        return bool(json.loads(config or "{}").get("inputs"))
    except (ValueError, AttributeError):
        return False  # not a worker config this agent can read: the workers report it


def _stop_requested(stdin: _Lines, timeout_s: float) -> bool:
    """A `stop` line, or the control plane's end closed, within timeout_s."""
    if not stdin.ready(timeout_s):
        return False
    lines = stdin.read()
    return (stdin.eof and not lines) or any(line.startswith("stop") for line in lines)


def _fetch_inputs(program: NodeProgram, config: Path, stdin: _Lines, out: IO[str]) -> int | None:
    """The job's inputs into the node's folder before torchrun starts (trainer/inputs.py `localize`: its workers
    then find the copies), on a thread while stdin is watched, so a stop ends a long fetch at once. Reports
    `fetching` first (the control plane then bounds it by the launcher's inputs_timeout_s, not the start timeout).
    Returns None when fetched; else the exit it reported (an `error` line first, when the fetch failed)."""
    _emit(out, fetching={"node": program.node})
    failure: list[BaseException] = []

    def fetch() -> None:
        try:
            _adopt_store_environment(program)
            from trainforge.contract.config import SegmentConfig
            from trainforge.trainer.inputs import localize

            localize(SegmentConfig.load(config))
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=fetch, name="inputs", daemon=True)
    worker.start()
    while worker.is_alive():
        if _stop_requested(stdin, 0.2):
            _stopped_before_start(out)
    if not failure:
        return None
    exc = failure[0]
    # An input gone or changed in the store is the job's, on every node; anything else (the store out of this
    # host's reach, its own lock) is this host's.
    _emit(out, error=f"node {program.node}: its inputs could not be fetched: {exc}",
          inputs=bool(getattr(exc, "the_jobs", False)))
    _emit(out, exit=1)
    return 1


def _wait_for_go(stdin: _Lines) -> tuple[int, dict[str, tuple[str, int]]] | None:
    """Block until `go [port [peers]]`: the port given (0 when none) and the gang's probe addresses
    (`name=address:port,...`, reach_probe.py), or None on a stop or the end of stdin."""
    while True:
        if not stdin.ready(1.0):
            continue
        lines = stdin.read()
        if stdin.eof and not lines:
            return None
        if any(line.startswith("stop") for line in lines):  # a stop right behind a go (another node failed)
            return None
        for line in lines:
            if line.startswith("go"):
                parts = line.split()
                peers: dict[str, tuple[str, int]] = {}
                if len(parts) > 2:
                    from trainforge.infra.backends.reach_probe import parse_peers

                    peers = parse_peers(parts[2])
                return (int(parts[1]) if len(parts) > 1 else 0), peers


def _supervise(agent: subprocess.Popen[bytes], sidecar: subprocess.Popen[bytes] | None,
               stdin: _Lines, lease_marker: Path | None = None) -> tuple[int, bool]:
    """The torchrun agent's exit code, and whether it was stopped (not ended by itself)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        return _watch(agent, sidecar, stdin, lease_marker)
    except _Stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop at a time
        return _stop(agent, sidecar, ORPHAN_GRACE_S), True


def _stop(agent: subprocess.Popen[bytes], sidecar: subprocess.Popen[bytes] | None, grace_s: float) -> int:
    stop_group(agent, grace_s)
    stop_process(sidecar, SIDECAR_STOP_S)
    return agent.returncode if agent.returncode is not None else -signal.SIGKILL


def _watch(agent: subprocess.Popen[bytes], sidecar: subprocess.Popen[bytes] | None,
           stdin: _Lines, lease_marker: Path | None = None) -> tuple[int, bool]:
    while True:
        code = agent.poll()
        if code is not None:
            stop_process(sidecar, SIDECAR_STOP_S)
            return code, False
        if lease_marker is not None and lease_marker.exists():
            print("node agent: the gang's lease lapsed (no renewal from the control plane): stopping the node",
                  file=sys.stderr, flush=True)
            return _stop(agent, sidecar, ORPHAN_GRACE_S), True
        if not stdin.ready(0.2):
            continue
        lines = stdin.read()
        if stdin.eof and not lines:  # the control plane's end closed: nobody supervises this node any more
            return _stop(agent, sidecar, ORPHAN_GRACE_S), True
        for command in lines:
            if command.startswith("stop"):
                parts = command.split()
                return _stop(agent, sidecar, float(parts[1]) if len(parts) > 1 else ORPHAN_GRACE_S), True


class _Stop(Exception):
    """SIGTERM or SIGHUP to the agent: stop the node as for a `stop` line."""


def _on_signal(signum: int, frame: Any) -> None:
    raise _Stop(signal.Signals(signum).name)


def main() -> int:
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    stdin = _Lines(sys.stdin.fileno())
    line = stdin.first()
    if not line:
        print("node agent: no program on stdin (the control plane sends one JSON line)", file=sys.stderr)
        return 2
    try:
        program = NodeProgram.from_line(line)
    except (ValueError, TypeError) as exc:
        print(f"node agent: the program on stdin is not a NodeProgram: {exc}", file=sys.stderr)
        return 2
    return run(program, stdin, sys.stdout)


if __name__ == "__main__":
    code = main()
    sys.exit(code if code >= 0 else 128 - code)  # died of signal n: 128 + n, as a shell reports it
