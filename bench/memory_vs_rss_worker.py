"""One torchrun worker for bench/memory_vs_rss.py: train a small Llama (trainforge's reference model) for a few
steps with DDP or FSDP2 (full-shard or reshard_after_forward=False) over gloo on CPU, fp32 + AdamW, and report
this process's peak RSS, its baseline (after `import torch` + init_process_group, before the model) and the bytes
glibc holds freed in its arenas after training. Run only through bench/memory_vs_rss.py."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import sys


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_free_bytes() -> int:
    """Bytes glibc malloc holds in its arenas after free() (mallinfo2 fordblks): resident, but no live tensor."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


def train(mode: str, cfg: dict, steps: int, mb: int, seq: int) -> int:
    """Train; return the bytes glibc holds freed at the end, while the model and optimizer are still alive."""
    import torch
    import torch.distributed as dist

    from trainforge.trainer.models.llama import build_model

    torch.manual_seed(0)
    if mode == "ddp":
        model = build_model(cfg)
    else:
        # The platform's FSDP path: build on the meta device, shard, then materialise only the local shards.
        with torch.device("meta"):
            model = build_model(cfg)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        # fsdp = full-shard, fsdp-noreshard = shard-grad-op, as trainforge/trainer/parallel/fsdp.py maps them.
        reshard = mode == "fsdp"
        for block in model.layers.values():
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=False)
        model.to_empty(device="cpu")
        model.init_weights()
        cos, sin = model.rope_cos, model.rope_sin
        from trainforge.trainer.models.llama import rope_tables

        cos2, sin2 = rope_tables(cfg["hidden"] // cfg["heads"], cfg["max_seq_len"], 10000.0)
        cos.copy_(cos2)
        sin.copy_(sin2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        tokens = torch.randint(0, cfg["vocab"], (mb, seq + 1))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    retained = malloc_free_bytes()
    dist.barrier()
    return retained


def main() -> None:
    import torch
    import torch.distributed as dist

    mode, layers, hidden, heads, vocab, mb, seq = sys.argv[1], *map(int, sys.argv[2:8])
    dist.init_process_group("gloo")
    baseline = rss_now()
    cfg = {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads,
           "ffn_hidden": 256 * ((8 * hidden // 3 + 255) // 256), "vocab": vocab, "max_seq_len": seq}
    retained = train(mode, cfg, steps=3, mb=mb, seq=seq)
    peak = rss_peak()
    gc.collect()
    results = [None, None]
    dist.all_gather_object(results, {"rank": dist.get_rank(), "peak": peak, "baseline": baseline,
                                  "retained": retained})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    del torch


if __name__ == "__main__":
    main()
