"""Single-process jobs on a committed checkpoint, run by control-plane tasks as subprocesses (so the flow never
imports torch): `evaluate` (held-out loss and perplexity) and `export` (consolidated safetensors + config, a
Hugging Face Llama folder, and the MLmodel that makes the folder an MLflow pyfunc model: mlflow_model.py).

  python -m trainforge.trainer.offline evaluate --config job.json --checkpoint DIR [--batches N]
  python -m trainforge.trainer.offline export   --config job.json --checkpoint DIR --out DIR
Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from trainforge.contract.config import SegmentConfig
from trainforge.datasets.training_data import eval_samples
from trainforge.trainer.checkpoint import load_model_weights
from trainforge.trainer.loop import build_model
from trainforge.trainer.mlflow_model import write_mlmodel
from trainforge.trainer.models.hf_llama import save_hf_folder
from trainforge.trainer.models.llama import Llama


def _model(cfg: SegmentConfig, checkpoint: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(cfg)
    load_model_weights(checkpoint, model)
    return model.eval()


@torch.no_grad()
def evaluate(cfg: SegmentConfig, checkpoint: Path, batches: int, samples: Path | None = None) -> dict[str, float]:
    """Held-out loss of a checkpoint: on `samples` (a .npy the flow wrote, `training_data.eval_samples`), else read
    here from the pinned version (local use, e.g. `trainforge evaluate` with the data on disk)."""
    model = _model(cfg, checkpoint)
    micro = cfg.layout.micro_batch_size
    seq = cfg.training.seq_len
    if samples is not None:
        rows = np.load(samples)
    else:
        rows = eval_samples(cfg.dataset, cfg.training.seed, seq, batches * micro)
    if not len(rows):
        raise SystemExit("the dataset has no held-out samples: raise dataset.eval_fraction")
    total, count = 0.0, 0
    for i in range(0, len(rows), micro):
        tokens = torch.from_numpy(np.ascontiguousarray(rows[i : i + micro]))[:, : seq + 1]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += tokens[:, 1:].numel()
    mean = total / count
    return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0)), "eval_tokens": count}


def export(cfg: SegmentConfig, checkpoint: Path, out: Path) -> dict[str, object]:
    model = _model(cfg, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "job_id": cfg.job_id})
    (out / "config.json").write_text(json.dumps({"entrypoint": cfg.entrypoint, "model": cfg.model_args(),
                                                 "seq_len": cfg.training.seq_len}, indent=1))
    files = ["model.safetensors", "config.json"]
    if isinstance(model, Llama) and not cfg.model_args()["experts"]:
        # transformers' Llama layout beside trainforge's (a second copy of the weights, permuted and renamed).
        save_hf_folder(tensors, cfg.model_args(), out / "hf", max_seq_len=cfg.training.seq_len,
                       metadata={"job_id": cfg.job_id})
        files += ["hf/config.json", "hf/model.safetensors"]
    files += write_mlmodel(out, vocab=cfg.model_args()["vocab"], job_id=cfg.job_id)
    return {"files": files, "tensors": len(tensors), "parameters": sum(t.numel() for t in tensors.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="trainforge.trainer.offline")
    p.add_argument("command", choices=["evaluate", "export"])
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--out")
    p.add_argument("--samples", help="evaluate: a .npy of held-out samples (int64, n x seq_len+1)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = SegmentConfig.load(args.config)
    if args.command == "evaluate":
        result = evaluate(cfg, Path(args.checkpoint), args.batches, Path(args.samples) if args.samples else None)
    else:
        result = export(cfg, Path(args.checkpoint), Path(args.out))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    from trainforge.trainer.process_exit import exit_now

    exit_now(main())  # the flow waits on this process: skip the interpreter's teardown (process_exit.py)
