"""trainforge.runtime in one process (world size 1, no torchrun): the data order, metric events, checkpoint round
trip through the platform's Checkpointer and the errors a script gets for wrong calls. The 2-rank job through the
platform is tests/distributed/test_script_runtime.py. Run: `.venv/bin/python -m pytest tests/distributed/test_runtime_unit.py -q`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.segment_configs import segment_config
from trainforge import runtime
from trainforge.contract.config import ENV_VAR, SegmentConfig
from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.registry.manifest import list_committed

pytestmark = pytest.mark.slow  # real DCP saves and segments (about 20 s): `make test`, not `make test-fast`


@pytest.fixture
def job_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SegmentConfig]:
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.demo import tiny_dataset

    ds = tiny_dataset(EmbeddedCatalog(tmp_path / "catalog"), "rt-tiny", num_samples=64, sample_len=17, seed=5)
    (tmp_path / "run").mkdir()
    cfg = segment_config(
        job_id="rt", team="t", name="rt", run_dir=str(tmp_path / "run"), storage_url=str(tmp_path / "store"),
        storage_prefix="teams/t/jobs/rt", staging_dir=str(tmp_path / "staging"), code_dir=str(tmp_path),
        code={"entrypoint": "train.py", "mode": "script", "framework": "pytorch", "args": []},
        layout={"dp": 1, "micro_batch_size": 2},
        training={"global_batch_size": 4, "seq_len": 8, "seed": 3, "precision": "fp32"}, total_steps=6,
        dataset={"path": str(ds.path), "ref": "main", "version": ds.version, "eval_fraction": 0.1},
        checkpoint_interval=2)
    write(tmp_path, cfg, monkeypatch)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    yield cfg
    if runtime._STATE is not None and not runtime._STATE.finished:  # a failing test must not leak its job
        runtime._STATE.metrics.close()
        if runtime._STATE.ckpt is not None:
            runtime._STATE.ckpt.close()
    runtime._STATE = None


def _copy(cfg: SegmentConfig, **fields: Any) -> SegmentConfig:
    return cfg.model_copy(update=fields)


def write(tmp: Path, cfg: SegmentConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp / f"cfg-{len(list(tmp.glob('cfg-*')))}.json"
    path.write_text(cfg.dump_json())
    monkeypatch.setenv(ENV_VAR, str(path))


def events(cfg: SegmentConfig) -> list[dict[str, Any]]:
    return read_events(Path(cfg.run_dir) / "events.jsonl")[0]


def test_outside_a_job_the_error_says_how_to_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    runtime._STATE = None
    with pytest.raises(runtime.RuntimeUsageError, match="code.mode: script"):
        runtime.init()
    with pytest.raises(runtime.RuntimeUsageError, match=r"init\(\) must be called first") as info:
        runtime.log_metrics(1, loss=1.0)
    from trainforge.trainer.worker import classify

    assert classify(info.value) == "user"  # the segment fails as the user's fault: no infrastructure retries


def test_data_loader_is_the_platforms_deterministic_order(job_config: SegmentConfig) -> None:
    from trainforge.datasets.catalog import load_version_dir
    from trainforge.datasets.sampler import SampleOrder
    from trainforge.datasets.stream import open_reader

    runtime.init(process_group=False)
    got = list(runtime.data_loader())
    ds = load_version_dir(Path(job_config.dataset.path), "main")
    order = SampleOrder(ds.manifest.num_samples, 0.1, ds.version, 3)
    reader = open_reader(ds.path, ds.manifest)
    assert [s for s, _ in got] == list(range(6))
    for step, rows in got:
        assert rows.dtype == np.int64 and rows.shape == (4, 9)
        np.testing.assert_array_equal(rows, reader.get(order.rank_slice(step, 4, 0, 1))[:, :9])
    # a data-parallel rank's share of the same step: the contiguous half of the global batch
    (_, half), = runtime.data_loader(start_step=2, end_step=3, dp_rank=1, dp_degree=2)
    np.testing.assert_array_equal(half, got[2][1][2:])
    with pytest.raises(runtime.RuntimeUsageError, match="dp_rank 2 is not in"):
        next(runtime.data_loader(dp_rank=2, dp_degree=2))
    with pytest.raises(runtime.RuntimeUsageError, match="not divisible by dp_degree"):
        next(runtime.data_loader(dp_rank=0, dp_degree=3))
    runtime.finish()


def test_metrics_events_and_their_errors(job_config: SegmentConfig) -> None:
    runtime.init(process_group=False)
    runtime.log_metrics(1, loss=torch.tensor(2.5), lr=np.float32(0.5), tokens=32)
    with pytest.raises(runtime.RuntimeUsageError, match="not a scalar"):
        runtime.log_metrics(2, loss=torch.ones(3))
    with pytest.raises(runtime.RuntimeUsageError, match="is not a number"):
        runtime.log_metrics(2, note="hello")
    with pytest.raises(runtime.RuntimeUsageError, match="platform checkpoints are PyTorch"):
        runtime.save_checkpoint(1, {})
    out = runtime.finish()
    assert out["step"] == 1 and out["reason"] == "segment_max_steps"  # 1 of 6 steps: not finished
    evs = events(job_config)
    metrics = [e for e in evs if e["type"] == "metrics"]
    assert [(m["step"], m["loss"], m["lr"], m["tokens"]) for m in metrics] == [(1, 2.5, 0.5, 32.0)]
    assert [e["type"] for e in evs if e["type"] != "metrics"] == ["segment_start", "segment_end"]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Embedding(260, 8), torch.nn.Linear(8, 260))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: np.ndarray) -> float:
    t = torch.from_numpy(rows)
    loss = torch.nn.functional.cross_entropy(model(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def test_checkpoint_round_trip_and_segments(job_config: SegmentConfig, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """Segment 1 (segment_max_steps 3) trains steps 1-3 and checkpoints at 2 and 3; segment 2 resumes at 3 and ends
    with the weights of an uninterrupted run."""
    def segment(cfg: SegmentConfig) -> tuple[dict[str, torch.Tensor], list[int]]:
        write(tmp_path, cfg, monkeypatch)
        runtime.init()
        torch.manual_seed(0)
        model, opt = _model()
        state = {"model": model, "optimizer": opt}
        with pytest.raises(runtime.RuntimeUsageError, match="state must be"):
            runtime.load_checkpoint({"model": model})
        with pytest.raises(runtime.RuntimeUsageError, match="not a torch.optim.Optimizer"):
            runtime.load_checkpoint({"model": model, "optimizer": model})
        start = runtime.load_checkpoint(state) or 0
        ran = []
        for step, rows in runtime.data_loader(start_step=start):
            runtime.log_metrics(step + 1, loss=_train(model, opt, rows))
            if runtime.checkpoint_due(step + 1):
                runtime.save_checkpoint(step + 1, state)
                if step + 1 == 4:  # a script about to edit weights outside optimizer.step() waits for the copy
                    assert runtime.wait_for_checkpoint_copy() >= 0.0
            ran.append(step)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model, opt, state
        runtime.finish()
        return weights, ran

    full, ran = segment(_copy(job_config, storage_prefix="teams/t/jobs/full",
                                  staging_dir=str(tmp_path / "staging-full")))
    assert ran == list(range(6))
    short = _copy(job_config, segment_max_steps=3)
    _, first = segment(short)
    resumed, second = segment(short)
    assert (first, second) == ([0, 1, 2], [3, 4, 5])
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    store = open_store(job_config.storage_url)
    assert [r.step for r in list_committed(store, "teams/t/jobs/rt")] == [2, 3, 4, 6]
    starts = [(e["step"], e["resumed_from"]) for e in events(job_config) if e["type"] == "segment_start"]
    assert starts == [(0, None), (0, None), (3, 3)]  # the full run, then the two segments
    ends = [(e["step"], e["reason"]) for e in events(job_config) if e["type"] == "segment_end"]
    assert ends == [(6, "finished"), (3, "segment_max_steps"), (6, "finished")]
    staged = [e for e in events(job_config) if e["type"] == "checkpoint_staged"]
    assert [e["step"] for e in staged] == [2, 4, 6, 2, 3, 4, 6]  # one per save, with the seconds it blocked
    assert all(e["blocked_s"] >= 0 for e in staged)


@pytest.mark.parametrize("spec_file", ["train_torch.yaml", "train_jax.yaml", "train_tf.yaml"])
def test_example_specs_validate_and_plan(spec_file: str) -> None:
    """The script-mode examples are valid jobs whether or not their framework is installed here."""
    import yaml

    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.tasks import prepare

    ensure_demo_dataset()
    folder = Path(__file__).resolve().parents[2] / "examples" / "script_mode"
    spec = prepare.validate_spec(yaml.safe_load((folder / spec_file).read_text()), spec_file, folder)
    assert spec.code.mode == "script" and (folder / spec.code.entrypoint).is_file()
    assert spec.code.framework == {"train_torch.yaml": "pytorch", "train_jax.yaml": "jax",
                                   "train_tf.yaml": "tensorflow"}[spec_file]
    plan = prepare.make_plan(spec)
    assert plan["layout"]["dp"] == 2 and plan["model"]["hidden"] == 64
