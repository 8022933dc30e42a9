"""The cut a gang's reachability reports show (trainforge/plan/reach.py): exhaustive over every set of broken pairs
of gangs of up to 5 hosts, and the clean cuts between two groups of up to 8."""

from __future__ import annotations

import itertools

import pytest

from trainforge.plan.reach import FAILED_ROUNDS, PROBE_INTERVAL_S, PROBE_TIMEOUT_S, find_cut, probes_per_round


def reports(broken: list[tuple[str, str]], one_way: bool) -> dict[str, set[str]]:
    """What the agents report for these broken pairs: both ends, or (one_way) only the first of each pair."""
    out: dict[str, set[str]] = {}
    for a, b in broken:
        out.setdefault(a, set()).add(b)
        if not one_way:
            out.setdefault(b, set()).add(a)
    return out


def _clique(hosts: tuple[str, ...] | list[str], broken: set[frozenset[str]]) -> bool:
    return all(frozenset(p) not in broken for p in itertools.combinations(hosts, 2))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_every_set_of_broken_pairs_gives_a_largest_group_that_all_reach_each_other(n):
    nodes = [f"h{i}" for i in range(n)]
    pairs = list(itertools.combinations(nodes, 2))
    for mask in range(1 << len(pairs)):
        broken = [p for i, p in enumerate(pairs) if mask >> i & 1]
        for one_way in (False, True):
            cut = find_cut(nodes, reports(broken, one_way))
            if not broken:
                assert cut is None
                continue
            assert cut is not None
            lost = {frozenset(p) for p in broken}
            assert sorted(cut.keep + cut.exclude) == nodes and not set(cut.keep) & set(cut.exclude)
            assert list(cut.keep) == [h for h in nodes if h in cut.keep]  # gang order
            assert cut.keep and _clique(cut.keep, lost)  # the kept hosts all reach each other
            assert not any(all(frozenset((x, k)) not in lost for k in cut.keep) for x in cut.exclude), \
                "an excluded host reaches every kept one"
            largest = max(len(c) for r in range(1, n + 1) for c in itertools.combinations(nodes, r)
                          if _clique(c, lost))
            assert len(cut.keep) == largest, (broken, cut)
            assert {frozenset(p) for p in cut.broken} == lost


@pytest.mark.parametrize("n", range(2, 9))
def test_a_cut_between_two_groups_keeps_the_larger_and_on_a_tie_the_one_with_the_first_host(n):
    nodes = [f"h{i}" for i in range(n)]
    for size in range(1, n):
        for side in itertools.combinations(nodes, size):
            other = [h for h in nodes if h not in side]
            broken = [(a, b) for a in side for b in other]
            cut = find_cut(nodes, reports(broken, one_way=False))
            assert cut is not None
            bigger = sorted([list(side), other], key=lambda g: (len(g), "h0" in g))[-1]
            assert list(cut.keep) == bigger
            assert f"cannot reach hosts {', '.join(bigger)}" in cut.describe()


def test_reports_about_hosts_outside_the_gang_are_ignored():
    assert find_cut(["a", "b"], {"a": {"z"}, "z": {"a", "b"}, "b": {"b"}}) is None


def test_the_probe_arithmetic_the_docs_quote():
    assert probes_per_round(128) == 127 and probes_per_round(1) == 0
    # detection bound: FAILED_ROUNDS rounds, each an interval plus a probe's timeout
    assert FAILED_ROUNDS * (PROBE_INTERVAL_S + PROBE_TIMEOUT_S) <= 4.0


def test_past_the_search_budget_a_greedy_group_still_all_reaches_each_other(monkeypatch):
    from trainforge.plan import reach

    monkeypatch.setattr(reach, "SEARCH_BUDGET", 1)
    nodes = [f"h{i}" for i in range(5)]
    pairs = list(itertools.combinations(nodes, 2))
    for mask in range(1, 1 << len(pairs)):
        broken = [p for i, p in enumerate(pairs) if mask >> i & 1]
        cut = find_cut(nodes, reports(broken, one_way=False))
        lost = {frozenset(p) for p in broken}
        assert cut is not None and cut.keep and _clique(cut.keep, lost)
        assert not any(all(frozenset((x, k)) not in lost for k in cut.keep) for x in cut.exclude)


def test_a_rack_cut_off_in_a_128_node_gang_is_found_exactly_and_at_once():
    import time

    nodes = [f"n{i:03d}" for i in range(128)]
    rack = nodes[32:48]  # one rack of 16 behind a failed switch
    broken = [(a, b) for a in rack for b in nodes if b not in rack]
    t = time.perf_counter()
    cut = find_cut(nodes, reports(broken, one_way=False))
    assert time.perf_counter() - t < 2.0
    assert cut is not None and list(cut.exclude) == rack and len(cut.keep) == 112
