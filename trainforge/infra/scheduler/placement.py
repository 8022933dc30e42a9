"""Topology-aware gang placement (pure).

Ranks fill the chosen nodes in order, tensor-parallel fastest, then pipeline stages, then data-parallel
replicas (Megatron's order). So:
- a TP group stays inside one node whenever the per-node GPU count `g` is a multiple of tp (always required);
- a pipeline (tp*pp consecutive ranks) covers ceil(tp*pp / g) consecutive nodes: racks are filled with whole
  pipelines, so pipelines stay inside a rack and only data-parallel traffic crosses racks;
- least fragmentation: one node -> best fit (the node with the fewest free GPUs that fits); several nodes -> the
  fullest rack that holds the whole gang, else the fewest racks (largest first, best fit for the remainder),
  and inside a rack the nodes with the fewest free GPUs. Whole nodes and whole racks stay free for big gangs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from trainforge.infra.scheduler.model import Placement, PlacementQuality
from trainforge.infra.scheduler.state import ClusterState

_NO_BLOCK: frozenset[int] = frozenset()


def per_node_candidates(num_gpus: int, tp: int, max_per_node: int, requested: int | None) -> list[int]:
    """GPUs per node to try, best first: the requested count, else the largest divisors of num_gpus that are
    multiples of tp (fewest nodes)."""
    if requested is not None:
        g = min(requested, num_gpus)
        return [g] if g <= max_per_node else []
    return [d for d in range(min(num_gpus, max_per_node), 0, -1) if num_gpus % d == 0 and d % tp == 0][:3]


def lowest_bits(mask: int, count: int) -> tuple[int, ...]:
    out = []
    i = 0
    while len(out) < count:
        if mask >> i & 1:
            out.append(i)
        i += 1
    return tuple(out)


def compute_quality(state: ClusterState, assignments: Sequence[tuple[int, tuple[int, ...]]], tp: int,
                    pp: int) -> PlacementQuality:
    node_of: list[int] = []  # rank -> position in assignments (only built when needed)
    sizes = [len(g) for _, g in assignments]
    num = sum(sizes)
    uniform = len(set(sizes)) == 1
    g = sizes[0]

    def pos(rank: int) -> int:
        if uniform:
            return rank // g
        if not node_of:
            for p, s in enumerate(sizes):
                node_of.extend([p] * s)
        return node_of[rank]

    tp_groups = num // tp
    tp_span = 0 if uniform and g % tp == 0 else sum(pos(k * tp) != pos(k * tp + tp - 1) for k in range(tp_groups))
    racks = [state.nodes[n].rack for n, _ in assignments]
    pp_groups = num // (tp * pp) if pp > 1 else 0
    pp_span = 0
    if pp > 1:
        span = tp * pp
        pp_span = sum(len({racks[p] for p in range(pos(j * span), pos(j * span + span - 1) + 1)}) > 1
                      for j in range(pp_groups))
    partial = sum(1 for n, gpus in assignments if state.nodes[n].free > len(gpus))
    return PlacementQuality(len(assignments), len(set(racks)), tp_groups, tp_span, pp_groups, pp_span, partial)


def _single_node(state: ClusterState, gpu_type: str, g: int, pools: Sequence[str],
                 blocked: Collection[int]) -> int | None:
    top = state.max_gpus_per_node[gpu_type]
    for k in range(g, top + 1):
        best = None
        for p in pools:
            bucket = state.buckets.get((gpu_type, p))
            if not bucket or not bucket[k]:
                continue
            cand = min((i for i in bucket[k] if i not in blocked), default=None) if blocked else min(bucket[k])
            if cand is not None and (best is None or cand < best):
                best = cand
        if best is not None:
            return best
    return None


def _multi_node(state: ClusterState, gpu_type: str, g: int, n: int, unit: int, pools: Sequence[str],
                blocked: Collection[int]) -> list[int] | None:
    nodes = state.nodes
    per_rack: list[tuple[int, list[int]]] = []
    total = 0
    for p in pools:
        for r in state.racks_of.get((gpu_type, p), ()):
            elig = [i for i in state.racks[r].nodes
                    if nodes[i].healthy and nodes[i].free_mask.bit_count() >= g and i not in blocked]
            if elig:
                per_rack.append((r, elig))
                total += len(elig)
    if total < n:
        return None
    elig_of = dict(per_rack)
    take: dict[int, int] = {}  # rack -> nodes taken there
    fits = [(len(e), r) for r, e in per_rack if len(e) >= n]
    if fits:
        take[min(fits)[1]] = n
    else:
        contrib = sorted(((len(e) // unit * unit, r) for r, e in per_rack), key=lambda c: (-c[0], c[1]))
        remaining = n
        for _ in range(len(contrib)):
            avail = [c for c in contrib if c[1] not in take and c[0] > 0]
            if not avail or remaining <= 0:
                break
            enough = [c for c in avail if c[0] >= remaining]
            cnt, r = min(enough) if enough else avail[0]
            take[r] = remaining if enough else cnt
            remaining -= take[r]
        for r, e in per_rack:  # whole pipelines do not fit in racks: fill leftovers (a pipeline spans racks)
            if remaining <= 0:
                break
            k = min(len(e) - take.get(r, 0), remaining)
            if k > 0:
                take[r] = take.get(r, 0) + k
                remaining -= k
    chosen: list[int] = []
    for r, k in take.items():
        chosen.extend(sorted(elig_of[r], key=lambda i: (nodes[i].free_mask.bit_count(), i))[:k])
    return chosen if len(chosen) == n else None


def find_placement(state: ClusterState, gpu_type: str, num_gpus: int, *, tp: int = 1, pp: int = 1,
                   gpus_per_node: int | None = None, pools: Sequence[str],
                   blocked: Collection[int] = _NO_BLOCK) -> Placement | None:
    """Place `num_gpus` GPUs of one type on nodes of `pools` (in preference order), or None. Pure: reads state."""
    top = state.max_gpus_per_node.get(gpu_type)
    if top is None:
        return None
    for g in per_node_candidates(num_gpus, tp, top, gpus_per_node):
        n = num_gpus // g
        if state.nodes_with_free(gpu_type, pools, g) < n:
            continue
        if n == 1:
            idx = _single_node(state, gpu_type, g, pools, blocked)
            chosen = None if idx is None else [idx]
        else:
            unit = max(1, -(-tp * pp // g))
            chosen = _multi_node(state, gpu_type, g, n, unit, pools, blocked)
        if chosen is None:
            continue
        chosen.sort(key=lambda i: (state.nodes[i].rack, i))
        assignments = tuple((i, lowest_bits(state.nodes[i].free_mask, g)) for i in chosen)
        return Placement(gpu_type, assignments, compute_quality(state, assignments, tp, pp))
    return None
