"""Safe DCP loading (trainer/checkpointing/safe_dcp.py, the reader every resume, restart and evaluation uses): a real
DCP checkpoint (model + optimizer, as the trainer saves it) loads through SafeFileSystemReader + SafeLoadPlanner; a
malicious pickle — in DCP's .metadata or in a non-tensor DCP item — is refused with a clear error and its payload
never runs. (The in-memory replica's reader: tests/integration/test_checkpoint_async.py; DeepSpeed's and init_from's
loaders: tests/unit/test_no_unpickling.py.)

Run: .venv/bin/python -m pytest tests/unit/test_safe_dcp.py
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainforge.trainer.checkpointing.safe_dcp import (
    SafeFileSystemReader,
    SafeLoadPlanner,
)


class Payload:
    """Unpickling this runs a command that creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_dcp(folder, extra=None):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), **(extra or {})}
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return model, opt


def test_dcp_checkpoint_loads_safely(tmp_path):
    model, opt = save_dcp(tmp_path / "ck", {"step": 7, "note": "plain"})
    fresh = torch.nn.Linear(4, 3)
    state = {"model": fresh.state_dict(), "step": 0, "note": ""}
    dcp.load(state, storage_reader=SafeFileSystemReader(tmp_path / "ck"), planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["step"] == 7 and state["note"] == "plain"


def _safe_load(state, folder):
    dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)


def test_malicious_dcp_metadata_refused(tmp_path):
    save_dcp(tmp_path / "ck")
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    state = {"model": torch.nn.Linear(4, 3).state_dict()}
    # DCP wraps a rank's error in CheckpointException (a BaseException), keeping the refusal's text
    with pytest.raises(BaseException, match=r"refused to unpickle (posix|os)\.system"):
        _safe_load(state, tmp_path / "ck")
    assert not marker.exists(), "the payload ran"


def test_malicious_dcp_byte_item_refused(tmp_path):
    marker = tmp_path / "pwned"
    save_dcp(tmp_path / "ck", {"extra": Payload(marker)})  # a non-tensor item is stored as a pickle
    assert not marker.exists()
    state = {"model": torch.nn.Linear(4, 3).state_dict(), "extra": None}
    # DCP wraps a rank's error in CheckpointException (a BaseException), keeping the refusal's text
    with pytest.raises(BaseException, match="checkpoint item extra would need arbitrary unpickling"):
        _safe_load(state, tmp_path / "ck")
    assert not marker.exists(), "the payload ran"
