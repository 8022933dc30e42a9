"""The worker Checkpointer in one process (gloo not needed at world size 1): async save stages a copy that later
optimizer steps cannot change; a corrupt newest checkpoint is quarantined and the previous one loaded; a
malicious pickle in DCP metadata is refused; chunks unchanged between checkpoints are not uploaded again.

Run: .venv/bin/python -m pytest tests/integration/test_checkpoint_async.py -q
"""

from __future__ import annotations

import os
import pickle
import threading

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


def checkpointer(tmp_path, store, name="staging", commits=None, guard_optimizer=True):
    return Checkpointer(CTX, store, JOB, tmp_path / name,
                        lambda s, p, man: commits.append(man) if commits is not None else None,
                        guard_optimizer=guard_optimizer)


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
    ref, skipped = ck2.restore(lambda r: ck2.load(r, m2, opt2))
    assert ref.step == 1 and [s for s, _ in skipped] == [2]
    assert "corrupt" in skipped[0][1][0]
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


@pytest.mark.parametrize("wait", ["explicit", "hook"])
def test_overlapped_copy_is_exactly_the_state_at_the_save_step(tmp_path, monkeypatch, wait):
    """The host copy of a save runs while the next forward/backward runs (held back here until they are done), and
    the loop waits for it right before the optimizer step — with the explicit `wait_staging()` call the managed
    loop makes (trainer/engine.py), or through the optimizer pre-step hook script mode keeps: both restores
    (in-memory replica, object store) give back bit for bit the parameters, BatchNorm statistics (which that forward pass changed) and AdamW state of the save step."""
    store = LocalObjectStore(tmp_path / "store").scoped(JOB)
    torch.manual_seed(0)

    def build():
        m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 64))
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    m, opt = build()
    ck = checkpointer(tmp_path, store, guard_optimizer=wait == "hook")
    for _ in range(2):
        step(m, opt)
    gate = threading.Event()
    copy = ck._stager.stage
    ck._stager.stage = lambda state: (gate.wait(60), copy(state))[1]
    ck.save(2, m, opt, {})
    expected_model = snapshot(m)
    expected_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    opt.zero_grad()
    m(torch.randn(8, 64)).pow(2).mean().backward()  # updates the BatchNorm running statistics in place
    assert not torch.equal(m[1].running_mean, expected_model["1.running_mean"])
    assert not ck._staging[1].done()  # the copy has not run yet: it overlaps forward/backward
    fut = ck._staging[1]
    result = fut.result

    def result_once_the_gate_opens(*args, **kwargs):
        # The gate opens 0.2 s after the loop starts waiting, so the wait lasts at least that long (a timer started
        # before the wait call opened it early by the call's own delay: 0.196 s on a loaded CI machine).
        threading.Timer(0.2, gate.set).start()
        return result(*args, **kwargs)

    fut.result = result_once_the_gate_opens
    if wait == "explicit":
        assert not opt._optimizer_step_pre_hooks  # no hidden hook: the loop's own call is the only wait
        ck.wait_staging()
        assert ck._staging is None
    opt.step()  # with the hook: the pre-step hook waits for the copy
    (staged_step, blocked), = ck.take_staged()
    assert staged_step == 2 and blocked >= 0.2  # the wait is counted for the save it belongs to
    for _ in range(2):
        if wait == "explicit":
            ck.wait_staging()
        step(m, opt)
    ck.wait()

    def check(m2, opt2):
        for k, v in expected_model.items():
            assert torch.equal(m2.state_dict()[k], v), k
        got = opt2.state_dict()["state"]
        for i, s in expected_optim.items():
            for k, v in s.items():
                assert torch.equal(got[i][k], v), (i, k)

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # an in-segment restart finds the replica in memory
    m2, opt2 = build()
    ck2 = checkpointer(tmp_path, store, "staging-mem")
    ref, _ = ck2.latest()
    assert ref.step == 2 and ck2.stats["restored_from"] == "memory"
    ck2.load(ref, m2, opt2)
    assert not (tmp_path / "staging-mem" / "memory").exists()  # read from the replica bytes, no folder written
    check(m2, opt2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    m3, opt3 = build()
    ck3 = checkpointer(tmp_path, store, "staging-store")
    ref, _ = ck3.latest()
    assert ref.step == 2 and ck3.stats["restored_from"] == "object_store"
    ck3.load(ref, m3, opt3)
    check(m3, opt3)
    for c in (ck, ck2, ck3):
        c.close()


def test_memory_reader_loads_bytes_and_refuses_a_malicious_pickle(tmp_path):
    """The in-memory restore path reads DCP files from bytes with the same allow-list unpickler as from disk."""
    import torch.distributed.checkpoint as dcp

    from trainforge.trainer.checkpointing.memory_fs import SafeMemoryReader
    from trainforge.trainer.checkpointing.replica import read_file
    from trainforge.trainer.checkpointing.safe_dcp import SafeLoadPlanner

    m, _ = model_and_opt()
    dcp.save({"model": m.state_dict()}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    files = {p.name: read_file(p) for p in (tmp_path / "ck").iterdir()}
    m2, _ = model_and_opt(width=256)
    for p in m2.parameters():
        torch.nn.init.zeros_(p)
    state = {"model": m2.state_dict()}
    dcp.load(state, storage_reader=SafeMemoryReader(files), planner=SafeLoadPlanner(), no_dist=True)
    for k, v in m.state_dict().items():
        assert torch.equal(state["model"][k], v)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    files[".metadata"] = torch.frombuffer(bytearray(pickle.dumps(Evil())), dtype=torch.uint8)
    with pytest.raises(BaseException) as info:
        dcp.load(state, storage_reader=SafeMemoryReader(files), planner=SafeLoadPlanner(), no_dist=True)
    assert "refused to unpickle posix.system" in str(info.value) or isinstance(info.value, UnsafeCheckpointError)
    assert not marker.exists()
