"""No checkpoint loader unpickles arbitrary objects (issue 23, deliverable 3): DeepSpeed's readers and init_from.

`safe_deepspeed_load()` turns every `torch.load` DeepSpeed makes into a restricted load; a crafted pickle planted in
a DeepSpeed checkpoint file is refused before its payload runs, while DeepSpeed's own plain state (tensors, the
loss scaler, the ZeRO stage enum, fragment addresses) loads. The real resume through it is
tests/distributed/test_deepspeed_checkpoint.py. Run: `.venv/bin/python -m pytest tests/unit/test_no_unpickling.py -q`.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from trainforge.trainer.checkpointing.deepspeed_format import DEEPSPEED_GLOBALS, _resolve, safe_deepspeed_load
from trainforge.trainer.checkpointing.safe_dcp import UnsafeCheckpointError


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what an attacker writes: code that runs when the file is unpickled
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"loss_scaler": _Payload(marker)}}, bad)
    with safe_deepspeed_load(), pytest.raises(UnsafeCheckpointError, match=bad.name):
        torch.load(bad, map_location="cpu", weights_only=False)  # DeepSpeed's own call, weights_only=False
    assert not marker.exists()
    assert torch.load is torch.serialization.load  # the restriction ends with the block


def test_deepspeed_plain_state_loads() -> None:
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    assert all(_resolve(name) for name in DEEPSPEED_GLOBALS)
    state = {"module": {"w": torch.ones(2)}, "loss_scaler": LossScaler(scale=1.0), "zero_stage": ZeroStageEnum(2),
             "param_slice_mappings": [{"w": fragment_address(numel=2, start=0)}], "ds_version": "0.19.8"}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    with safe_deepspeed_load():
        out = torch.load(buf, map_location="cpu", weights_only=False)
    assert out["zero_stage"] == ZeroStageEnum(2) and out["loss_scaler"].cur_scale == 1.0
    assert torch.equal(out["module"]["w"], torch.ones(2))


def test_init_from_reads_safetensors_only(tmp_path: Path) -> None:
    """init_from weights: safetensors or nothing; a pickle named as the weights file is refused, never unpickled."""
    from safetensors.torch import save_file

    from trainforge.trainer.loop import UserCodeError, load_init_weights

    marker = tmp_path / "pwned"
    bad = tmp_path / "model.safetensors"
    torch.save({"weight": _Payload(marker)}, bad)
    model = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(UserCodeError, match="not a readable safetensors file"):
        load_init_weights(model, str(bad))
    assert not marker.exists()
    good = tmp_path / "good.safetensors"
    save_file({"weight": torch.full((2, 2), 3.0)}, str(good))
    load_init_weights(model, str(good))
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 3.0))
