"""The DeepSpeed engine checkpoints and resumes like any other: DeepSpeed's own files (ZeRO-2 partitions) committed
through the platform's Checkpointer (manifest with sha256 per file, written last), resumed after a segment end and
after a killed worker, ending bitwise equal to an uninterrupted run; the offline evaluate/export path consolidates
the partitions. 2 gloo ranks, tiny Llama, the real worker under torchrun (about 2 minutes on 2 cores).
Run: `.venv/bin/python -m pytest tests/distributed/test_deepspeed_checkpoint.py -q`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.conftest import ROOT, free_port, run_torchrun
from tests.segment_configs import segment_config
from trainforge.contract.config import ENV_VAR, SegmentConfig
from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.registry.manifest import list_committed, materialize, verify

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "teams/t/jobs/ds"
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab": 260}


def _copy(cfg: SegmentConfig, **fields: Any) -> SegmentConfig:
    return cfg.model_copy(update=fields)


def make_config(tmp: Path, name: str, dataset: Any) -> SegmentConfig:
    root = tmp / name
    (root / "run").mkdir(parents=True)
    return segment_config(
        job_id=f"ds-{name}", team="t", name=name, run_dir=str(root / "run"), storage_url=str(root / "store"),
        storage_prefix=PREFIX, staging_dir=str(root / "staging"), model=MODEL,
        # 8 samples / (2 ranks x micro 2) = 2 micro-batches per rank: DeepSpeed's own accumulation is exercised
        # with full recomputation, which wraps every block: resume, consolidation and export see the wrapper
        layout={"dp": 2, "micro_batch_size": 2, "sharding": "shard-grad-op", "activation_checkpointing": "full"},
        engine={"kind": "deepspeed"},
        training={"global_batch_size": 8, "seq_len": 16, "precision": "fp32", "seed": 11, "grad_clip": 1.0,
                  "optimizer": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
                  "lr_schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1}},
        total_steps=6, checkpoint_interval=3, collective_timeout_s=60.0,
        dataset={"path": str(dataset.path), "ref": "main", "version": dataset.version, "eval_fraction": 0.1})


def worker(cfg: SegmentConfig, *, fault: str | None = None, expect_ok: bool = True) -> None:
    path = Path(cfg.run_dir) / f"cfg-{len(list(Path(cfg.run_dir).glob('cfg-*')))}.json"
    path.write_text(cfg.dump_json())
    env = {ENV_VAR: str(path), **({"TRAINFORGE_FAULT": fault} if fault else {})}
    if expect_ok:
        run_torchrun(2, "trainforge.trainer.worker", [], timeout=240, env=env)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--monitor-interval=0.2",
           "-m", "trainforge.trainer.worker"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode != 0, "the injected kill did not fail the segment"


def losses(cfg: SegmentConfig) -> dict[int, float]:
    events, _ = read_events(Path(cfg.run_dir) / "events.jsonl")
    return {e["step"]: e["loss"] for e in events if e["type"] == "metrics"}


def committed(cfg: SegmentConfig) -> dict[int, Any]:
    return {r.step: r for r in list_committed(open_store(cfg.storage_url), PREFIX)}


def final_weights(cfg: SegmentConfig, scratch: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    from trainforge.trainer.checkpoint import load_model_weights
    from trainforge.trainer.loop import build_model

    ref = committed(cfg)[cfg.total_steps]
    folder = scratch / f"{cfg.name}-step-{ref.step}"
    assert materialize(open_store(cfg.storage_url), ref, folder) == []  # every file sha256-checked
    torch.manual_seed(123)  # different init: the checkpoint must overwrite every weight
    model = build_model(cfg)
    load_model_weights(folder, model)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, deepspeed_builds_nothing: None) -> dict[str, SegmentConfig]:
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.demo import tiny_dataset

    tmp = tmp_path_factory.mktemp("ds")
    ds = tiny_dataset(EmbeddedCatalog(tmp / "catalog"), "ds-tiny", num_samples=200, sample_len=17, seed=3)
    clean = make_config(tmp, "clean", ds)
    worker(clean)
    resumed = make_config(tmp, "resumed", ds)
    worker(_copy(resumed, segment_max_steps=3))  # segment 1: steps 1-3, commits step 3, ends
    worker(resumed, fault="kill:rank=1:step=4", expect_ok=False)  # segment 2: step 4, then rank 1 is SIGKILLed
    worker(resumed)  # segment 3: resumes from the committed step 3 (step 4's work is lost), runs to 6
    return {"clean": clean, "resumed": resumed}


def test_manifest_lists_deepspeed_files_and_training_state(runs: dict[str, SegmentConfig]) -> None:
    cfg = runs["resumed"]
    refs = committed(cfg)
    assert sorted(refs) == [3, 6]
    m = refs[3].manifest
    names = {f["name"] for f in m["files"]}
    assert {"ds/mp_rank_00_model_states.pt", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng-rank00000.safetensors",
            "rng-rank00001.safetensors"} == names
    assert all(len(f["sha256"]) == 64 for f in m["files"])
    assert m["engine"] == "deepspeed" and m["deepspeed"]["zero_stage"] == 2
    assert m["step"] == 3 and m["sampler"]["position"] == 3 * 8
    assert m["rng"]["files"] == ["rng-rank00000.safetensors", "rng-rank00001.safetensors"]
    store = open_store(cfg.storage_url)
    assert all(verify(store, r) == [] for r in refs.values())


def test_resume_after_segment_end_and_kill_is_bitwise_equal(runs: dict[str, SegmentConfig], tmp_path: Path) -> None:
    clean, resumed = runs["clean"], runs["resumed"]
    events, _ = read_events(Path(resumed.run_dir) / "events.jsonl")
    starts = [e["resumed_from"] for e in events if e["type"] == "segment_start"]
    assert starts == [None, 3, 3], starts
    assert sorted(losses(clean)) == [1, 2, 3, 4, 5, 6]
    assert losses(resumed) == losses(clean)  # the last value per step: the resumed segment's (bitwise)
    _, a = final_weights(clean, tmp_path)
    _, b = final_weights(resumed, tmp_path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_offline_evaluate_and_export_consolidate_zero_partitions(runs: dict[str, SegmentConfig],
                                                                 tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = runs["clean"]
    folder, weights = final_weights(cfg, tmp_path)
    cfg_path = tmp_path / "job.json"
    cfg_path.write_text(cfg.dump_json())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def offline(*args: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-m", "trainforge.trainer.offline", *args, "--config", str(cfg_path),
                               "--checkpoint", str(folder)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    ev = offline("evaluate", "--batches", "2")
    assert 0 < ev["eval_loss"] < 7 and ev["eval_tokens"] > 0
    out = offline("export", "--out", str(tmp_path / "export"))
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert out["tensors"] == len(weights)
    for k, v in weights.items():
        assert torch.equal(exported[k], v), k
    # the consolidated weights are the trained ones: not the seed's initial weights
    from trainforge.trainer.loop import build_model

    torch.manual_seed(cfg.training.seed)
    init = build_model(cfg).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in weights.items())
