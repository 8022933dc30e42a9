"""Pipeline schedules as per-rank operation lists, and a simulator that times them.

Two kinds of schedule are here:
- The ones trainforge's engine runs (`trainer/parallel/pp.py`: torch.distributed.pipelining's GPipe, 1F1B and
  interleaved 1F1B). Their sends and receives are asynchronous (batched isend/irecv, waited for just before the
  data is needed), so a rank's operation waits only for the data it consumes: a forward for the previous stage's
  forward of the same micro-batch, a backward for the next stage's backward of it.
- The ones the published runs used (Megatron-LM's 1F1B, DeepSpeed's TrainSchedule). Their point-to-point calls
  block the rank until the peer posts the matching call (a rendezvous), so each communication is an operation of
  its own, taking `transfer` seconds once both sides have posted it.

The interleaved order is torch's own (`ScheduleInterleaved1F1B._calculate_single_rank_operations`, a private method
of the pinned torch 2.13: if it changes, these tests fail rather than pass on a stale copy). The single-stage
orders are transcribed from the code named at each function.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Compute:
    kind: str  # "F" or "B"
    stage: int  # global stage (chunk) index, 0 .. p*v - 1
    micro_batch: int


@dataclass(frozen=True)
class Comm:
    """A blocking call: completes when every message in it is posted by both ends, then takes one transfer."""

    messages: tuple[tuple[tuple[str, int, int], str], ...]
    """((what, from_stage, micro_batch), "s" or "r")."""


Op = Compute | Comm


@dataclass
class Timeline:
    makespan: float
    peak_in_flight: dict[int, float] = field(default_factory=dict)
    """Per rank: the most micro-batches whose forward has run and backward has not, in stage-sized units
    (an interleaved chunk holds 1/v of the rank's layers)."""


def torch_gpipe(p: int, m: int) -> dict[int, list[Op]]:
    """ScheduleGPipe._step_microbatches: every forward, then every backward."""
    return {r: [Compute("F", r, k) for k in range(m)] + [Compute("B", r, k) for k in range(m)] for r in range(p)}


def torch_1f1b(p: int, m: int) -> dict[int, list[Op]]:
    """Schedule1F1B._step_microbatches: min(m, p - stage) warm-up forwards, then backward-forward pairs while
    forwards remain, then the remaining backwards."""
    out: dict[int, list[Op]] = {}
    for r in range(p):
        warmup = min(m, p - r)
        ops: list[Op] = [Compute("F", r, k) for k in range(warmup)]
        f, b = warmup, 0
        while f < m:
            ops += [Compute("B", r, b), Compute("F", r, f)]
            b, f = b + 1, f + 1
        ops += [Compute("B", r, k) for k in range(b, m)]
        out[r] = ops
    return out


def torch_interleaved(p: int, v: int, m: int) -> dict[int, list[Op]]:
    """torch's ScheduleInterleaved1F1B order for p ranks holding v chunks each. Raises ValueError where torch's
    constructor does (m not a multiple of its number of rounds)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    # The constructor needs live pipeline stages; the order is a pure function of these four numbers, set as the
    # constructor sets them.
    sched = object.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    if m % sched.number_of_rounds:
        raise ValueError(f"torch refuses {m} micro-batches in {sched.number_of_rounds} rounds")
    out: dict[int, list[Op]] = {}
    for r in range(p):
        ops: list[Op] = []
        for action in sched._calculate_single_rank_operations(r):
            if action is None:
                continue
            name = action.computation_type.name
            if name not in ("FORWARD", "FULL_BACKWARD"):
                raise AssertionError(f"unexpected action {action} in torch's interleaved 1F1B")
            ops.append(Compute("F" if name == "FORWARD" else "B", action.stage_index, action.microbatch_index))
        out[r] = ops
    return out


def megatron_1f1b(p: int, m: int) -> dict[int, list[Op]]:
    """Megatron-LM's forward_backward_pipelining_without_interleaving (megatron/core/pipeline_parallel/schedules.py):
    p - 1 - stage warm-up forwards, each followed by send_forward; then forward, send_forward_recv_backward,
    backward, send_backward_recv_forward (batched: both messages in one call); then cool-down backwards."""
    return {r: _megatron_rank(p, m, r) for r in range(p)}


Message = tuple[tuple[str, int, int], str]


def _megatron_rank(p: int, m: int, r: int) -> list[Op]:
    first, last = r == 0, r == p - 1
    ops: list[Op] = []

    def comm(*parts: Message | None) -> None:
        msgs = tuple(x for x in parts if x is not None)
        if msgs:
            ops.append(Comm(msgs))

    def recv_fwd(k: int) -> Message | None:
        return None if first else (("act", r - 1, k), "r")

    def send_fwd(k: int) -> Message | None:
        return None if last else (("act", r, k), "s")

    def recv_bwd(k: int) -> Message | None:
        return None if last else (("grad", r + 1, k), "r")

    def send_bwd(k: int) -> Message | None:
        return None if first else (("grad", r, k), "s")

    warmup = min(p - r - 1, m)
    for k in range(warmup):
        comm(recv_fwd(k))
        ops.append(Compute("F", r, k))
        comm(send_fwd(k))
    steady = m - warmup
    if steady:
        comm(recv_fwd(warmup))
    for k in range(steady):
        ops.append(Compute("F", r, warmup + k))
        comm(send_fwd(warmup + k), recv_bwd(k))
        ops.append(Compute("B", r, k))
        comm(send_bwd(k), None if k == steady - 1 else recv_fwd(warmup + k + 1))
    for k in range(steady, m):
        comm(recv_bwd(k))
        ops.append(Compute("B", r, k))
        comm(send_bwd(k))
    return ops


def deepspeed_train(p: int, m: int) -> dict[int, list[Op]]:
    """DeepSpeed's TrainSchedule.steps (deepspeed/runtime/pipe/schedule.py): 2(m + p - 1) lock-step steps; at each,
    a stage exchanges with one neighbour (blocking p2p.send / p2p.recv, one message per call), then runs a forward
    (even stages on even steps, odd stages on odd steps) or a backward."""
    out: dict[int, list[Op]] = {}
    for r in range(p):
        ops: list[Op] = []
        prev = -1
        for step in range(2 * (m + p - 1)):
            forward = (step % 2) == (r % 2)
            if forward:
                k = (step if step % 2 == 0 else step - 1) // 2 - r // 2
            elif step % 2 == 0:
                k = step // 2 - p + (r + 1) // 2
            else:
                k = (step - 1) // 2 - p + 1 + r // 2
            valid, prev_valid = 0 <= k < m, 0 <= prev < m
            if forward and r > 0:
                if valid:
                    ops.append(Comm(((("act", r - 1, k), "r"),)))
                if prev_valid:
                    ops.append(Comm(((("grad", r, prev), "s"),)))
            elif not forward and r < p - 1:
                if prev_valid:
                    ops.append(Comm(((("act", r, prev), "s"),)))
                if valid:
                    ops.append(Comm(((("grad", r + 1, k), "r"),)))
            if valid:
                ops.append(Compute("F" if forward else "B", r, k))
            prev = k
        out[r] = ops
    return out


def simulate(order: dict[int, list[Op]], *, stages: int, v: int = 1, forward: float = 1.0, backward: float = 2.0,
             transfer: float = 0.0) -> Timeline:
    """Run every rank's operations in its order, each as early as its dependencies allow. A chunk's forward takes
    forward / v, its backward backward / v. Compute waits for the data it consumes; Comm for both ends."""
    finished: dict[tuple[str, int, int], float] = {}
    posted: dict[tuple[tuple[str, int, int], str], float] = {}
    clock = dict.fromkeys(order, 0.0)
    pos = dict.fromkeys(order, 0)
    left = sum(len(ops) for ops in order.values())
    while left:
        moved = False
        for rank, ops in order.items():
            while pos[rank] < len(ops):
                op = ops[pos[rank]]
                if isinstance(op, Compute):
                    deps = _data_deps(op, stages)
                    if any(d not in finished for d in deps):
                        break
                    start = max([clock[rank], *(finished[d] for d in deps)])
                    clock[rank] = start + (forward if op.kind == "F" else backward) / v
                    finished[(op.kind, op.stage, op.micro_batch)] = clock[rank]
                else:
                    for msg in op.messages:
                        posted.setdefault(msg, clock[rank])
                    peers = [(key, "r" if role == "s" else "s") for key, role in op.messages]
                    if any(peer not in posted for peer in peers):
                        break
                    clock[rank] = max([clock[rank], *(posted[peer] for peer in peers)]) + transfer
                pos[rank] += 1
                left -= 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocks: " + ", ".join(
                f"rank {r} at {order[r][pos[r]]}" for r in order if pos[r] < len(order[r])))
    return Timeline(max(clock.values()), {r: _peak(ops, v) for r, ops in order.items()})


def _data_deps(op: Compute, stages: int) -> list[tuple[str, int, int]]:
    if op.kind == "F":
        return [("F", op.stage - 1, op.micro_batch)] if op.stage > 0 else []
    return [("F", op.stage, op.micro_batch)] + ([("B", op.stage + 1, op.micro_batch)] if op.stage < stages - 1
                                                 else [])


def _peak(ops: Iterable[Op], v: int) -> float:
    live = peak = 0
    for op in ops:
        if isinstance(op, Compute):
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
    return peak / v
