"""TensorBoard event files of a job's scalars (loss, learning rate, grad norm, throughput, evaluation, ...), written
by the flow from the metrics it already routes to MLflow, into `JOB_FOLDER/tensorboard/`, so `tensorboard --logdir`
on that folder (or on the run's `tensorboard/` artifacts in MLflow) shows every managed job without the user's code
doing anything.

The format is TensorBoard's own: TFRecord framing (length, masked CRC-32C of the length, the record, masked CRC-32C
of the record) around `Event` protocol buffers, the first one naming the file version. Scalars need only five
protobuf fields, encoded here by hand so that neither tensorboard nor protobuf is needed on the flow's host;
tests/unit/test_tensorboard_files.py reads the files with tensorboard's own reader. One file per flow run (a resumed
job adds a file; TensorBoard merges the files of a folder)."""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from trainforge.registry.secrets import redact

FILE_VERSION = b"brain.Event:2"
FOLDER = "tensorboard"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def tfrecord(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + _masked(length) + data + _masked(data)


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 on the wire: two's complement, as protobuf encodes a negative step
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, *, file_version: bytes | None = None,
          scalars: Mapping[str, float] | None = None) -> bytes:
    """One serialized `Event`: wall_time (1, double), step (2, int64), file_version (3) or summary (5) of
    `Summary.Value`s with tag (1) and simple_value (2, float)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version)
    if scalars:
        values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5)
                                       + struct.pack("<f", _float32(value))) for tag, value in scalars.items())
        out += _field_bytes(5, values)
    return out


_FLOAT32_MAX = 3.4028234663852886e38


def _float32(value: int | float) -> float:
    """simple_value is a float32: beyond its range (an int beyond any float too) a value is +-inf there, not an
    OverflowError here."""
    if abs(value) > _FLOAT32_MAX:  # exact for ints of any size; False for NaN, which stays NaN
        return math.inf if value > 0 else -math.inf
    return float(value)


class ScalarLog:
    """Appends a job's metric rows to one event file of its own in `folder` (created on the first row)."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time):
        self.folder, self.clock = folder, clock
        self.path: Path | None = None

    def add(self, rows: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        records = []
        for step, values in rows:
            # numbers only (a NaN loss is shown as TensorBoard shows it); a label or flag is not a scalar
            scalars = {redact(str(k)): v for k, v in values.items()
                       if isinstance(v, int | float) and not isinstance(v, bool)}
            if scalars:
                records.append(tfrecord(event(self.clock(), int(step), scalars=scalars)))
        if not records:
            return
        if self.path is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            now = self.clock()
            self.path = self.folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.trainforge"
            records.insert(0, tfrecord(event(now, file_version=FILE_VERSION)))
        with self.path.open("ab") as f:  # whole records per write: a reader never meets half of one it trusts
            f.write(b"".join(records))
