"""The flow's TensorBoard files (registry/tensorboard.py) are TensorBoard's own format: read back here by
TensorBoard's reader (`EventAccumulator`, which checks every record's CRC-32C), with the steps, tags and values
written, NaN included; a second flow run of the same job adds a file; a label is not a scalar. The files of a real
job (written by the flow, logged to its MLflow run, named in its report) are checked in
tests/integration/test_train_job.py.

Run: .venv/bin/python -m pytest tests/unit/test_tensorboard_files.py -q
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest

from trainforge.registry.tensorboard import ScalarLog, crc32c, tfrecord

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _read(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_crc32c_is_the_castagnoli_checksum():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0 and crc32c(b"123456789") != zlib.crc32(b"123456789")
    record = tfrecord(b"payload")
    assert len(record) == 8 + 4 + len(b"payload") + 4 and record[12:19] == b"payload"


def test_tensorboard_reads_what_the_flow_writes(tmp_path):
    clock = iter(range(1_000, 2_000)).__next__
    log = ScalarLog(tmp_path / "tb", clock=lambda: float(clock()))
    log.add([(1, {"loss": 5.5, "lr": 3e-4, "grad_norm": 1.25, "tokens_per_s": 12345.0}),
             (2, {"loss": 5.25, "lr": 6e-4, "straggler_rank": 1, "phase": "warmup", "diverged": True})])
    log.add([(2, {"eval_loss": 5.0, "eval_perplexity": math.exp(5.0)}), (3, {"loss": float("nan")})])
    log.add([])
    assert [p.name.startswith("events.out.tfevents.") for p in (tmp_path / "tb").iterdir()] == [True]
    got = _read(tmp_path / "tb")
    assert got["loss"][:2] == [(1, 5.5), (2, 5.25)] and math.isnan(got["loss"][2][1]) and got["loss"][2][0] == 3
    assert got["lr"] == [(1, pytest.approx(3e-4)), (2, pytest.approx(6e-4))]
    assert got["eval_loss"] == [(2, 5.0)] and got["straggler_rank"] == [(2, 1.0)]
    assert "phase" not in got and "diverged" not in got  # labels and flags are not scalars

    again = ScalarLog(tmp_path / "tb", clock=lambda: 3_000.0)  # the resumed job's next flow run
    again.add([(4, {"loss": 4.75})])
    assert len(list((tmp_path / "tb").iterdir())) == 2
    assert _read(tmp_path / "tb")["loss"][-1] == (4, 4.75)


def test_values_beyond_float32_are_infinite_not_an_error(tmp_path):
    log = ScalarLog(tmp_path / "tb")
    log.add([(1, {"big": 1e39, "huge_int": 10**400, "small": -1e39, "ok": 2.5})])
    got = _read(tmp_path / "tb")
    assert got["big"] == [(1, math.inf)] and got["huge_int"] == [(1, math.inf)] and got["small"] == [(1, -math.inf)]
    assert got["ok"] == [(1, 2.5)]


def test_nothing_is_written_for_rows_without_numbers(tmp_path):
    log = ScalarLog(tmp_path / "tb")
    log.add([(1, {"phase": "warmup"})])
    assert not (tmp_path / "tb").exists() and log.path is None
