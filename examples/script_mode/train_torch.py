"""A user's own PyTorch training script, run by the platform in script mode (train_torch.yaml).

It owns its model, its DDP wrapper, its loop and its optimizer; `trainforge.runtime` gives it the platform's
process group, checkpoints (DCP, committed, resumable), the job's data in the deterministic order, and metric
logging. Run it through the platform:

    trainforge submit examples/script_mode/train_torch.yaml

Arguments (the spec's `code.args`): --lr-scale X multiplies the spec's learning rate.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge import runtime


class TinyCausalLM(nn.Module):
    """A small pre-norm transformer LM (torch's own encoder layer with a causal mask)."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.zeros(seq_len, hidden))
        layer = nn.TransformerEncoderLayer(hidden, heads, dim_feedforward=4 * hidden, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.out(self.norm(h))


def lr_at(step: int, job: runtime.Job, scale: float) -> float:
    """Warm-up then cosine, a pure function of the step: a resumed run continues the schedule exactly."""
    opt, sched = job.training["optimizer"], job.training["lr_schedule"]
    peak = opt["lr"] * scale
    warmup = sched["warmup_steps"]
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, job.total_steps - warmup))
    floor = sched["min_lr_ratio"]
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(job: runtime.Job, scale: float) -> int:
    torch.manual_seed(job.seed)  # every rank builds the same initial weights
    m = job.model
    model = DDP(TinyCausalLM(m["vocab"], m["hidden"], m["heads"], m["layers"], job.seq_len).to(job.device))
    opt_cfg = job.training["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]),
                                  eps=opt_cfg["eps"], weight_decay=opt_cfg["weight_decay"])
    state = {"model": model, "optimizer": optimizer}
    start = runtime.load_checkpoint(state) or 0
    micro = job.layout.get("micro_batch_size", 1)
    done = start
    for step, rows in runtime.data_loader(start_step=start):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, job, scale)
        tokens = torch.from_numpy(rows).to(job.device)
        chunks = tokens.split(micro)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=job.device)
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            # Gradient accumulation: only the last micro-batch all-reduces.
            with model.no_sync() if not last else contextlib.nullcontext():
                logits = model(chunk[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()) / len(chunks)
                loss.backward()
            total += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), job.training.get("grad_clip") or 1.0)
        optimizer.step()
        dist.all_reduce(total)  # the global loss, the same on every rank
        runtime.log_metrics(step + 1, loss=total / job.world_size, grad_norm=grad_norm,
                            lr=optimizer.param_groups[0]["lr"])
        if runtime.checkpoint_due(step + 1):
            runtime.save_checkpoint(step + 1, state)
        done = step + 1
    return done


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr-scale", type=float, default=1.0)
    args = parser.parse_args()
    job = runtime.init()
    done = train(job, args.lr_scale)  # the model is freed when train() returns: then the clean shutdown
    runtime.finish(done)


if __name__ == "__main__":
    main()
