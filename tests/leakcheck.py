"""Leak check for the test suite: nothing a run starts or makes may outlive it.

Why: a test that dies half-way (a timeout, a crash, a missing `finally`) can leave a torchrun agent running
(re-parented to PID 1), a network namespace, bridge or nftables table of the netns test hosts, a tmpfs mount or a
/dev/shm replica behind. On a shared CI machine those pile up and make later runs fail for reasons of their own,
and a test that edits the machine's own network namespace (routes, addresses, the ruleset, forwarding) can cut
the machine off. Files too: every CI run used to leave ~60 torchrun log folders (`torchelastic_*`), SeaweedFS
sockets and logs, Chromium and PostgreSQL folders in /tmp. So the session hooks (in the xdist controller) take a
`snapshot()` at the start and, at the end, fail the run naming every leak (`leaked_processes`, `leaks`; `check`
does both), then `kill_leaked` the stragglers so a failed run still leaves no process behind.

How processes are recognised: every process the suite starts inherits TRAINFORGE_TEST_RUN=<run id> (the
conftest sets it), and /proc/<pid>/environ shows the environment a process was started with, whoever its parent
is now. (A process that overwrites its own environ area, as setproctitle does, hides from this.)

How files are judged: a snapshot lists the entries of the system temp dir and of /dev/shm, and every entry the
second snapshot has that the first had not is a leak, whatever made it, unless the caller names it as its own
(`own`: path globs, e.g. pytest's `pytest-of-*` basetemp root, or a folder of screenshots kept on purpose). Only
names absent at the start count, so what was there before (another user's, an earlier run's) is never blamed on
the run, nor is what goes away before the end, nor the folders another run of the suite names after its own run id
(`tf-test-<id>-*`: a run started meanwhile, by hand or without the test lock, removes its own). The suite (tests/fixtures/suite.py) also points TMPDIR, for itself
and every process it starts, at a folder of the run's own inside the system temp dir, removed as it exits: what
honours TMPDIR (torchrun, torch.compile, Chromium, SeaweedFS's logs, tempfile) never reaches the system temp dir,
so a new entry there comes from a path fixed in code (SeaweedFS's gRPC sockets, a literal "/tmp/...") or from
something outside the run that wrote there meanwhile. Nothing tells the two apart after the fact, so on a machine
shared with other work (a developer's, where a run of minutes sees other people's logs appear in /tmp) the
default, TRAINFORGE_LEAK_TEMP=known, counts only new temp dir entries of the kinds the suite's tools and this
project make (`LITTER`: torchrun's, torch.compile's, SeaweedFS's, Chromium's, PostgreSQL's, `tf-*`,
`trainforge-*`), so nobody else's file fails a run; `all` counts every new entry (a machine running nothing else). A leak line names, where the name is a known one, what makes it.

Every probe has a timeout. One that cannot run (a tool missing, not root) is "not checked": `None` in the
snapshot, listed by `unchecked`, never a crash and never a leak.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

RUN_ENV = "TRAINFORGE_TEST_RUN"
PROBE_TIMEOUT_S = 5.0
NETNS_DIR = Path("/run/netns")
SHM_DIR = Path("/dev/shm")
# `known` (the default): only new temp dir entries named in LITTER are leaks; `all`: every new entry.
TEMP_MODE_ENV = "TRAINFORGE_LEAK_TEMP"
# Who makes entries of these names: the hint a leak line gives (first match), and what TRAINFORGE_LEAK_TEMP=known
# counts.
LITTER = (
    ("torchelastic_*", "torchrun's log folder: a torchrun given neither --log-dir nor the run's TMPDIR"),
    ("torchinductor_*", "torch.compile's cache: a process without the run's TMPDIR"),
    ("seaweedfs-*.sock", "a gRPC socket of a killed weed: SeaweedFSServer.stop removes them"),
    ("tf-weed-*", "a SeaweedFSServer's socket folder: a server never stopped"),
    ("weed.*", "SeaweedFS's log: a weed without -logdir or the run's TMPDIR"),
    (".org.chromium.Chromium.*", "Chromium's profile: a browser without the run's TMPDIR or never quit"),
    (".com.google.Chrome.*", "Chromium's profile: a browser without the run's TMPDIR or never quit"),
    (".s.PGSQL.*", "a PostgreSQL socket: a server started without -k"),
    ("tf-pg-*", "a PostgreSQL test cluster's folder"),
    ("tf-stack-*", "a `trainforge servers` stack's folder"),
    ("tf-test-*", "a folder of the suite's own, not removed"),
    ("tf-*", "made by trainforge or its tests"),
    ("trainforge-*", "made by trainforge or its tests"),
)
_UNKNOWN = ("made by this run, or by something else on this machine meanwhile: TRAINFORGE_LEAK_TEMP=known counts "
            "only the kinds the suite's tools make")
# The forwarding switches: a test host rig or a sandbox that turns one on in the machine's own namespace makes
# the machine a router for whatever reaches it.
FORWARDING_SYSCTLS = ("net/ipv4/ip_forward", "net/ipv4/conf/all/forwarding", "net/ipv6/conf/all/forwarding")
# A leak line lists at most this many changed lines of a route/address/ruleset diff; the rest are counted.
MAX_CHANGES_SHOWN = 8
T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    """What a run could leave behind, at one moment. A field is None when it could not be checked.

    `examined` names the network namespace whose network state (bridges, nftables, routes, addresses,
    forwarding) this is; None means the machine's own. Namespaces, mounts and /dev/shm are always the machine's.
    `temp_dir` is the folder `temp` lists (the system temp dir).
    """

    examined: str | None
    temp_dir: str
    netns: frozenset[str] | None
    bridges: frozenset[str] | None
    nft_tables: frozenset[str] | None
    mounts: tuple[str, ...] | None  # sorted, repeats kept: a second mount stacked on a mount point is a new one
    shm: frozenset[str] | None
    temp: frozenset[str] | None
    routes: tuple[str, ...] | None
    addresses: tuple[str, ...] | None
    ruleset: str | None
    sysctls: tuple[tuple[str, str], ...] | None


# --- running the probes -------------------------------------------------------------------------------------


def _run(argv: list[str]) -> str | None:
    """stdout of a probe, or None when it could not run (tool missing, no permission, timeout, failure)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _entering(netns: str | None) -> list[str]:
    """The prefix that runs a command in the named network namespace (nothing for our own). `nsenter --net`
    only switches the network namespace; `ip netns exec` (the fallback) also sets up a private mount namespace."""
    if netns is None:
        return []
    if shutil.which("nsenter"):
        return ["nsenter", f"--net={NETNS_DIR / netns}", "--"]
    return ["ip", "netns", "exec", netns]


def _ip(netns: str | None, *args: str) -> str | None:
    # `ip -n NAME` enters the namespace itself: no extra process.
    return _run(["ip", *(["-n", netns] if netns else []), *args])


# --- the machine-wide things: only what was added is a leak -------------------------------------------------


def _netns_names() -> frozenset[str] | None:
    # `ip netns list` only lists this folder (and would add "(id: N)" to the names).
    try:
        return frozenset(entry.name for entry in os.scandir(NETNS_DIR))
    except FileNotFoundError:
        return frozenset()  # no namespace was ever named on this machine
    except OSError:
        return None


def _unescape_mountinfo(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _is_netns_mount(point: str) -> bool:
    # Each named namespace is a bind mount under /run/netns (and `ip` makes /run/netns a mount of its own on
    # first use, which stays): the namespace check names those, so they are not mounts to report twice.
    return any(point == root or point.startswith(root + "/") for root in ("/run/netns", "/var/run/netns"))


def parse_mount_points(mountinfo: str) -> tuple[str, ...]:
    """The mount points in /proc/<pid>/mountinfo text, sorted, repeats kept, namespace mounts left out."""
    points = []
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) > 4:
            point = _unescape_mountinfo(parts[4])
            if not _is_netns_mount(point):
                points.append(point)
    return tuple(sorted(points))


def _mounts() -> tuple[str, ...] | None:
    try:
        return parse_mount_points(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return None


def _entries(folder: Path) -> frozenset[str] | None:
    try:
        return frozenset(entry.name for entry in os.scandir(folder))
    except OSError:
        return None


def _shm_entries() -> frozenset[str] | None:
    return _entries(SHM_DIR)


# --- one network namespace's state: normalised so that an unchanged namespace compares equal ---------------


def parse_bridges(link_output: str) -> frozenset[str]:
    """Bridge names from `ip -o link show type bridge` ("5: tfbr12ab: <BROADCAST,...> ...")."""
    names = (re.match(r"\d+:\s+([^:@\s]+)", line) for line in link_output.splitlines())
    return frozenset(m.group(1) for m in names if m)


def parse_nft_tables(ruleset: str) -> frozenset[str]:
    """Tables ("inet trainforge") from `nft list ruleset` (one listing serves both the tables and the ruleset)."""
    tables = (re.match(r"table\s+(\S+)\s+(\S+)", line) for line in ruleset.splitlines())
    return frozenset(f"{m.group(1)} {m.group(2)}" for m in tables if m)


_ROUTE_VOLATILE = re.compile(r"\s(expires|age)\s+-?\d+sec\b|\slinkdown\b")
_CACHE_ENTRY = re.compile(r"(^|\s)cache(\s|$)")


def normalise_routes(output: str) -> tuple[str, ...]:
    """Route lines without what changes on its own: cached exception routes (path MTU, redirects), the
    `expires`/`age` countdowns of learned routes, and `linkdown` (a carrier state, not configuration)."""
    lines = []
    for line in output.splitlines():
        if not line.strip() or _CACHE_ENTRY.search(line):
            continue
        lines.append(" ".join(_ROUTE_VOLATILE.sub(" ", line).split()))
    return tuple(sorted(lines))


_ADDRESS_VOLATILE = re.compile(r"\b(valid_lft|preferred_lft)\s+\S+|\b(tentative|deprecated|optimistic)\b")


def normalise_addresses(output: str) -> tuple[str, ...]:
    """Address lines of `ip -o addr` without what changes on its own: the interface index (a recreated but
    otherwise identical interface is no change), lifetimes counting down, the DAD and preferred states, and
    IPv6 privacy addresses (`temporary`: they rotate by design)."""
    lines = []
    for line in output.splitlines():
        body = re.sub(r"^\d+:\s*", "", line).replace("\\", " ")
        words = body.split()
        if len(words) < 2 or words[1] not in ("inet", "inet6") or "temporary" in words:
            continue
        lines.append(" ".join(_ADDRESS_VOLATILE.sub(" ", body).split()))
    return tuple(sorted(lines))


_RULESET_VOLATILE = re.compile(
    r"\bpackets\s+\d+\s+bytes\s+\d+"       # counters (anonymous `counter packets N bytes M` and named ones)
    r"|\bexpires\s+[\dhmsd.]+"            # set elements with a timeout count down
    r"|\bused\s+\d+\s+\w+"                # quotas: `used N bytes`
    r"|\blast\s+used\s+(never|\S+\s+ago)"  # the `last` statement
)


def normalise_ruleset(output: str) -> str:
    """`nft list ruleset` without its counters, countdowns and quota use."""
    lines = (" ".join(_RULESET_VOLATILE.sub(" ", line).split()) for line in output.splitlines())
    return "\n".join(line for line in lines if line)


def _sysctls(netns: str | None) -> tuple[tuple[str, str], ...] | None:
    """The forwarding switches as (dotted name, value). /proc/sys/net shows the namespace of whoever reads it,
    so another namespace's are read by a process inside it. A switch that does not exist (IPv6 off) is left out."""
    paths = [f"/proc/sys/{name}" for name in FORWARDING_SYSCTLS]
    values: dict[str, str] = {}
    if netns is None:
        for path in paths:
            try:
                values[path] = Path(path).read_text().strip()
            except OSError:
                continue
    else:
        # "PATH:VALUE" per switch that exists; the trailing `true` keeps a missing one from failing the probe,
        # while a namespace that cannot be entered still fails it (nsenter's own exit status).
        script = 'for f; do [ -r "$f" ] && printf "%s:%s\\n" "$f" "$(cat "$f")"; done; true'
        output = _run([*_entering(netns), "sh", "-c", script, "sh", *paths])
        if output is None:
            return None
        values = dict(line.split(":", 1) for line in output.splitlines() if ":" in line)
    return tuple((path.removeprefix("/proc/sys/").replace("/", "."), value) for path, value in values.items())


def _nft_ruleset(netns: str | None) -> str | None:
    return _run([*_entering(netns), "nft", "list", "ruleset"])


def _mapped(value: str | None, parse: Callable[[str], T]) -> T | None:
    return None if value is None else parse(value)


def _route_output(netns: str | None) -> str | None:
    v4, v6 = _ip(netns, "-4", "route", "show", "table", "all"), _ip(netns, "-6", "route", "show", "table", "all")
    if v4 is None:
        return None
    return v4 + (v6 or "")  # a machine without IPv6 has no IPv6 routes to change


def snapshot(netns: str | None = None, temp_dir: str | os.PathLike[str] | None = None) -> Snapshot:
    """What could leak, now. `netns` names a network namespace to examine instead of our own for the network
    state (the machine-wide namespaces, mounts, /dev/shm and temp dir are the same either way). `temp_dir`: the
    folder whose entries to list, by default tempfile's (give the system one where TMPDIR points elsewhere). The
    probes run side by side: each is a short subprocess, and together they stay well under a second."""
    folder = Path(temp_dir) if temp_dir is not None else Path(tempfile.gettempdir())
    with ThreadPoolExecutor(max_workers=8) as pool:
        names = pool.submit(_netns_names)
        mounts = pool.submit(_mounts)
        shm = pool.submit(_shm_entries)
        temp = pool.submit(_entries, folder)
        bridges = pool.submit(_ip, netns, "-o", "link", "show", "type", "bridge")
        ruleset = pool.submit(_nft_ruleset, netns)
        routes = pool.submit(_route_output, netns)
        addresses = pool.submit(_ip, netns, "-o", "addr")
        sysctls = pool.submit(_sysctls, netns)
    raw_ruleset = ruleset.result()
    return Snapshot(
        examined=netns,
        temp_dir=str(folder),
        netns=names.result(),
        bridges=_mapped(bridges.result(), parse_bridges),
        nft_tables=_mapped(raw_ruleset, parse_nft_tables),
        mounts=mounts.result(),
        shm=shm.result(),
        temp=temp.result(),
        routes=_mapped(routes.result(), normalise_routes),
        addresses=_mapped(addresses.result(), normalise_addresses),
        ruleset=_mapped(raw_ruleset, normalise_ruleset),
        sysctls=sysctls.result(),
    )


def unchecked(snap: Snapshot) -> list[str]:
    """The items this snapshot could not check (e.g. "nft_tables", "ruleset" where `nft` is missing)."""
    return [f.name for f in fields(snap) if f.name not in ("examined", "temp_dir") and getattr(snap, f.name) is None]


# --- comparing ----------------------------------------------------------------------------------------------


def _added(before: Iterable[str], after: Iterable[str]) -> list[str]:
    # As multisets: a mount stacked on an existing mount point is new although the point is not.
    return sorted((Counter(after) - Counter(before)).elements())


def _changes(before: Iterable[str], after: Iterable[str]) -> str:
    """"+ line; - line" for what differs, the first MAX_CHANGES_SHOWN of them."""
    diff = list(difflib.unified_diff(list(before), list(after), lineterm="", n=0))[2:]  # past the file headers
    changes = [f"{line[0]} {line[1:]}" for line in diff if line[:1] in ("+", "-")]
    shown = "; ".join(changes[:MAX_CHANGES_SHOWN])
    more = len(changes) - MAX_CHANGES_SHOWN
    return shown + (f"; ... and {more} more" if more > 0 else "")


def temp_mode_from_env() -> str:
    """TRAINFORGE_LEAK_TEMP: "known" (unset) or "all"; anything else is refused, not guessed at."""
    mode = os.environ.get(TEMP_MODE_ENV, "").strip() or "known"
    if mode not in ("all", "known"):
        raise ValueError(f"{TEMP_MODE_ENV}={mode!r}: use 'known' (the kinds the suite's tools make, the default) "
                         "or 'all' (every new entry)")
    return mode


def _maker(name: str) -> str | None:
    return next((who for pattern, who in LITTER if fnmatch.fnmatchcase(name, pattern)), None)


def _another_runs(name: str, run_id: str | None) -> bool:
    return run_id is not None and name.startswith("tf-test-") and not name.startswith(f"tf-test-{run_id}-")


def leaks(before: Snapshot, after: Snapshot, own: Iterable[str] = (), temp_mode: str = "all",
          run_id: str | None = None) -> list[str]:
    """One line per leak, naming it. Things that are gone are no leak; items either snapshot could not check
    are skipped (see `unchecked`). `own`: path globs of /dev/shm and temp dir entries that are the caller's own
    (kept on purpose, or removed by it later), not leaks. `temp_mode` "known": of the temp dir's new entries only
    those of a kind in LITTER count (/dev/shm's all count either way). `run_id`: the suite's folders named after
    another run id (`tf-test-<id>-...`) are that run's, not leaks of this one."""
    if before.examined != after.examined:
        raise ValueError(f"snapshots of different namespaces: {before.examined!r} and {after.examined!r}")
    if before.temp_dir != after.temp_dir:
        raise ValueError(f"snapshots of different temp dirs: {before.temp_dir!r} and {after.temp_dir!r}")
    own = list(own)
    whose = "the machine's" if after.examined is None else f"network namespace {after.examined}'s"
    inside = "" if after.examined is None else f" in network namespace {after.examined}"
    found: list[str] = []

    def added(name: str, describe: Callable[[str], str]) -> None:
        old, new = getattr(before, name), getattr(after, name)
        if old is not None and new is not None:
            found.extend(describe(item) for item in _added(old, new))

    def new_files(name: str, folder: Path, known_only: bool = False) -> None:
        old, new = getattr(before, name), getattr(after, name)
        if old is None or new is None:
            return
        for entry in _added(old, new):
            path, maker = str(folder / entry), _maker(entry)
            if any(fnmatch.fnmatchcase(path, pattern) for pattern in own) or (known_only and maker is None) \
                    or _another_runs(entry, run_id):
                continue
            if maker is None and name == "temp":
                maker = _UNKNOWN
            found.append(f"{path} left behind" + (f" ({maker})" if maker else ""))

    def changed(name: str, what: str, lines: Callable[[Any], list[str]]) -> None:
        old, new = getattr(before, name), getattr(after, name)
        if old is not None and new is not None and old != new:
            found.append(f"{whose} {what} changed: {_changes(lines(old), lines(new))}")

    added("netns", lambda n: f"network namespace {n} left behind")
    added("bridges", lambda b: f"bridge {b} left behind{inside}")
    added("nft_tables", lambda t: f"nftables table {t} left behind{inside}")
    added("mounts", lambda m: f"mount {m} left behind")
    new_files("shm", SHM_DIR)
    new_files("temp", Path(after.temp_dir), known_only=temp_mode == "known")
    changed("routes", "routes", list)
    changed("addresses", "addresses", list)
    changed("ruleset", "nftables ruleset", lambda text: str(text).splitlines())
    changed("sysctls", "forwarding sysctls", lambda pairs: [f"{k} = {v}" for k, v in pairs])
    return found


# --- processes ----------------------------------------------------------------------------------------------


def _lineage(pid: int) -> set[int]:
    """pid and its ancestors: the checking process and whatever started it (a shell, make) are not leaks."""
    seen: set[int] = set()
    while pid > 0 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ...": comm may hold spaces
    return seen


def _tagged(run_id: str, exclude: Iterable[int]) -> list[int]:
    """Live processes started with TRAINFORGE_TEST_RUN=run_id. A zombie's environ reads empty: it has exited."""
    if not run_id:
        raise ValueError("an empty run id would match every untagged process started with an empty value")
    tag = f"{RUN_ENV}={run_id}".encode()
    skip = _lineage(os.getpid()) | set(exclude)
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read (not root)
            continue
        if tag in environ.split(b"\0"):
            pids.append(int(entry.name))
    return sorted(pids)


def _describe(pid: int) -> str | None:
    """"pid 123: the command line", or None when it has gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        if not cmdline:
            cmdline = f"[{Path(f'/proc/{pid}/comm').read_text().strip()}]"
    except OSError:
        return None
    return f"pid {pid}: {cmdline[:300]}"


def leaked_processes(run_id: str, grace_s: float = 10.0, exclude: Iterable[int] = frozenset()) -> list[str]:
    """The processes tagged with run_id still alive ("pid 123: cmdline" each), waiting up to grace_s for ones
    that are exiting right now (the last xdist workers, an agent finishing its own clean-up). The calling
    process, its ancestors and `exclude` are never leaks."""
    exclude = set(exclude)
    deadline = time.monotonic() + grace_s
    while True:
        pids = _tagged(run_id, exclude)
        if not pids or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return [line for line in map(_describe, pids) if line is not None]


def kill_leaked(run_id: str, exclude: Iterable[int] = frozenset(), wait_s: float = 5.0) -> list[int]:
    """SIGKILL the processes tagged with run_id (call it after reporting them) so that a failed run still leaves
    nothing running; waits up to wait_s for them to go. Returns the pids signalled."""
    exclude = set(exclude)
    pids = _tagged(run_id, exclude)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
    deadline = time.monotonic() + wait_s
    while _tagged(run_id, exclude) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def _own_resource_tracker() -> frozenset[int]:
    """This process's multiprocessing resource tracker, if a test started one here (a run without xdist): it reads
    a pipe this process holds and exits when this process does, so it is not left behind."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)  # noqa: SLF001 (no public accessor)
    return frozenset([pid]) if isinstance(pid, int) else frozenset()


def left_running(run_id: str, grace_s: float = 10.0) -> list[str]:
    """`leaked_processes` less this process's own resource tracker, then killed (a failed run leaves none)."""
    own = _own_resource_tracker()
    found = leaked_processes(run_id, grace_s, exclude=own)
    if found:
        kill_leaked(run_id, exclude=own)
    return found


def check(before: Snapshot, run_id: str, grace_s: float = 10.0, *, own: Iterable[str] = (),
          cleanup: Callable[[], None] | None = None) -> list[str]:
    """Everything the run left behind, one line each (empty: clean), for the session-finish hook: the leaked
    processes (then killed), and what was added or changed since `before` (`own`: see `leaks`; which new temp dir
    entries count: TRAINFORGE_LEAK_TEMP). Processes come first so that the grace period also lets exiting ones finish
    removing what they made; then `cleanup` runs (the caller removing its own folders, now that nothing of the
    run writes there any more) and the second snapshot is compared."""
    temp_mode = temp_mode_from_env()
    found = [f"process left running: {line}" for line in left_running(run_id, grace_s)]
    if cleanup is not None:
        cleanup()
    after = snapshot(before.examined, before.temp_dir)
    return found + leaks(before, after, own=own, temp_mode=temp_mode, run_id=run_id)
