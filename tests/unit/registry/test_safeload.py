"""Safe loading: a real DCP checkpoint (model + optimizer, as the trainer saves it) loads through
SafeFileSystemReader + SafeLoadPlanner; a malicious pickle — in DCP's .metadata, in a non-tensor DCP item, or as a
torch weights file — is refused with a clear error and its payload never runs. safetensors load as plain tensors.

Run: .venv/bin/python -m pytest tests/unit/registry/test_safeload.py
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from trainforge.registry.safeload import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    check_checkpoint_folder,
    load_weights,
    safe_dcp_load,
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
    check_checkpoint_folder(tmp_path / "ck")


def test_malicious_dcp_metadata_refused(tmp_path):
    save_dcp(tmp_path / "ck")
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    state = {"model": torch.nn.Linear(4, 3).state_dict()}
    with pytest.raises(UnsafeCheckpointError, match=r"(posix|os)\.system, which is not a checkpoint metadata"):
        safe_dcp_load(state, tmp_path / "ck", no_dist=True)
    assert not marker.exists(), "the payload ran"


def test_malicious_dcp_byte_item_refused(tmp_path):
    marker = tmp_path / "pwned"
    save_dcp(tmp_path / "ck", {"extra": Payload(marker)})  # a non-tensor item is stored as a pickle
    assert not marker.exists()
    state = {"model": torch.nn.Linear(4, 3).state_dict(), "extra": None}
    with pytest.raises(UnsafeCheckpointError, match="checkpoint item extra would need arbitrary unpickling"):
        safe_dcp_load(state, tmp_path / "ck", no_dist=True)
    assert not marker.exists(), "the payload ran"


def test_malicious_torch_file_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump({"weight": Payload(marker)}, f)
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refused"):
        load_weights(path)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="pickle files"):
        check_checkpoint_folder(tmp_path)


def test_plain_weights_load(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    assert torch.equal(load_weights(tmp_path / "m.safetensors")["w"], torch.ones(2))
    torch.save({"w": torch.zeros(3)}, tmp_path / "m.pt")
    assert torch.equal(load_weights(tmp_path / "m.pt")["w"], torch.zeros(3))
