"""Which hosts of a gang still reach each other, from what the gang's own node agents measured (pure).

Each node agent probes every other node of its gang (a TCP connect to the peer agent's probe port, once per
`PROBE_INTERVAL_S`, infra/backends/reach_probe.py) and reports the peers it failed to reach in consecutive rounds.
A node of an N-node gang sends N - 1 probes a round: 127 per second in a 128-node gang (16,256 connects a second
across the gang, each a SYN, SYN-ACK, ACK and FIN of 60 bytes or so), and reports only when its set of unreachable
peers changes.

From those reports a pair of hosts is cut when either side failed to reach the other (a one-way loss breaks a
collective as surely as a two-way one). `find_cut` keeps the largest group of hosts that all reach each other
(ties: the group holding the gang's first host, which serves the rendezvous) and excludes the rest: the smaller
side of a cut between two groups.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

PROBE_INTERVAL_S = 1.0
"""How often a node agent probes each of its gang peers."""
PROBE_TIMEOUT_S = 1.0
"""How long one probe (a TCP connect) may take before the peer counts as unreached in that round."""
FAILED_ROUNDS = 2
"""Consecutive failed rounds before a peer is reported unreachable: a lost SYN is retransmitted after 1 s, so a
single slow round is not a cut. Detection: at most FAILED_ROUNDS x (PROBE_INTERVAL_S + PROBE_TIMEOUT_S) after it."""


def probes_per_round(nodes: int) -> int:
    """What one node sends each round in a gang of `nodes`: a connect to every other node."""
    return max(0, nodes - 1)


@dataclass(frozen=True, slots=True)
class Cut:
    """A gang's hosts split by the network: `keep` all reach each other, `exclude` are the rest (gang order)."""

    keep: tuple[str, ...]
    exclude: tuple[str, ...]
    broken: tuple[tuple[str, str], ...]
    """Every pair of hosts that could not reach each other (gang order within and across pairs)."""

    def describe(self) -> str:
        across = sum(1 for a, b in self.broken if (a in self.keep) != (b in self.keep))
        pairs = len(self.keep) * len(self.exclude)
        within = len(self.broken) - across
        return (f"hosts {', '.join(self.exclude)} cannot reach hosts {', '.join(self.keep)} ("
                + (f"all {pairs} pairs across the cut fail" if across == pairs else f"{across} of {pairs} pairs "
                   "across the cut fail") + (f"; {within} broken pairs within the sides" if within else "") + ")")

    def to_dict(self) -> dict[str, list[str] | list[list[str]]]:
        return {"keep": list(self.keep), "exclude": list(self.exclude), "broken": [list(p) for p in self.broken]}


def broken_pairs(nodes: Sequence[str], unreachable: Mapping[str, Collection[str]]) -> set[frozenset[str]]:
    """Each pair of the gang's hosts where either reported the other unreachable (hosts outside `nodes` ignored)."""
    members = set(nodes)
    return {frozenset((a, b)) for a, peers in unreachable.items() if a in members
            for b in peers if b in members and b != a}


SEARCH_BUDGET = 100_000
"""Steps of the exact search for the largest group before `find_cut` settles for the greedy one: a real cut (a
switch, a link between racks) leaves a few groups that each reach their own, found in a few dozen steps; only an
adversarial pattern of broken pairs in a large gang could need more."""


def find_cut(nodes: Sequence[str], unreachable: Mapping[str, Collection[str]]) -> Cut | None:
    """The cut the reports show, or None when every pair of hosts reaches each other. `nodes` in gang order
    (rank order: the first hosts the rendezvous); `unreachable[a]`: the peers host a reported it could not reach.

    The hosts kept are a largest group that all reach each other (ties: the one whose hosts come first in gang
    order), found exactly (Bron-Kerbosch with pivoting over the "reaches" graph) within SEARCH_BUDGET steps, else
    greedily: drop the host with the most broken pairs (ties: the later) until the rest all reach each other, then
    take back, in gang order, any dropped host that reaches every kept one. For a cut between groups that each
    reach their own (a switch, a link between racks) that is exactly the larger group."""
    broken = broken_pairs(nodes, unreachable)
    if not broken:
        return None
    order = {n: i for i, n in enumerate(nodes)}
    peers = {n: {m for m in nodes if m != n and frozenset((n, m)) not in broken} for n in nodes}
    keep = _largest_group(nodes, peers, order) or _greedy_group(nodes, peers, order)
    kept = set(keep)
    pairs = sorted((tuple(sorted(p, key=order.__getitem__)) for p in broken), key=lambda p: (order[p[0]], order[p[1]]))
    return Cut(tuple(keep), tuple(n for n in nodes if n not in kept), tuple((a, b) for a, b in pairs))


def _rank(group: Collection[str], order: Mapping[str, int]) -> tuple[int, list[int]]:
    """Bigger first, then earlier hosts first (as a sort key: smaller is better)."""
    return -len(group), sorted(order[n] for n in group)


def _largest_group(nodes: Sequence[str], peers: Mapping[str, set[str]], order: Mapping[str, int]) -> list[str] | None:
    """Exact: the best maximal clique of the reaches graph; None when the search ran past SEARCH_BUDGET steps."""
    best: list[str] = []
    steps = 0

    def expand(clique: list[str], candidates: set[str], excluded: set[str]) -> bool:
        nonlocal best, steps
        steps += 1
        if steps > SEARCH_BUDGET:
            return False
        if not candidates and not excluded:
            if not best or _rank(clique, order) < _rank(best, order):
                best = sorted(clique, key=order.__getitem__)
            return True
        if len(clique) + len(candidates) < len(best):
            return True  # cannot beat the best found
        pivot = max(candidates | excluded, key=lambda u: len(peers[u] & candidates))
        for v in sorted(candidates - peers[pivot], key=order.__getitem__):
            if not expand([*clique, v], candidates & peers[v], excluded & peers[v]):
                return False
            candidates = candidates - {v}
            excluded = excluded | {v}
        return True

    return best if expand([], set(nodes), set()) else None


def _greedy_group(nodes: Sequence[str], peers: Mapping[str, set[str]], order: Mapping[str, int]) -> list[str]:
    keep = list(nodes)
    while True:
        degree = {n: sum(1 for m in keep if m != n and m not in peers[n]) for n in keep}
        worst = max(keep, key=lambda n: (degree[n], order[n]))
        if degree[worst] == 0:
            break
        keep = [n for n in keep if n != worst]
    for n in nodes:
        if n not in keep and all(m in peers[n] for m in keep):
            keep = sorted([*keep, n], key=order.__getitem__)
    return keep
