"""The BPE tokenizer option of `datasets build`: trained offline with the `tokenizers` library on the source,
saved with the version (its JSON in the version folder, its sha256 as the manifest's tokenizer id), used by the
parallel tokenization workers; the version id is a deterministic function of the source (same id whatever the
worker count, in a fresh process too); the quality gate passes; a remote catalog carries the tokenizer.

Run: .venv/bin/python -m pytest tests/unit/datasets/test_build_bpe.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainforge.datasets import tokenizer
from trainforge.datasets.build import BuildConfig, BuildError, build_dataset, build_version_dir
from trainforge.datasets.catalog import EmbeddedCatalog
from trainforge.datasets.quality import run_gate
from trainforge.datasets.shards import ShardReader

WORDS = ["alpha", "beta", "gamma", "delta", "trainforge", "shard", "token", "merge", "über", "naïve", "日本"]
DOCS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 13)) + f" #{i}" for i in range(300)]


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _cfg(**kw) -> BuildConfig:
    return BuildConfig(**{"license": "MIT", "seq_len": 31, "tokenizer": "bpe", "vocab_size": 400,
                          "docs_per_task": 16, **kw})


@pytest.mark.parametrize("workers", [1, 2])
def test_bpe_build_saves_the_tokenizer_and_encodes_with_it(tmp_path, workers):
    ds = build_dataset(_jsonl(tmp_path / "a.jsonl"), "bpe", _cfg(num_workers=workers))
    m = ds.manifest
    saved = (ds.path / tokenizer.TOKENIZER_FILE).read_text()
    assert m.tokenizer == tokenizer.bpe_id(saved) and tokenizer.is_bpe(m.tokenizer)
    enc = tokenizer.load_tokenizer(ds.path)  # checked against the manifest's id
    assert m.vocab_size == enc.vocab_size <= 400 and m.token_dtype == "uint16"
    got = ShardReader(ds.path, m).get(range(m.num_samples))
    want = tokenizer.pack([enc.encode(d) for d in DOCS], 32)
    np.testing.assert_array_equal(got, want)  # the workers used the trained BPE, in document order
    assert got.max() < m.vocab_size
    assert enc.decode(enc.encode(DOCS[5])) == DOCS[5]
    byte_tokens = sum(len(tokenizer.encode(d)) for d in DOCS)
    assert m.provenance["tokens"] < 0.8 * byte_tokens  # merges learned: fewer tokens than bytes
    assert run_gate(ds)["passed"]


def test_bpe_version_id_is_deterministic(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl")
    a = build_dataset(src, "det", _cfg(num_workers=1))
    b = build_dataset(src, "det", _cfg(num_workers=2, docs_per_task=7))
    assert a.version == b.version
    code = ("import sys; from pathlib import Path; from trainforge.datasets.build import BuildConfig, "
            "build_version_dir as b; print(b(Path(sys.argv[1]), Path(sys.argv[2]), 'det', BuildConfig(license='MIT',"
            " seq_len=31, tokenizer='bpe', vocab_size=400, docs_per_task=16, num_workers=1)).version)")
    out = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "fresh")], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == a.version  # a fresh process (new hash seeds) trains the same BPE
    c = build_dataset(src, "det", _cfg(vocab_size=450))
    assert c.version != a.version  # the vocabulary is part of the version


def test_bpe_in_a_standalone_folder_and_a_remote_catalog(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl")
    ds = build_version_dir(src, tmp_path / "v1", "v1", _cfg(num_workers=1))
    assert tokenizer.load_tokenizer(ds.path).vocab_size == ds.manifest.vocab_size
    from trainforge.infra.storage import LocalObjectStore

    store = LocalObjectStore(tmp_path / "bucket").scoped("teams/nlp/datasets")
    remote = EmbeddedCatalog(store=store, prefix="teams/nlp/datasets")
    assert not remote.local
    r = build_dataset(src, "v1", _cfg(num_workers=1), catalog=remote)
    assert r.version == ds.version  # same content, same id, whichever way it was built
    assert store.exists(f"teams/nlp/datasets/v1/versions/{r.version}/{tokenizer.TOKENIZER_FILE}")
    assert tokenizer.load_tokenizer(r.path).vocab_size == ds.manifest.vocab_size  # materialized with the version


def test_bpe_vocab_too_small_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="below"):
        build_dataset(_jsonl(tmp_path / "a.jsonl"), "small", _cfg(vocab_size=100))
