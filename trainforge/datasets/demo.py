"""The demo dataset: Python standard-library sources, byte-tokenized and packed into Arrow shards.

Every machine with Python has these few MB of real text, so the demo needs no download. The file list is
sorted and capped, so the same Python version gives the same dataset version id.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from trainforge.datasets import tokenizer
from trainforge.datasets.catalog import EmbeddedCatalog, ResolvedDataset
from trainforge.datasets.shards import write_shard

DEMO_NAME = "demo-text"


def _stdlib_files(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.glob("*.py")):
        size = path.stat().st_size
        if total + size > limit_bytes:
            break
        files.append(path)
        total += size
    return files


def build_demo_dataset(
    catalog: EmbeddedCatalog | None = None,
    *,
    seq_len: int = 128,
    max_bytes: int = 2_000_000,
    samples_per_shard: int = 2048,
) -> ResolvedDataset:
    catalog = catalog or EmbeddedCatalog()
    files = _stdlib_files(max_bytes)
    docs = [tokenizer.encode(p.read_text(encoding="utf-8", errors="replace")) for p in files]
    samples = tokenizer.pack(docs, seq_len + 1)

    def build(folder: Path):
        return [
            write_shard(folder / f"shard-{i // samples_per_shard:05d}.arrow", samples[i : i + samples_per_shard])
            for i in range(0, len(samples), samples_per_shard)
        ]

    ds = catalog.commit(
        DEMO_NAME, build, sample_len=seq_len + 1, token_dtype="uint16", vocab_size=tokenizer.VOCAB_SIZE,
        tokenizer=tokenizer.NAME, license="PSF-2.0",
        provenance={"source": "python-stdlib", "files": len(files), "python": sysconfig.get_python_version()},
        ref=None,
    )
    return _gated(catalog, ds, "main")


def _gated(catalog: EmbeddedCatalog, ds: ResolvedDataset, branch: str) -> ResolvedDataset:
    """Run the quality gate on a new version and store its report (a job trains only on a version whose report
    passed: datasets/gate.py), then move the branch to it."""
    from trainforge.datasets.gate import GateFailed, run_and_store

    report = run_and_store(ds, catalog=catalog)
    if not report["passed"]:
        raise GateFailed(ds, report)
    catalog.set_ref(ds.name, branch, ds.version)
    return catalog.resolve(ds.name, branch)


def ensure_demo_dataset(catalog: EmbeddedCatalog | None = None) -> ResolvedDataset:
    catalog = catalog or EmbeddedCatalog()
    try:
        return catalog.resolve(DEMO_NAME, "main")
    except LookupError:
        return build_demo_dataset(catalog)


def tiny_dataset(catalog: EmbeddedCatalog, name: str, num_samples: int, sample_len: int, seed: int = 0):
    """A random-token dataset for tests (not for training quality), gated like any version a job trains on."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(num_samples, sample_len), dtype=np.uint16)
    ds = catalog.commit(name, lambda d: [write_shard(d / "shard-00000.arrow", data)], sample_len=sample_len,
                        token_dtype="uint16", vocab_size=tokenizer.VOCAB_SIZE, tokenizer=tokenizer.NAME,
                        license="CC0-1.0", provenance={"source": "random", "seed": seed}, ref=None)
    return _gated(catalog, ds, "main")
