"""The worker Checkpointer in one process (gloo not needed at world size 1): async save stages a copy that later
optimizer steps cannot change; a corrupt newest checkpoint is quarantined and the previous one loaded; a
malicious pickle in DCP metadata is refused; chunks unchanged between checkpoints are not uploaded again.

Run: .venv/bin/python -m pytest tests/integration/test_checkpoint_async.py -q
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.dedup import chunk_key
from trainforge.registry.manifest import list_committed
from trainforge.trainer.checkpoint import Checkpointer, load_model_weights
from trainforge.trainer.checkpointing.safe_dcp import UnsafeCheckpointError
from trainforge.trainer.distributed import DistContext

JOB = "teams/t/jobs/async"
CTX = DistContext(0, 1, 0, torch.device("cpu"), "gloo")


@pytest.fixture(autouse=True)
def _replicas(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_REPLICA_DIR", str(tmp_path / "shm"))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


def model_and_opt(frozen: bool = False, width: int = 256):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))
    if frozen:
        m[0].requires_grad_(False)
    return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)


def step(m, opt):
    opt.zero_grad()
    m(torch.randn(8, m[0].in_features)).pow(2).mean().backward()
    opt.step()


def snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def checkpointer(tmp_path, store, name="staging", commits=None):
    return Checkpointer(CTX, store, JOB, tmp_path / name,
                        lambda s, p, man: commits.append(man) if commits is not None else None)


def test_async_save_captures_the_state_at_save_time(tmp_path):
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    m, opt = model_and_opt()
    ck = checkpointer(tmp_path, store)
    step(m, opt)
    ck.save(1, m, opt, {})
    at_save = snapshot(m)
    for _ in range(3):  # the optimizer hook waits for staging before these change the weights
        step(m, opt)
    ck.close()
    m2, opt2 = model_and_opt()
    ck2 = checkpointer(tmp_path, store, "staging2")
    ref, skipped = ck2.latest()
    assert ref.step == 1 and skipped == []
    ck2.load(ref, m2, opt2)
    ck2.close()
    for k, v in at_save.items():
        assert torch.equal(m2.state_dict()[k], v)


def test_corrupt_newest_is_quarantined_and_previous_loaded(tmp_path):
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    m, opt = model_and_opt()
    ck = checkpointer(tmp_path, store)
    step(m, opt)
    ck.save(1, m, opt, {})
    ck.wait()
    first = snapshot(m)
    step(m, opt)
    ck.save(2, m, opt, {})
    ck.close()
    newest = list_committed(store, JOB)[-1]
    entry = next(f for f in newest.files if f["name"].endswith(".distcp"))
    path = store.local_path(chunk_key(JOB, entry["chunks"][-1][0], None))
    data = path.read_bytes()
    path.write_bytes(data[:-10] + bytes([data[-10] ^ 0x55]) + data[-9:])  # one flipped byte
    m2, opt2 = model_and_opt()
    ck2 = checkpointer(tmp_path, store, "fresh")  # no local copy: everything is read from the store
    ref, skipped = ck2.latest()
    assert ref.step == 1 and [s for s, _ in skipped] == [2]
    ck2.load(ref, m2, opt2)
    ck2.close()
    for k, v in first.items():
        assert torch.equal(m2.state_dict()[k], v)
    assert [r.step for r in list_committed(store, JOB)] == [1]


def test_malicious_metadata_pickle_is_refused(tmp_path):
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    m, opt = model_and_opt()
    ck = checkpointer(tmp_path, store)
    ck.save(1, m, opt, {})
    ck.close()
    folder = tmp_path / "staging" / "step-0000000001"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        load_model_weights(folder, model_and_opt()[0])
    assert "refused to unpickle posix.system" in str(info.value) or isinstance(info.value, UnsafeCheckpointError)
    assert not marker.exists()


def test_incremental_checkpoint_reuses_unchanged_chunks(tmp_path):
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    m, opt = model_and_opt(frozen=True, width=1024)  # 4 MB of frozen weights: several chunks
    commits: list[dict] = []
    ck = checkpointer(tmp_path, store, commits=commits)
    for s in (1, 2):
        step(m, opt)
        ck.save(s, m, opt, {})
        ck.wait()
    ck.close()
    full, incr = (c["dedup"] for c in commits)
    assert full["chunks_reused"] == 0 and full["bytes_written"] == full["bytes_logical"]
    assert incr["chunks_reused"] > 0 and incr["bytes_written"] < incr["bytes_logical"]
