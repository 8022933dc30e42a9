"""Build a dataset version from raw text: text files, JSONL or Parquet -> tokenized, packed Arrow shards.

Documents are read in the main process (so every bad row is reported with its file and row), tokenized in a
process pool in order (so the output, and the version id, do not depend on the number of workers), packed into
fixed-length samples and written as shards of bounded size. The whole build happens inside the catalog's commit:
if any row is bad (and `skip_bad` is off) or anything fails, no version is published.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.datasets import tokenizer
from trainforge.datasets.catalog import EmbeddedCatalog, ResolvedDataset, load_version_dir
from trainforge.datasets.manifest import MANIFEST_FILE, DatasetManifest, ShardInfo
from trainforge.datasets.shards import write_shard

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
MAX_REPORTED = 50


@dataclass(frozen=True, slots=True)
class BadRow:
    file: str
    row: int
    """1-based: the line of a JSONL file, the row of a Parquet file, 0 for a whole text file."""
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.row}: {self.reason}" if self.row else f"{self.file}: {self.reason}"


class BuildError(ValueError):
    def __init__(self, message: str, bad_rows: list[BadRow] | None = None):
        self.bad_rows = bad_rows or []
        lines = [message, *(f"  {b}" for b in self.bad_rows[:MAX_REPORTED])]
        if len(self.bad_rows) > MAX_REPORTED:
            lines.append(f"  ... and {len(self.bad_rows) - MAX_REPORTED} more")
        super().__init__("\n".join(lines))


@dataclass(frozen=True, slots=True, kw_only=True)
class BuildConfig:
    license: str
    """SPDX id (or name) of the data's license: recorded in the version and in every run that uses it."""
    seq_len: int = 1024
    """Tokens per training sequence; samples hold seq_len + 1 tokens (inputs and shifted targets)."""
    text_field: str = "text"
    """The JSONL key / Parquet column holding the document text."""
    pack: bool = True
    """Concatenate documents and cut fixed-length samples (True), or one padded/truncated sample per document."""
    num_workers: int = 0
    """Tokenizer processes; 0 = os.cpu_count()."""
    max_shard_bytes: int = 64 << 20
    docs_per_task: int = 256
    skip_bad: bool = False
    """Skip bad rows (counted in the provenance) instead of failing the build."""
    provenance: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "byte"
    """"byte" (built-in byte-level), "bpe" (a byte-level BPE trained on this source, saved with the version), or the
    path of a pretrained Hugging Face tokenizer.json (or of a model folder holding one), saved with the version."""
    vocab_size: int = 8192
    """Size of the BPE vocabulary to train (tokenizer "bpe"; a small corpus may yield fewer ids)."""


@dataclass(frozen=True, slots=True)
class TokenizerChoice:
    """The tokenizer of one build: its manifest id, vocabulary size, token dtype and (a BPE or a pretrained file)
    its JSON, saved with the version byte for byte."""

    name: str
    vocab_size: int
    token_dtype: str
    pad: int
    json: str | None = None

    def save(self, folder: Path) -> None:
        if self.json is not None:
            (folder / tokenizer.TOKENIZER_FILE).write_bytes(self.json.encode("utf-8"))


def choose_tokenizer(files: list[Path], cfg: BuildConfig) -> TokenizerChoice:
    """Byte-level, a pretrained tokenizer.json, or train the BPE (offline, before any worker starts) on the source's
    good documents."""
    if cfg.tokenizer == "byte":
        return TokenizerChoice(tokenizer.NAME, tokenizer.VOCAB_SIZE, "uint16", tokenizer.PAD)
    if cfg.tokenizer != "bpe":
        return pretrained_tokenizer(Path(cfg.tokenizer))
    try:
        text = tokenizer.train_bpe((d for d in iter_documents(files, cfg.text_field) if isinstance(d, str)),
                                   cfg.vocab_size)
    except ValueError as exc:
        raise BuildError(str(exc)) from None
    enc = tokenizer.JsonTokenizer(text)
    return TokenizerChoice(tokenizer.bpe_id(text), enc.vocab_size, np.dtype(enc.dtype).name, tokenizer.BPE_PAD, text)


def pretrained_tokenizer(path: Path) -> TokenizerChoice:
    """A Hugging Face tokenizer.json used as it is; its content digest is the manifest's tokenizer id."""
    if not _exists(tokenizer.tokenizer_file(path)):
        raise BuildError(f"tokenizer {path}: no such file; use 'byte', 'bpe' or the path of a Hugging Face "
                         "tokenizer.json (or of a model folder holding one)")
    try:
        text = tokenizer.read_tokenizer_json(path)
        enc = tokenizer.JsonTokenizer(text, where=str(tokenizer.tokenizer_file(path)))
    except tokenizer.TokenizerError as exc:
        raise BuildError(str(exc)) from None
    return TokenizerChoice(tokenizer.pretrained_id(text), enc.vocab_size, np.dtype(enc.dtype).name, enc.pad, text)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # an over-long name: the read below says what is wrong
        return True


def source_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise BuildError(f"source {source} does not exist")
    known = TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in known)
    if not files:
        raise BuildError(f"source {source} holds no {', '.join(sorted(known))} files")
    return files


def _check_text(file: str, row: int, value: Any) -> str | BadRow:
    if not isinstance(value, str):
        return BadRow(file, row, f"text is {type(value).__name__}, not a string")
    if not value.strip():
        return BadRow(file, row, "empty document")
    return value


def iter_documents(files: list[Path], text_field: str = "text") -> Iterator[str | BadRow]:
    """Every document of every file, in order; a row that cannot be used comes out as a BadRow."""
    for path in files:
        name, suffix = str(path), path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl(path, name, text_field)
        elif suffix in PARQUET_SUFFIXES:
            yield from _parquet(path, name, text_field)
        else:
            try:
                yield _check_text(name, 0, path.read_bytes().decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield BadRow(name, 0, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
            except OSError as exc:
                yield BadRow(name, 0, f"unreadable: {exc.strerror}")


def _jsonl(path: Path, name: str, text_field: str) -> Iterator[str | BadRow]:
    try:
        f = open(path, encoding="utf-8", errors="strict")  # noqa: SIM115 - closed below
    except OSError as exc:
        yield BadRow(name, 0, f"unreadable: {exc.strerror}")
        return
    with f:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = f.readline()
            except UnicodeDecodeError:
                yield BadRow(name, lineno, "not UTF-8")
                return
            if not line:
                return
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield BadRow(name, lineno, f"invalid JSON: {exc.msg} (column {exc.colno})")
                continue
            if not isinstance(obj, dict) or text_field not in obj:
                yield BadRow(name, lineno, f"no {text_field!r} field")
                continue
            yield _check_text(name, lineno, obj[text_field])


def _parquet(path: Path, name: str, text_field: str) -> Iterator[str | BadRow]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        yield BadRow(name, 0, f"not a readable Parquet file: {exc}")
        return
    if text_field not in pf.schema_arrow.names:
        yield BadRow(name, 0, f"no {text_field!r} column (columns: {', '.join(pf.schema_arrow.names)})")
        return
    col_type = pf.schema_arrow.field(text_field).type
    if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
        yield BadRow(name, 0, f"column {text_field!r} is {col_type}, not a string column")
        return
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            row += 1
            yield _check_text(name, row, value)


_worker_bpe: tokenizer.JsonTokenizer | None = None


def _init_worker(tokenizer_json: str | None) -> None:
    """Pool initializer: load this build's tokenizer.json once per worker process (None: byte-level)."""
    global _worker_bpe
    _worker_bpe = tokenizer.JsonTokenizer(tokenizer_json) if tokenizer_json is not None else None


def encode_batch(texts: list[str]) -> list[np.ndarray]:
    """Tokenize documents (runs in a worker process)."""
    if _worker_bpe is not None:
        return [_worker_bpe.encode(t) for t in texts]
    return [tokenizer.encode(t) for t in texts]


class _InlineExecutor(Executor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


class _ShardWriter:
    """Packs token streams into samples and writes shards of at most `samples_per_shard` samples."""

    def __init__(self, folder: Path, sample_len: int, dtype: type, max_shard_bytes: int, pack: bool,
                 pad: int = tokenizer.PAD):
        self.folder, self.sample_len, self.dtype, self.pack, self.pad = folder, sample_len, dtype, pack, pad
        self.per_shard = max(1, max_shard_bytes // (sample_len * np.dtype(dtype).itemsize))
        self.carry = np.zeros(0, dtype)
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.shards: list[ShardInfo] = []
        self.tokens = 0

    def add(self, doc: np.ndarray) -> None:
        doc = doc.astype(self.dtype, copy=False)
        self.tokens += len(doc)
        if not self.pack:
            row = np.full(self.sample_len, self.pad, self.dtype)
            row[: min(len(doc), self.sample_len)] = doc[: self.sample_len]
            self._push(row[None])
            return
        stream = np.concatenate([self.carry, doc]) if len(self.carry) else doc
        n = len(stream) // self.sample_len
        if n:
            self._push(stream[: n * self.sample_len].reshape(n, self.sample_len))
        self.carry = stream[n * self.sample_len :].copy()

    def _push(self, rows: np.ndarray) -> None:
        self.pending.append(rows)
        self.pending_rows += len(rows)
        while self.pending_rows >= self.per_shard:
            self._flush(self.per_shard)

    def _flush(self, count: int) -> None:
        rows = np.concatenate(self.pending)
        self.pending = [rows[count:]] if len(rows) > count else []
        self.pending_rows = len(rows) - count
        path = self.folder / f"shard-{len(self.shards):05d}.arrow"
        self.shards.append(write_shard(path, np.ascontiguousarray(rows[:count]), max_chunksize=None))

    def close(self) -> list[ShardInfo]:
        if self.pending_rows:
            self._flush(self.pending_rows)
        return self.shards


def tokenize_into(folder: Path, files: list[Path], cfg: BuildConfig, stats: dict[str, Any],
                  tok: TokenizerChoice | None = None) -> list[ShardInfo]:
    """Read, tokenize (in a process pool) and pack `files` into shards in `folder`. Raises BuildError listing
    every bad row unless cfg.skip_bad. A BPE's JSON is saved in `folder` next to the shards."""
    tok = tok or choose_tokenizer(files, cfg)
    tok.save(folder)
    workers = cfg.num_workers or os.cpu_count() or 1
    dtype = np.dtype(tok.token_dtype).type
    writer = _ShardWriter(folder, cfg.seq_len + 1, dtype, cfg.max_shard_bytes, cfg.pack, tok.pad)
    bad: list[BadRow] = []
    docs = 0
    if workers > 1:  # a BPE's workers are spawned: never forked after the tokenizers library's threads ran
        ctx = multiprocessing.get_context("spawn") if tok.json is not None else None
        executor: Executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                 initargs=(tok.json,))
    else:
        _init_worker(tok.json)
        executor = _InlineExecutor()
    in_flight: deque[Future[list[np.ndarray]]] = deque()

    def drain(limit: int) -> None:
        while len(in_flight) > limit:
            for doc in in_flight.popleft().result():
                writer.add(doc)

    with executor:
        batch: list[str] = []
        for item in iter_documents(files, cfg.text_field):
            if isinstance(item, BadRow):
                bad.append(item)
                continue
            docs += 1
            batch.append(item)
            if len(batch) >= cfg.docs_per_task:
                in_flight.append(executor.submit(encode_batch, batch))
                batch = []
                drain(2 * workers)  # bounded: memory stays flat on big inputs
        if batch:
            in_flight.append(executor.submit(encode_batch, batch))
        drain(0)
    _init_worker(None)
    if bad and not cfg.skip_bad:
        raise BuildError(f"{len(bad)} bad row(s) in the source; nothing was committed "
                         "(fix them, or pass --skip-bad to leave them out)", bad)
    shards = writer.close()
    if not shards:
        raise BuildError(f"the source holds {writer.tokens} tokens in {docs} document(s): fewer than one sample of "
                         f"{cfg.seq_len + 1} tokens; use a smaller --seq-len", bad)
    stats.update(documents=docs, tokens=writer.tokens, skipped_rows=len(bad), samples=sum(s.num_samples for s in shards))
    if bad:
        stats["skipped_examples"] = [str(b) for b in bad[:10]]
    return shards


def _provenance(source: Path, files: list[Path], cfg: BuildConfig, stats: dict[str, Any]) -> dict[str, Any]:
    extra = {"bpe_vocab_size_requested": cfg.vocab_size} if cfg.tokenizer == "bpe" else {}  # byte: ids unchanged
    return {"source": str(source), "files": len(files), "builder": "trainforge-datasets-build-v1",
            "packing": "concat" if cfg.pack else "pad", "text_field": cfg.text_field, **extra, **stats,
            **cfg.provenance}


def build_dataset(source: Path, name: str, cfg: BuildConfig, *, catalog: EmbeddedCatalog | None = None,
                  ref: str = "main") -> ResolvedDataset:
    """Build `source` into a new version of dataset `name` and move branch `ref` to it."""
    catalog = catalog or EmbeddedCatalog()
    files = source_files(source)
    tok = choose_tokenizer(files, cfg)
    stats: dict[str, Any] = {}
    prov: dict[str, Any] = {}  # filled by the build step; commit() reads it after build() returns

    def build(folder: Path) -> list[ShardInfo]:
        shards = tokenize_into(folder, files, cfg, stats, tok)
        prov.update(_provenance(source, files, cfg, stats))
        return shards

    return catalog.commit(name, build, sample_len=cfg.seq_len + 1, token_dtype=tok.token_dtype,
                          vocab_size=tok.vocab_size, tokenizer=tok.name, license=cfg.license,
                          provenance=prov, ref=ref)


def build_version_dir(source: Path, out: Path, name: str, cfg: BuildConfig) -> ResolvedDataset:
    """Build `source` into a standalone version folder `out` (a file:// reference), atomically."""
    if out.exists():
        raise BuildError(f"{out} already exists: a version folder is immutable; choose a new path")
    files = source_files(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        stats: dict[str, Any] = {}
        tok = choose_tokenizer(files, cfg)
        shards = tokenize_into(tmp, files, cfg, stats, tok)
        manifest = DatasetManifest(name=name, shards=tuple(shards), sample_len=cfg.seq_len + 1,
                                   token_dtype=tok.token_dtype, vocab_size=tok.vocab_size, tokenizer=tok.name,
                                   license=cfg.license,
                                   provenance=_provenance(source, files, cfg, stats))
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_version_dir(out, out.as_uri())
