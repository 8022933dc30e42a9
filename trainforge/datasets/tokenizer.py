"""Byte-level tokenizer: ids 0-255 are bytes; 256.. are special tokens. Needs no vocabulary file."""

from __future__ import annotations

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 260  # 256 bytes + BOS/EOS/PAD + one spare; a multiple of 4 keeps shapes friendly
NAME = "byte-level-v1"


def encode(text: str) -> np.ndarray:
    body = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.uint16)
    return np.concatenate([np.array([BOS], np.uint16), body, np.array([EOS], np.uint16)])


def decode(ids: np.ndarray | list[int]) -> str:
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def pack(documents: list[np.ndarray], sample_len: int) -> np.ndarray:
    """Concatenate documents and cut into fixed-length samples (sequence packing); the tail is dropped."""
    stream = np.concatenate(documents) if documents else np.zeros(0, np.uint16)
    n = len(stream) // sample_len
    return stream[: n * sample_len].reshape(n, sample_len)
