"""`loop.train` itself (the real worker under torchrun: data feed, engine, LR schedule, checkpoints, events) under
DDP, FSDP and DeepSpeed ZeRO-2 on 2 gloo ranks trains like the single-process run of the same segment: per-step
losses and gradient norms from its `metrics` events and the weights of its last committed checkpoint, at the
layout tests' tolerances (conftest.assert_same). A few minutes on 2 cores.
Run: `.venv/bin/python -m pytest tests/distributed/test_train_loop.py -q`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.conftest import assert_same, run_torchrun
from tests.segment_configs import segment_config
from trainforge.contract.config import ENV_VAR, SegmentConfig
from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.registry.manifest import list_committed, materialize

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "teams/t/jobs/loop"
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab": 260}
STEPS = 4


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.demo import tiny_dataset

    return tiny_dataset(EmbeddedCatalog(tmp_path_factory.mktemp("catalog")), "loop-tiny", num_samples=200,
                        sample_len=17, seed=3)


def train_segment(tmp: Path, name: str, dataset: Any, layout: dict[str, Any],
                  engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one segment of `STEPS` steps with the real worker; losses and norms from its events, final weights from
    its committed checkpoint."""
    from trainforge.trainer.checkpoint import load_model_weights
    from trainforge.trainer.loop import build_model

    root = tmp / name
    (root / "run").mkdir(parents=True)
    cfg: SegmentConfig = segment_config(
        job_id=f"loop-{name}", team="t", name=name, run_dir=str(root / "run"), storage_url=str(root / "store"),
        storage_prefix=PREFIX, staging_dir=str(root / "staging"), model=MODEL,
        layout={"micro_batch_size": 2, **layout}, engine=engine or {"kind": "native"},
        # lr 1e-3: the bound assert_same's weight tolerance is derived for
        training={"global_batch_size": 8, "seq_len": 16, "precision": "fp32", "seed": 11, "grad_clip": 1.0,
                  "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
                  "lr_schedule": {"warmup_steps": 1, "decay": "cosine", "min_lr_ratio": 0.1}},
        total_steps=STEPS, checkpoint_interval=STEPS, collective_timeout_s=60.0,
        dataset={"path": str(dataset.path), "ref": "main", "version": dataset.version, "eval_fraction": 0.1})
    path = root / "cfg.json"
    path.write_text(cfg.dump_json())
    run_torchrun(layout["dp"], "trainforge.trainer.worker", [], timeout=300, env={ENV_VAR: str(path)})
    events, _ = read_events(Path(cfg.run_dir) / "events.jsonl")
    metrics = sorted((e for e in events if e["type"] == "metrics"), key=lambda e: e["step"])
    assert [e["step"] for e in metrics] == list(range(1, STEPS + 1))
    assert [e["reason"] for e in events if e["type"] == "segment_end"] == ["finished"]
    (ref,) = [r for r in list_committed(open_store(cfg.storage_url), PREFIX) if r.step == STEPS]
    folder = root / "final"
    assert materialize(open_store(cfg.storage_url), ref, folder) == []
    torch.manual_seed(123)  # a different init: the checkpoint must overwrite every weight
    model = build_model(cfg)
    load_model_weights(folder, model)
    return {"losses": [e["loss"] for e in metrics], "norms": [e["grad_norm"] for e in metrics],
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, dataset: Any) -> dict[str, Any]:
    return train_segment(tmp_path_factory.mktemp("ref"), "ref", dataset, {"dp": 1})


@pytest.mark.parametrize("sharding", ["none", "full-shard"], ids=["ddp", "fsdp"])
def test_train_under_ddp_and_fsdp_matches_the_single_process_run(tmp_path: Path, dataset: Any,
                                                                 reference: dict[str, Any], sharding: str) -> None:
    got = train_segment(tmp_path, sharding, dataset, {"dp": 2, "sharding": sharding})
    assert_same(got, reference)


@pytest.mark.usefixtures("deepspeed_builds_nothing")
def test_train_under_deepspeed_zero2_matches_the_single_process_run(tmp_path: Path, dataset: Any,
                                                                   reference: dict[str, Any]) -> None:
    pytest.importorskip("deepspeed")
    got = train_segment(tmp_path, "zero2", dataset, {"dp": 2, "sharding": "shard-grad-op"}, {"kind": "deepspeed"})
    assert_same(got, reference)
