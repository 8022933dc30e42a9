"""The pure half of per-job network sandboxes: addresses, routes and each host's filter (infra/network/sandbox.py)."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainforge.infra.network.sandbox import (
    SANDBOXES_PER_HOST,
    Host,
    NetworkLayout,
    NetworkLayoutError,
    Service,
    job_tag,
)

HOSTS = [Host(f"n{i}", f"192.168.50.{i + 1}") for i in range(4)]


def test_each_sandbox_gets_its_own_routed_slash30_inside_its_hosts_slash24() -> None:
    layout = NetworkLayout(HOSTS)
    a = layout.open("team-a/j1", ["n0", "n1"])
    b = layout.open("team-b/j2", ["n1", "n2"])
    boxes = [*a.values(), *b.values()]
    for box in boxes:
        net = ipaddress.ip_network(f"{box.gateway}/30", strict=False)
        assert ipaddress.ip_address(box.address) in net and box.address != box.gateway
        assert net.subnet_of(ipaddress.ip_network(layout.host_subnet(box.host)))
    assert len({box.address for box in boxes}) == len(boxes)
    # Two sandboxes on one host: distinct links and namespaces (nothing bridged between them).
    assert a["n1"].host_link != b["n1"].host_link and a["n1"].netns != b["n1"].netns
    assert layout.routes("n0") == [(layout.host_subnet(h.name), h.address) for h in HOSTS[1:]]


def test_grow_keeps_existing_sandboxes_and_a_closed_job_frees_its_slots() -> None:
    layout = NetworkLayout(HOSTS)
    first = layout.open("j", ["n0"])
    grown = layout.open("j", ["n0", "n3"])
    assert grown["n0"] == first["n0"]
    assert [s.host for s in layout.shrink("j", ["n3"])] == ["n3"]
    assert set(layout.sandboxes("j")) == {"n0"}
    gone = layout.close("j")
    assert gone == [first["n0"]] and layout.sandboxes("j") == {}
    assert layout.open("k", ["n0"])["n0"].address == first["n0"].address  # the slot is reused


def test_a_full_host_and_an_unknown_host_are_clear_errors() -> None:
    layout = NetworkLayout(HOSTS)
    for i in range(SANDBOXES_PER_HOST):
        layout.open(f"job-{i}", ["n0"])
    with pytest.raises(NetworkLayoutError, match="n0.*63 job sandboxes"):
        layout.open("one-more", ["n0"])
    with pytest.raises(NetworkLayoutError, match="'elsewhere' is not in the cluster description"):
        layout.open("j", ["elsewhere"])
    with pytest.raises(NetworkLayoutError, match="IPv4 network of /16 or wider"):
        NetworkLayout(HOSTS, sandbox_cidr="10.9.0.0/24")
    with pytest.raises(NetworkLayoutError, match="duplicate"):
        NetworkLayout([HOSTS[0], HOSTS[0]])


def test_the_ruleset_admits_only_same_job_pairs_services_and_replies() -> None:
    layout = NetworkLayout(HOSTS, services=[Service("192.168.50.254", 8333)])
    a = layout.open("team-a/j1", ["n0", "n1"])
    b = layout.open("team-b/j2", ["n1"])
    rules = layout.ruleset("n1")
    ta, tb = job_tag("team-a/j1"), job_tag("team-b/j2")
    assert f"elements = {{ {a['n0'].address}, {a['n1'].address} }}" in rules  # every host knows every member
    assert f"ip saddr @job_{ta} ip daddr @job_{ta} accept" in rules
    assert f"ip saddr @job_{tb} ip daddr @job_{tb} accept" in rules
    # Anti-spoofing for each local sandbox, ahead of the conntrack accept.
    for box in (a["n1"], b["n1"]):
        line = f'iifname "{box.host_link}" ip saddr != {box.address} drop'
        assert rules.index(line) < rules.index("ct state established,related accept")
    assert "ip daddr 192.168.50.254 tcp dport 8333 accept" in rules
    chain = rules[rules.index("chain between_sandboxes"):]
    assert chain.split("}")[0].strip().endswith("drop")  # no pair outside a job set passes
    # A host with no local sandbox still filters (it routes other hosts' sandbox traffic it must not forward).
    assert "jump between_sandboxes" in layout.ruleset("n3")
    assert rules.startswith("table inet trainforge\ndelete table inet trainforge\n")  # replaced atomically


@given(st.lists(st.tuples(st.integers(0, 7), st.sets(st.sampled_from([h.name for h in HOSTS]), min_size=1)),
                max_size=25))
def test_addresses_stay_unique_through_any_sequence_of_open_and_close(ops) -> None:
    layout = NetworkLayout(HOSTS)
    for job_no, hosts in ops:
        job = f"job-{job_no}"
        if layout.sandboxes(job) and job_no % 2:
            layout.close(job)
        else:
            layout.open(job, sorted(hosts))
        live = [box for host in HOSTS for box in layout.on_host(host.name)]
        assert len({b.address for b in live}) == len(live)
        for host in HOSTS:
            links = [b.host_link for b in layout.on_host(host.name)]
            assert len(set(links)) == len(links)
    for x, y in itertools.combinations({b.job for h in HOSTS for b in layout.on_host(h.name)}, 2):
        assert job_tag(x) != job_tag(y)


class _Shell:
    """Records what SandboxNetwork asks each host to run; fails the sandbox creation on one host."""

    def __init__(self, fail_on: str) -> None:
        self.fail_on, self.calls = fail_on, []

    def run(self, host, command, *, stdin=None, check=True):
        from trainforge.infra.network.netns import HostCommandError

        self.calls.append((host, command, stdin))
        if host == self.fail_on and command.startswith("ip netns add"):
            raise HostCommandError(f"host {host}: `{command}` failed (exit 1): RTNETLINK answers: File exists")
        return ""


def test_a_failed_open_leaves_no_sandbox_allocated_or_made() -> None:
    from trainforge.infra.network.netns import HostCommandError, SandboxNetwork

    shell = _Shell(fail_on="n1")
    net = SandboxNetwork(NetworkLayout(HOSTS), shell)  # type: ignore[arg-type]
    with pytest.raises(HostCommandError, match="n1"):
        net.open("j", ["n0", "n1"])
    assert net.layout.sandboxes("j") == {}
    removed = [host for host, cmd, _ in shell.calls if "ip netns del" in cmd]
    assert sorted(removed) == ["n0", "n1"]
    # The filters were put back without the job: the last ruleset each host got names no job set.
    last = {host: stdin for host, cmd, stdin in shell.calls if cmd == "nft -f -"}
    assert set(last) == {h.name for h in HOSTS} and not any("set job_" in rules for rules in last.values())
