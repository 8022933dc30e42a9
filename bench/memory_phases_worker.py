"""One torchrun worker for bench/memory_phases.py (run only through it): the bench/memory_vs_rss_worker.py training
loop with a memory probe at every phase boundary and at every block boundary inside forward and backward."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def malloc_counters() -> tuple[int, int, int]:
    """(in use, free but retained in arenas, mmapped) bytes, over all glibc arenas."""
    mi = _libc.mallinfo2()
    return mi.uordblks + mi.hblkhd, mi.fordblks, mi.hblkhd


def malloc_arenas() -> int:
    """Number of glibc arenas (malloc_info's <heap nr=...> entries): one per thread that allocated concurrently."""
    import tempfile

    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p  # a FILE*: the default int restype would truncate the pointer
    libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryFile("w+b") as f:
        fp = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        f.seek(0)
        return f.read().count(b"<heap nr=")


class Probe:
    def __init__(self) -> None:
        self.phases: list[dict] = []
        self._peak_in_use = 0
        self._lock = threading.Lock()
        self.trace: list[tuple[str, int]] | None = [] if os.environ.get("BENCH_TRACE") else None
        self._reset()

    def _reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0, proc(5))
        self._peak_in_use = malloc_counters()[0]

    def sample(self, where: str = "") -> None:
        in_use = malloc_counters()[0]
        with self._lock:
            self._peak_in_use = max(self._peak_in_use, in_use)
            if self.trace is not None:
                self.trace.append((where, in_use))

    def mark(self, phase: str) -> None:
        self.sample()
        in_use, free, mmapped = malloc_counters()
        self.phases.append({"phase": phase, "t": time.perf_counter(), "rss": rss_now(), "hwm": status_kib("VmHWM"), "in_use": in_use,
                            "free": free, "max_total": mmapped, "peak_in_use": self._peak_in_use})
        self._reset()


def live_tensor_bytes() -> dict[str, int]:
    """Unique storages of tensors Python can see (parameters, grads, optimizer state), by kind; autograd's saved
    tensors are not Python objects and are not counted here."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj).__module__.startswith("torch") and isinstance(obj, torch.Tensor) \
                    and obj.device.type == "cpu":
                t = obj.to_local() if hasattr(obj, "to_local") else obj
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        except Exception:  # noqa: BLE001 - meta/fake tensors etc.
            continue
    return {"count": len(seen), "MiB": sum(seen.values()) // 2**20}


def train(mode: str, cfg: dict, probe: Probe, steps: int, mb: int, seq: int) -> dict:
    import torch
    import torch.distributed as dist

    from trainforge.trainer.models.llama import build_model, rope_tables

    torch.manual_seed(0)
    if mode == "ddp":
        model = build_model(cfg)
    else:
        with torch.device("meta"):
            model = build_model(cfg)
    probe.mark("build")
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        reshard = mode != "fsdp-noreshard"
        for block in model.layers.values():
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        model.to_empty(device="cpu")
        model.init_weights()
        cos, sin = rope_tables(cfg["hidden"] // cfg["heads"], cfg["max_seq_len"], 10000.0)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
        wrapped = model
    probe.mark("wrap/shard")

    # Block boundaries: forward pre/post hooks; backward boundaries through tensor hooks on each block's input and
    # output (called when the gradient w.r.t. that tensor has been computed).
    def hooks(name: str) -> tuple:
        def fwd_pre(_m: object, args: tuple) -> None:
            probe.sample(f"fwd pre {name}")
            if isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                args[0].register_hook(lambda g: probe.sample(f"bwd done {name}"))

        def fwd_post(_m: object, _args: tuple, out: object) -> None:
            probe.sample(f"fwd post {name}")
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: probe.sample(f"bwd start {name}"))
        return fwd_pre, fwd_post

    named = {**{f"block {i}": b for i, b in model.layers.items()}, "output": model.output, "norm": model.norm}
    for name, block in named.items():
        pre, post = hooks(name)
        block.register_forward_pre_hook(pre)
        block.register_forward_hook(post)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.register_step_pre_hook(lambda *_: probe.sample("opt pre"))
    opt.register_step_post_hook(lambda *_: probe.sample("opt post"))
    probe.mark("optimizer built")
    tensors = {}
    for step in range(steps):
        tokens = torch.randint(0, cfg["vocab"], (mb, seq + 1))
        logits = wrapped(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        probe.sample("loss")
        probe.mark(f"{step} forward")
        loss.backward()
        probe.mark(f"{step} backward")
        opt.step()
        probe.mark(f"{step} optimizer step")
        opt.zero_grad(set_to_none=False)
        probe.mark(f"{step} zero_grad")
        if step == steps - 1:
            tensors = live_tensor_bytes()
    dist.barrier()
    return tensors


def main() -> None:
    probe = Probe()
    probe.mark("python idle")
    import torch  # noqa: F401
    import torch.distributed as dist

    probe.mark("import torch")
    mode, layers, hidden, heads, vocab, mb, seq = sys.argv[1], *map(int, sys.argv[2:8])
    dist.init_process_group("gloo")
    probe.mark("init_process_group")
    cfg = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads,
           "ffn_hidden": 256 * ((8 * hidden // 3 + 255) // 256), "vocab": vocab, "max_seq_len": seq}
    tensors = train(mode, cfg, probe, steps=int(os.environ.get("BENCH_STEPS", "3")), mb=mb, seq=seq)
    peak = max(p["hwm"] for p in probe.phases)
    gc.collect()
    out = {"rank": dist.get_rank(), "phases": probe.phases, "peak": peak, "tensors": tensors,
           "threads": threading.active_count(), "arenas": malloc_arenas()}
    out["threads"] = len(os.listdir("/proc/self/task"))
    if probe.trace is not None:
        out["trace"] = probe.trace
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, out)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
