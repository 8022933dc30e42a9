"""Tokenizers. Built in: byte-level (ids 0-255 are bytes; 256.. are special tokens; no vocabulary file).
Optional: a byte-level BPE trained offline with the `tokenizers` library (below)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

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


# ------------------------------------------------------------------------------------------------ BPE
# A byte-level BPE trained offline with the `tokenizers` library when a build asks for it (`--tokenizer bpe`).
# Ids 0-2 are the special tokens, then the 256 byte symbols, then the learned merges. The trained tokenizer's
# JSON is saved in the version folder (`TOKENIZER_FILE`) and its sha256 is the manifest's tokenizer id
# (`bpe:sha256:<hex>`), so the version id pins the exact vocabulary and merges.

TOKENIZER_FILE = "tokenizer.json"
BPE_PREFIX = "bpe:sha256:"
BPE_SPECIALS = ("<bos>", "<eos>", "<pad>")
BPE_BOS, BPE_EOS, BPE_PAD = 0, 1, 2
MIN_BPE_VOCAB = 256 + len(BPE_SPECIALS)


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """Train a byte-level BPE of at most `vocab_size` ids on `texts`; return its JSON (deterministic in the
    texts and vocab_size: the trainer's ties are broken by the pair's ids, and the JSON is serialized sorted)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"BPE vocab size {vocab_size} is below {MIN_BPE_VOCAB} (256 bytes + "
                         f"{len(BPE_SPECIALS)} special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(texts, trainer)
    if [tok.token_to_id(s) for s in BPE_SPECIALS] != [BPE_BOS, BPE_EOS, BPE_PAD]:
        raise RuntimeError("BPE special tokens did not get ids 0-2")
    return tok.to_str()


def bpe_id(tokenizer_json: str) -> str:
    return BPE_PREFIX + hashlib.sha256(tokenizer_json.encode()).hexdigest()


def is_bpe(name: str) -> bool:
    return name.startswith(BPE_PREFIX)


def pad_id(name: str) -> int | None:
    """The padding id of the tokenizer a manifest names (None: unknown tokenizer)."""
    return PAD if name == NAME else BPE_PAD if is_bpe(name) else None


class BpeEncoder:
    """Encode with a trained BPE (given its JSON): <bos> ids... <eos>, like the byte-level `encode`."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = self._tok.get_vocab_size()
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.array([BPE_BOS, *ids, BPE_EOS], dtype=self.dtype)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_bpe(version_dir: Path) -> BpeEncoder:
    """The BPE saved with a dataset version, checked against the manifest's tokenizer id."""
    import json

    text = (version_dir / TOKENIZER_FILE).read_text()
    want = json.loads((version_dir / "manifest.json").read_text())["tokenizer"]
    if bpe_id(text) != want:
        raise ValueError(f"{version_dir / TOKENIZER_FILE} does not match the manifest's tokenizer {want}")
    return BpeEncoder(text)
