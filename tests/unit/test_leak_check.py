"""The suite's leak check (tests/leakcheck.py) names each kind of leak, and an unchanged machine shows none.

The live tests leak one of each for real and look for each by name. They must never touch the machine's own
network namespace (changing it can cut this machine off), so a fresh network namespace stands in for "the
machine"; the rest (a namespace, a mount, a /dev/shm folder, a process) is machine-wide but the test's own. All
they make is removed on the way out (an ExitStack: failure or not, each step bounded by a timeout). Other tests may
run beside these (xdist), so they look for their own names rather than for "nothing else changed".

Files: a file planted in the temp dir (a folder standing in for it, and the real one) is named; a whole run of the
suite's plugin (a pytest of its own, with a folder standing in for the system temp dir) fails naming what its test
left there, and leaves nothing of what went to its own TMPDIR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import leakcheck as lc

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="the leak check reads Linux /proc")

REPO = Path(__file__).resolve().parents[2]


def _sh(*argv: str, check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


def _require_root_and_ip() -> None:
    if os.geteuid() != 0:
        pytest.skip("the live leak-check test needs root (ip netns, mount)")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is missing: scripts/setup-debian.sh installs it")


def _require_nft() -> None:
    if shutil.which("nft") is None:
        pytest.skip("`nft` (nftables) is missing, so the nftables leaks are not checked here: "
                    "scripts/setup-debian.sh installs it")


def _has_line(found: list[str], *needles: str) -> bool:
    return any(all(needle in line for needle in needles) for line in found)


def _start_tagged(run_id: str, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(list(argv), env={**os.environ, lc.RUN_ENV: run_id}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


def _unmount(point: Path) -> None:
    if _sh("umount", str(point), check=False).returncode != 0:
        _sh("umount", "-l", str(point), check=False)  # busy: detach it now, the kernel frees it when unused


@contextlib.contextmanager
def _scratch_netns(name: str) -> Iterator[str]:
    """A network namespace of the test's own, removed on the way out (with anything still running in it)."""
    _sh("ip", "netns", "add", name)
    try:
        yield name
    finally:
        for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _sh("ip", "netns", "del", name, check=False)


# --- pure: normalising and comparing ------------------------------------------------------------------------


def test_address_lifetimes_indexes_and_transient_states_are_not_changes() -> None:
    # `ip -o addr` lines: "\\" where `ip addr` would break the line.
    earlier = ("4: eth0    inet 10.1.2.3/24 brd 10.1.2.255 scope global dynamic eth0\\       "
               "valid_lft 86000sec preferred_lft 86000sec\n"
               "4: eth0    inet6 fd00::5/64 scope global tentative \\       "
               "valid_lft forever preferred_lft forever\n"
               "4: eth0    inet6 fd00::aa:1/64 scope global temporary dynamic \\       "
               "valid_lft 600sec preferred_lft 10sec\n")
    later = ("7: eth0    inet 10.1.2.3/24 brd 10.1.2.255 scope global dynamic eth0\\       "
             "valid_lft 85123sec preferred_lft 85123sec\n"
             "7: eth0    inet6 fd00::5/64 scope global \\       valid_lft forever preferred_lft forever\n"
             "7: eth0    inet6 fd00::bb:2/64 scope global temporary dynamic \\       "
             "valid_lft 599sec preferred_lft 0sec\n")
    assert lc.normalise_addresses(earlier) == lc.normalise_addresses(later)
    assert lc.normalise_addresses(earlier) == ("eth0 inet 10.1.2.3/24 brd 10.1.2.255 scope global dynamic eth0",
                                               "eth0 inet6 fd00::5/64 scope global")


def test_route_countdowns_and_cached_routes_are_not_changes() -> None:
    earlier = ("default via fe80::1 dev eth0 proto ra metric 1024 expires 1790sec hoplimit 64 pref medium\n"
               "10.0.0.0/24 dev eth0 proto kernel scope link src 10.0.0.2\n")
    later = ("10.0.0.0/24 dev eth0 proto kernel scope link src 10.0.0.2 linkdown\n"
             "default via fe80::1 dev eth0 proto ra metric 1024 expires 1650sec hoplimit 64 pref medium\n"
             "2001:db8::9 via fe80::1 dev eth0 metric 1024 cache expires 580sec mtu 1400 pref medium\n")
    assert lc.normalise_routes(earlier) == lc.normalise_routes(later)
    assert lc.normalise_routes(later + "10.9.0.0/24 dev lo scope link\n") != lc.normalise_routes(earlier)


def test_ruleset_counters_and_countdowns_are_not_changes() -> None:
    earlier = ("table inet trainforge {\n\tset peers {\n\t\ttype ipv4_addr\n\t\tflags timeout\n"
               "\t\telements = { 10.0.0.1 timeout 1m expires 58s123ms }\n\t}\n"
               "\tchain out {\n\t\ttype filter hook output priority filter; policy accept;\n"
               "\t\tcounter packets 0 bytes 0\n\t\tquota over 10 mbytes used 0 bytes\n\t}\n}\n")
    later = (earlier.replace("counter packets 0 bytes 0", "counter packets 120 bytes 9000")
             .replace("expires 58s123ms", "expires 12s7ms").replace("used 0 bytes", "used 9000 bytes"))
    assert lc.normalise_ruleset(earlier) == lc.normalise_ruleset(later)
    assert lc.parse_nft_tables(later) == {"inet trainforge"}
    assert lc.normalise_ruleset(later.replace("policy accept", "policy drop")) != lc.normalise_ruleset(earlier)


def test_mount_points_are_unescaped_and_namespace_mounts_left_to_the_namespace_check() -> None:
    mountinfo = ("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
                 "80 22 0:50 / /tmp/with\\040space rw - tmpfs tmpfs rw\n"
                 "81 22 0:4 / /run/netns rw shared:5 - tmpfs tmpfs rw\n"
                 "82 81 0:4 net:[4026532] /run/netns/tft12ab-h1 rw - nsfs nsfs rw\n")
    assert lc.parse_mount_points(mountinfo) == ("/", "/tmp/with space")


def _snap(**changes: object) -> lc.Snapshot:
    base = lc.Snapshot(examined=None, temp_dir="/tmp", netns=frozenset({"old-ns"}), bridges=frozenset({"br0"}),
                       nft_tables=frozenset({"inet filter"}), mounts=("/", "/tmp"), shm=frozenset({"old"}),
                       temp=frozenset({"old-tmp"}), routes=("default via 10.0.0.1 dev eth0",),
                       addresses=("eth0 inet 10.0.0.2/24",), ruleset="table inet filter {\n}",
                       sysctls=(("net.ipv4.ip_forward", "0"),))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_only_what_was_added_or_changed_is_a_leak() -> None:
    before = _snap()
    assert lc.leaks(before, before) == []
    # Things that went away (someone else's namespace, a bridge) are no leak.
    assert lc.leaks(before, _snap(netns=frozenset(), bridges=frozenset(), shm=frozenset(), temp=frozenset())) == []
    after = _snap(netns=frozenset({"old-ns", "tft12ab-h1"}), mounts=("/", "/tmp", "/tmp"),
                  routes=("default via 10.0.0.1 dev eth0", "10.9.0.0/24 dev lo"))
    assert lc.leaks(before, after) == ["network namespace tft12ab-h1 left behind", "mount /tmp left behind",
                                       "the machine's routes changed: + 10.9.0.0/24 dev lo"]


def test_new_temp_and_shm_entries_are_leaks_named_with_who_makes_them_unless_the_run_s_own() -> None:
    before = _snap()
    after = _snap(temp=frozenset({"old-tmp", "torchelastic_ab12cd", "seaweedfs-master-grpc-4001.sock", "notes.txt",
                                  "pytest-of-ci", "tf-test-run1-tmp"}),
                  shm=frozenset({"old", "torch_1234_5678"}))
    found = lc.leaks(before, after, own=["/tmp/pytest-of-*", "/tmp/tf-test-run1-tmp"])
    assert found == [
        "/dev/shm/torch_1234_5678 left behind",
        "/tmp/notes.txt left behind (made by this run, or by something else on this machine meanwhile: "
        "TRAINFORGE_LEAK_TEMP=known counts only the kinds the suite's tools make)",
        "/tmp/seaweedfs-master-grpc-4001.sock left behind (a gRPC socket of a killed weed: SeaweedFSServer.stop "
        "removes them)",
        "/tmp/torchelastic_ab12cd left behind (torchrun's log folder: a torchrun given neither --log-dir nor the "
        "run's TMPDIR)",
    ]
    # An own glob is a path glob: the same name elsewhere is no one's own.
    assert lc.leaks(_snap(shm=frozenset()), _snap(shm=frozenset({"pytest-of-ci"})), own=["/tmp/pytest-of-*"]) == [
        "/dev/shm/pytest-of-ci left behind"]
    # Another run of the suite (started meanwhile) names its folders after its own id: they are its own, not leaks.
    others = _snap(temp=frozenset({"old-tmp", "tf-test-other1-tmp", "tf-test-run1-tmp"}),
                   shm=frozenset({"old", "tf-test-other1-main", "tf-test-run1-gw0"}))
    assert [line.split(" left behind")[0] for line in lc.leaks(before, others, run_id="run1")] == [
        "/dev/shm/tf-test-run1-gw0", "/tmp/tf-test-run1-tmp"]
    # On a shared machine: only the kinds the suite's tools make count in the temp dir (all of /dev/shm still does).
    known = lc.leaks(before, after, own=["/tmp/pytest-of-*"], temp_mode="known")
    assert [line.split(" left behind")[0] for line in known] == [
        "/dev/shm/torch_1234_5678", "/tmp/seaweedfs-master-grpc-4001.sock", "/tmp/tf-test-run1-tmp",
        "/tmp/torchelastic_ab12cd"]


def test_trainforge_leak_temp_is_all_or_known(monkeypatch) -> None:
    monkeypatch.delenv(lc.TEMP_MODE_ENV, raising=False)
    assert lc.temp_mode_from_env() == "known"
    monkeypatch.setenv(lc.TEMP_MODE_ENV, "all")
    assert lc.temp_mode_from_env() == "all"
    monkeypatch.setenv(lc.TEMP_MODE_ENV, "none")
    with pytest.raises(ValueError, match="TRAINFORGE_LEAK_TEMP='none'"):
        lc.temp_mode_from_env()


def test_an_item_either_snapshot_could_not_check_is_skipped_and_listed() -> None:
    before, after = _snap(ruleset=None, nft_tables=None), _snap(ruleset="changed", nft_tables=frozenset({"ip x"}))
    assert lc.leaks(before, after) == []
    assert lc.unchecked(before) == ["nft_tables", "ruleset"]
    assert lc.leaks(_snap(temp=None), _snap(temp=frozenset({"new"}))) == []
    assert lc.unchecked(_snap(temp=None)) == ["temp"]
    with pytest.raises(ValueError):
        lc.leaks(_snap(), _snap(examined="other"))
    with pytest.raises(ValueError):
        lc.leaks(_snap(), _snap(temp_dir="/elsewhere"))


def test_a_missing_tool_leaves_its_items_unchecked_rather_than_failing(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no ip, nft, nsenter or sh to be found
    snap = lc.snapshot()
    assert {"bridges", "nft_tables", "routes", "addresses", "ruleset"} <= set(lc.unchecked(snap))
    assert snap.mounts is not None and snap.netns is not None  # read from files, no tool needed
    absent = lc.snapshot(netns=f"tflc{secrets.token_hex(3)}-none")
    assert {"bridges", "routes", "addresses", "ruleset", "sysctls"} <= set(lc.unchecked(absent))


# --- files (no root needed) --------------------------------------------------------------------------------


def test_a_file_planted_in_the_temp_dir_is_named(tmp_path: Path) -> None:
    temp = tmp_path / "system-tmp"
    (temp / "there-before").mkdir(parents=True)
    before = lc.snapshot(temp_dir=temp)
    assert before.temp_dir == str(temp) and before.temp == {"there-before"}
    (temp / "torchelastic_x1y2z3").mkdir()
    (temp / "there-before" / "inside").write_text("an entry's content is its own business")
    (temp / "planted.txt").write_text("litter")
    found = lc.leaks(before, lc.snapshot(temp_dir=temp))
    assert [line.split(" left behind")[0] for line in found] == [str(temp / "planted.txt"),
                                                                 str(temp / "torchelastic_x1y2z3")]
    assert "torchrun's log folder" in found[1]
    assert lc.leaks(before, lc.snapshot(temp_dir=temp), own=[str(temp / "*.txt")]) == found[1:]


def test_a_file_planted_in_the_real_temp_dir_is_named() -> None:
    """The machine's temp dir, as the suite's check sees it (TRAINFORGE_TEST_SYSTEM_TMP: under the suite TMPDIR is
    the run's own folder, which a snapshot without `temp_dir` lists)."""
    assert lc.snapshot().temp_dir == tempfile.gettempdir()
    system = Path(os.environ.get("TRAINFORGE_TEST_SYSTEM_TMP") or tempfile.gettempdir())
    before = lc.snapshot(temp_dir=system)
    planted = system / f"tf-litter-{secrets.token_hex(4)}"  # a kind the check knows (tf-*): counted by default
    planted.write_text("litter")
    try:
        found = lc.leaks(before, lc.snapshot(temp_dir=system))
    finally:
        planted.unlink()
    assert _has_line(found, f"{planted} left behind"), found
    assert not _has_line(lc.leaks(before, lc.snapshot(temp_dir=system)), str(planted))


def test_the_suite_fails_a_run_that_leaves_files_in_the_system_temp_dir(tmp_path: Path) -> None:
    """A pytest run of its own (not nested: no run tag of ours) with the suite's plugin and a folder standing in for
    the system temp dir: its test writes one file there and one folder through tempfile (the run's TMPDIR). The run
    fails naming the first; the second goes with the run's TMPDIR, and so does everything else of the run's."""
    system = tmp_path / "system-tmp"
    system.mkdir()
    planted = system / f"tf-litter-{secrets.token_hex(4)}"  # a kind the check knows (tf-*): counted by default
    test = tmp_path / "test_litter.py"
    test.write_text(
        "import os, tempfile\nfrom pathlib import Path\n\n\n"
        "def test_litter():\n"
        "    assert Path(tempfile.gettempdir()).parent == Path(os.environ['TRAINFORGE_TEST_SYSTEM_TMP'])\n"
        "    Path(tempfile.mkdtemp(prefix='torchelastic_'), 'log').write_text('to the run TMPDIR')\n"
        f"    Path({str(planted)!r}).write_text('litter')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in (lc.RUN_ENV, "PYTEST_XDIST_WORKER", "PYTEST_DEBUG_TEMPROOT", "TRAINFORGE_TEST_SYSTEM_TMP",
                        "TRAINFORGE_TEST_ARTIFACTS", lc.TEMP_MODE_ENV)}
    env["TMPDIR"] = str(system)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "tests.fixtures.suite", f"--rootdir={REPO}", f"--basetemp={tmp_path / 'basetemp'}",
                           str(test)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "1 passed" in out, out
    assert done.returncode == 1, out
    assert f"LEAK {planted} left behind" in out, out
    assert "torchelastic_" not in out, out
    assert sorted(p.name for p in system.iterdir()) == [planted.name], out  # the run's own TMPDIR is gone


# --- processes (no root needed: our own children's environ is ours to read) --------------------------------


def test_a_tagged_process_is_named_until_killed() -> None:
    run_id = f"leakcheck-{secrets.token_hex(4)}"
    sleeper = _start_tagged(run_id, "sleep", "60")
    try:
        leaked = lc.leaked_processes(run_id, grace_s=0)
        assert leaked == [f"pid {sleeper.pid}: sleep 60"]
        assert lc.leaked_processes(run_id, grace_s=0, exclude={sleeper.pid}) == []
        assert lc.leaked_processes(f"{run_id}-other", grace_s=0) == []  # the whole value must match
        assert lc.kill_leaked(run_id) == [sleeper.pid]
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert lc.leaked_processes(run_id, grace_s=0) == []
    finally:
        _stop(sleeper)


def test_a_process_exiting_within_the_grace_period_is_no_leak() -> None:
    run_id = f"leakcheck-{secrets.token_hex(4)}"
    quick = _start_tagged(run_id, "sleep", "0.3")
    try:
        started = time.monotonic()
        assert lc.leaked_processes(run_id, grace_s=10) == []
        assert time.monotonic() - started < 5  # it returned when the process went, not at the deadline
    finally:
        _stop(quick)


def test_the_checking_process_and_its_ancestors_are_not_leaks() -> None:
    """A check run by a tagged process under a tagged shell reports neither (the shell stays: `; true`)."""
    run_id = f"leakcheck-{secrets.token_hex(4)}"
    code = ("import os; from tests import leakcheck as lc; "
            "print(lc.leaked_processes(os.environ[lc.RUN_ENV], grace_s=0))")
    done = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{code}"; true'], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, lc.RUN_ENV: run_id})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_checking_process_s_own_resource_tracker_is_not_a_leak_but_a_child_left_running_is() -> None:
    """A test that uses multiprocessing in the pytest process (a run without xdist) starts its resource tracker,
    which exits when that process does; a child it started and left running is a leak, and is killed."""
    run_id = f"leakcheck-{secrets.token_hex(4)}"
    code = ("import os, subprocess; from multiprocessing import resource_tracker; from tests import leakcheck as lc; "
            "resource_tracker.ensure_running(); "
            "child = subprocess.Popen(['sleep', '60']); "
            "print(child.pid, resource_tracker._resource_tracker._pid); "
            "print(lc.left_running(os.environ[lc.RUN_ENV], grace_s=0)); "
            "print(child.wait(timeout=10))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, lc.RUN_ENV: run_id})
    assert done.returncode == 0, done.stderr
    pids, found, status = done.stdout.strip().splitlines()
    child, tracker = pids.split()
    assert f"pid {child}: sleep 60" in found and f"pid {tracker}:" not in found, found
    assert status == str(-signal.SIGKILL)


# --- live: one leak of each kind, in a namespace standing in for the machine --------------------------------


@pytest.mark.slow  # network namespaces entered with nsenter: `make test`
@pytest.mark.parametrize("with_nft", [False, True], ids=["without-nft", "with-nft"])
def test_each_kind_of_leak_is_named(with_nft: bool, tmp_path: Path) -> None:
    _require_root_and_ip()
    if with_nft:
        _require_nft()
    token = secrets.token_hex(3)
    third = int(token, 16) % 250 + 1
    bridge, table, run_id = f"tflcbr{token}", f"tflc{token}", f"leakcheck-{token}"
    mount_point, shm = tmp_path / "mnt", lc.SHM_DIR / f"tflc-{token}"
    mount_point.mkdir()
    with contextlib.ExitStack() as cleanup:
        machine = cleanup.enter_context(_scratch_netns(f"tflc{token}-a"))
        inside = ["ip", "netns", "exec", machine]
        _sh("ip", "-n", machine, "link", "set", "lo", "up")  # part of the baseline: routes need lo up
        before = lc.snapshot(netns=machine)

        # Inside the stand-in machine: a bridge, an nftables table, an address and a route, forwarding on.
        _sh("ip", "-n", machine, "link", "add", bridge, "type", "bridge")
        if with_nft:
            _sh(*inside, "nft", "add", "table", "inet", table)
        _sh("ip", "-n", machine, "addr", "add", f"10.254.{third}.1/24", "dev", "lo")
        _sh("ip", "-n", machine, "route", "add", f"10.253.{third}.0/24", "dev", "lo")
        _sh(*inside, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        # Machine-wide, but the test's own: a namespace, a mount, a /dev/shm folder and a process.
        other = cleanup.enter_context(_scratch_netns(f"tflc{token}-b"))
        _sh("mount", "-t", "tmpfs", "-o", "size=1m", "tflc", str(mount_point))
        cleanup.callback(_unmount, mount_point)
        shm.mkdir()
        cleanup.callback(shm.rmdir)
        sleeper = _start_tagged(run_id, "sleep", "60")
        cleanup.callback(_stop, sleeper)

        found = lc.leaks(before, lc.snapshot(netns=machine))
        report = "\n".join(found)
        assert _has_line(found, "network namespace", other, "left behind"), report
        assert _has_line(found, "bridge", bridge, "left behind"), report
        assert _has_line(found, "mount", str(mount_point.resolve()), "left behind"), report
        assert _has_line(found, str(shm), "left behind"), report
        assert _has_line(found, "routes changed", f"+ 10.253.{third}.0/24"), report
        assert _has_line(found, "addresses changed", f"10.254.{third}.1/24"), report
        assert _has_line(found, "forwarding sysctls changed", "+ net.ipv4.ip_forward = 1"), report
        if with_nft:
            assert _has_line(found, "nftables table", f"inet {table}", "left behind"), report
            assert _has_line(found, "nftables ruleset changed", table), report
        assert lc.leaked_processes(run_id, grace_s=0) == [f"pid {sleeper.pid}: sleep 60"]
        assert lc.kill_leaked(run_id) == [sleeper.pid]
        assert sleeper.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.slow  # network namespaces entered with nsenter: `make test`
def test_an_unchanged_namespace_shows_no_leaks() -> None:
    """Back-to-back snapshots compare equal, with lifetimes and nft counters ticking in between."""
    _require_root_and_ip()
    token = secrets.token_hex(3)
    third = int(token, 16) % 250 + 1
    nft = shutil.which("nft") is not None
    with _scratch_netns(f"tflc{token}-a") as machine:
        inside = ["ip", "netns", "exec", machine]
        _sh("ip", "-n", machine, "link", "set", "lo", "up")
        _sh("ip", "-n", machine, "addr", "add", f"10.254.{third}.1/24", "dev", "lo",
            "valid_lft", "300", "preferred_lft", "200")  # lifetimes count down between the snapshots
        if nft:
            _sh(*inside, "nft", "add", "table", "inet", f"tflc{token}")
            _sh(*inside, "nft", "add", "chain", "inet", f"tflc{token}", "out",
                "{ type filter hook output priority 0; }")
            _sh(*inside, "nft", "add", "rule", "inet", f"tflc{token}", "out", "counter")
        send = "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"
        for _attempt in range(3):
            first = lc.snapshot(netns=machine)
            time.sleep(1.1)
            _sh(*inside, sys.executable, "-c", send)  # moves the counter
            second = lc.snapshot(netns=machine)
            # Nobody else touches this namespace: its network state must compare equal every time ...
            network = ("bridges", "nft_tables", "routes", "addresses", "ruleset", "sysctls")
            assert {f: getattr(first, f) for f in network} == {f: getattr(second, f) for f in network}
            assert None not in (first.routes, first.addresses, first.sysctls, first.bridges)
            found = lc.leaks(first, second)
            if not found:
                break
            # ... but a test beside this one may add a namespace, mount or /dev/shm entry meanwhile: try again.
        assert found == []
