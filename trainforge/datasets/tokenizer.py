"""Tokenizers. Built in: byte-level (ids 0-255 are bytes; 256.. are special tokens; no vocabulary file).
Optional, both through the `tokenizers` library and saved with the version as `tokenizer.json`: a byte-level BPE
trained offline on the source, or a pretrained Hugging Face tokenizer (the `tokenizer.json` a model folder ships)."""

from __future__ import annotations

import hashlib
import json
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
    return BPE_PREFIX + _digest(tokenizer_json)


def pretrained_id(tokenizer_json: str) -> str:
    return PRETRAINED_PREFIX + _digest(tokenizer_json)


def _digest(tokenizer_json: str) -> str:
    # the sha256 of the file itself: texts are read as undecoded UTF-8 (no newline translation) and saved as such
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


def is_bpe(name: str) -> bool:
    return name.startswith(BPE_PREFIX)


def is_pretrained(name: str) -> bool:
    return name.startswith(PRETRAINED_PREFIX)


def ships_json(name: str) -> bool:
    """True when the tokenizer a manifest names travels with the version as its `tokenizer.json`."""
    return is_bpe(name) or is_pretrained(name)


def pad_id(name: str, version_dir: Path | None = None) -> int | None:
    """The padding id of the tokenizer a manifest names (None: unknown; a pretrained one is read from the version
    folder, where its file travels)."""
    if name == NAME:
        return PAD
    if is_bpe(name):
        return BPE_PAD
    if is_pretrained(name) and version_dir is not None and (version_dir / TOKENIZER_FILE).is_file():
        return load_tokenizer(version_dir).pad
    return None


# ------------------------------------------------------------------------------------------- pretrained
# A Hugging Face tokenizer.json, used as it is. A document is encoded as [BOS] ids EOS: the begin-of-text token
# only where the tokenizer has one (GPT-2's has not), the end-of-text token always, because packed samples tell
# documents apart by it. Both are found by name among the file's special tokens (the names below are the ones
# Llama 2/3, Mistral, GPT-2/NeoX, Gemma and trainforge's own BPE use); the post-processor's templates are not
# applied, so what a sample holds does not depend on how a given file configures them. Padding (--no-pack) uses
# the pad token, else the end-of-text token, as transformers' fine-tuning recipes do.
PRETRAINED_PREFIX = "hf:sha256:"
BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>")
EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class TokenizerError(ValueError):
    """A tokenizer.json that cannot be used (unreadable, not a tokenizer, no end-of-text token)."""


def tokenizer_file(path: Path) -> Path:
    """`path` itself, or the tokenizer.json inside a folder (a Hugging Face model folder ships one)."""
    return path / TOKENIZER_FILE if path.is_dir() else path


def read_tokenizer_json(path: Path) -> str:
    """The text of a tokenizer.json (or of a folder's), refused with a readable reason if it is not one."""
    try:
        file = tokenizer_file(path)
        text = file.read_bytes().decode("utf-8")  # bytes, not read_text: a CRLF file keeps its digest
        doc = json.loads(text)
    except FileNotFoundError:
        raise TokenizerError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:  # unreadable, a NUL byte or an over-long name, not UTF-8, not JSON
        raise TokenizerError(f"{path} is not a readable tokenizer.json ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model"), dict):
        raise TokenizerError(f"{file} is not a Hugging Face tokenizer.json (no 'model' section)")
    return text


def same_tokenizer(manifest_tokenizer: str, tokenizer_json: str) -> bool:
    """Whether a manifest's tokenizer id names exactly this tokenizer.json (a trained BPE's file, or a pretrained
    one: the content digest decides, whichever prefix the build gave it)."""
    return ships_json(manifest_tokenizer) and manifest_tokenizer.rsplit(":", 1)[1] == _digest(tokenizer_json)


class JsonTokenizer:
    """Encode with a tokenizer.json (a trained BPE or a pretrained tokenizer): [BOS] ids... EOS, like the
    byte-level `encode`."""

    def __init__(self, tokenizer_json: str, where: str = TOKENIZER_FILE):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust library's errors are plain Exceptions
            raise TokenizerError(f"{where} cannot be loaded by the tokenizers library: {exc}") from None
        # ids as the library assigns them (an added token's id in the JSON is not always the one it gets)
        specials = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        eos = _first(specials, EOS_NAMES)
        if eos is None:
            raise TokenizerError(f"{where} has no end-of-text special token (one of {', '.join(EOS_NAMES)}): packed "
                                 "samples could not tell documents apart")
        self.bos, self.eos = _first(specials, BOS_NAMES), eos
        pad = _first(specials, PAD_NAMES)
        self.pad = eos if pad is None else pad
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1  # gaps included
        self.dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        self._head = [] if self.bos is None else [self.bos]

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.array([*self._head, *ids, self.eos], dtype=self.dtype)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _first(specials: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((specials[n] for n in names if n in specials), None)


def load_tokenizer(version_dir: Path) -> JsonTokenizer:
    """The tokenizer.json saved with a dataset version (a trained BPE or a pretrained one), checked against the
    manifest's tokenizer id."""
    text = (version_dir / TOKENIZER_FILE).read_bytes().decode("utf-8")
    want = json.loads((version_dir / "manifest.json").read_text())["tokenizer"]
    if not same_tokenizer(want, text):
        raise ValueError(f"{version_dir / TOKENIZER_FILE} does not match the manifest's tokenizer {want}")
    return JsonTokenizer(text)
