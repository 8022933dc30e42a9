"""Small cluster builders and an invariant checker shared by the scheduler tests."""

from __future__ import annotations

import math

from trainforge.infra.scheduler import JobState, NodeInfo, Scheduler


def make_nodes(groups: list[tuple[str, int, int, int, str, bool]]) -> list[NodeInfo]:
    """groups: (gpu_type, nodes, gpus_per_node, nodes_per_rack, pool, spot)."""
    out = []
    for gi, (t, n, g, per_rack, pool, spot) in enumerate(groups):
        for i in range(n):
            out.append(NodeInfo(f"g{gi}-{i}", t, g, f"g{gi}-r{i // per_rack}", pool, spot))
    return out


def check_invariants(s: Scheduler) -> None:
    state = s.state
    held: dict[tuple[int, int], str] = {}
    for job in s.jobs.values():
        if job.state is JobState.PENDING:
            assert job.placement is None, f"pending {job.job_id} holds GPUs (partial gang)"
            assert all(job.job_id not in n.jobs for n in state.nodes)
            continue
        pl = job.placement
        assert pl is not None
        assert pl.num_gpus >= job.req.floor_gpus and pl.num_gpus <= job.req.num_gpus, "partial gang"
        types = {state.nodes[n].gpu_type for n, _ in pl.assignments}
        assert types == {pl.gpu_type}, f"{job.job_id} mixes GPU types {types}"
        assert pl.quality.tp_groups_spanning_nodes == 0
        for n, gpus in pl.assignments:
            mask = 0
            for g in gpus:
                assert (n, g) not in held, f"GPU {n}:{g} double-booked by {held[(n, g)]} and {job.job_id}"
                held[(n, g)] = job.job_id
                mask |= 1 << g
            assert state.nodes[n].jobs.get(job.job_id) == mask
    for node in state.nodes:
        used = 0
        for m in node.jobs.values():
            assert used & m == 0
            used |= m
        assert node.free_mask == ((1 << node.num_gpus) - 1) & ~used
        if node.healthy:
            assert node.idx in state.buckets[(node.gpu_type, node.pool)][node.free]
    for team, pol in s.teams.items():
        for t, cap in pol.quota.items():
            have = s.held(team) if t == "*" else s.held(team, t)
            assert have <= cap, f"team {team} holds {have} {t} GPUs over its quota {cap}"
    assert all(math.isfinite(j.start_time) for j in s.jobs.values() if j.state is not JobState.PENDING)
