"""Dataset loader throughput: the trainforge streaming reader from a real S3 server (SeaweedFS on loopback),
cold cache and warm cache, against the named baseline (a): a plain PyTorch DataLoader over the same Arrow shards
on local disk, and (b): MosaicML Streaming's StreamingDataset (+ torch DataLoader, same batch size) reading the
same samples converted to its MDS format and uploaded to the same bucket, cold (empty local cache). Also: local-tier hit rates with a cache smaller than the dataset (LRU), with and without the
shared tier, and the data-wait fraction of a simulated training step with the preprocessing workers.

Every trainforge/(a) reader consumes the same deterministic windowed order (shard permutation + block shuffle) in
global batches; (b) uses its own nearest equivalent (shuffled shards + block shuffle, py1br, blocks ~4 batches).
(b) needs `mosaicml-streaming` (bench/requirements-streaming.txt, in an overlay: not in the dev venv); without it the row is skipped with a message. It reads S3 with
boto3 and takes the endpoint from S3_ENDPOINT_URL, set here to the SeaweedFS server.

Run: .venv/bin/python bench/data_stream.py [--samples 40000] [--sample-len 1025] [--shards 20] [--batch 64]
"""

from __future__ import annotations

import argparse
import itertools
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


def streaming_missing() -> str | None:
    """Why (b) cannot run, or None when mosaicml-streaming imports."""
    try:
        import streaming  # noqa: F401
    except ImportError as e:
        return (f"mosaicml-streaming is not importable ({e}); install it into an overlay, never "
                "next to trainforge (it pins numpy<2.2 and pulls a CUDA torch): see bench/requirements-streaming.txt")
    return None


def streaming_upload(data: np.ndarray, per: int, remote: str, work: Path) -> tuple[float, int]:
    """Convert the samples (same split as the Arrow shards) to MDS shards under `remote`; (seconds, MDS bytes)."""
    from streaming import MDSWriter

    sample_bytes = data.shape[1] * data.itemsize
    columns = {"tokens": f"ndarray:{data.dtype.name}:{data.shape[1]}"}
    # one MDS shard per Arrow shard: the size limit fits `per` samples (+ the per-sample offset, + slack)
    limit = per * (sample_bytes + 4) + 4096
    t0 = time.perf_counter()
    with MDSWriter(out=(str(work / "mds-out"), remote), columns=columns, compression=None, hashes=[],
                   size_limit=limit, progress_bar=False, keep_local=True) as w:
        for row in data:
            w.write({"tokens": row})
    secs = time.perf_counter() - t0
    return secs, sum(f.stat().st_size for f in (work / "mds-out").iterdir())


def streaming_read(remote: str, cache: Path, batch: int, steps: int, sample_len: int) -> float:
    """StreamingDataset + DataLoader from S3 with an empty local cache: seconds for `steps` batches."""
    import torch.utils.data as tud
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = StreamingDataset(remote=remote, local=str(cache), batch_size=batch, shuffle=True, shuffle_algo="py1br",
                          shuffle_seed=0, shuffle_block_size=4 * batch)
    loader = tud.DataLoader(ds, batch_size=batch, num_workers=0)
    t0 = time.perf_counter()
    n = 0
    for b in itertools.islice(loader, steps):
        n += len(b["tokens"])
    secs = time.perf_counter() - t0
    assert n == steps * batch and b["tokens"].shape[1] == sample_len, (n, b["tokens"].shape)
    del loader, ds
    return secs


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
        skip_b = streaming_missing()
        if skip_b is None:
            os.environ["S3_ENDPOINT_URL"] = s3.endpoint
            mds_remote = f"s3://{bucket}/mds"
            mds_secs, mds_bytes = streaming_upload(data, per, mds_remote, work)
            for temp in ("cold", "warm"):  # warm: the shards the cold pass left in the same local cache
                results[f"mosaic_streaming_s3_{temp} (b)"] = streaming_read(mds_remote, work / "mds-cache",
                                                                            args.batch, steps, args.sample_len)
    base = results["baseline_torch_dataloader_local"]
    print(f"dataset: {args.samples} samples x {args.sample_len} tokens, {args.shards} shards, "
          f"{total_bytes / 2**20:.1f} MiB; global batch {args.batch}, {steps} steps, windowed order")
    print(f"{'reader':36} {'s':>7} {'samples/s':>11} {'MB/s':>8} {'vs baseline (a)':>16}")
    for name, secs in results.items():
        print(f"{name:36} {secs:7.2f} {steps * args.batch / secs:11.0f} {mb / secs:8.1f} {base / secs:15.2f}x")
    for label, st in hit_rates.items():
        print(f"cache 1/4 of the dataset, 2 epochs, {label}: {st}")
    warm_a = base / results["trainforge_s3_warm"]
    print(f"warm trainforge / (a): {warm_a:.2f}x (target >= 1)")
    if skip_b is not None:
        print(f"(b) MosaicML Streaming SKIPPED: {skip_b}")
    else:
        import streaming

        cold_b = results["mosaic_streaming_s3_cold (b)"] / results["trainforge_s3_cold"]
        print(f"cold trainforge / (b): {cold_b:.2f}x (target >= 1)")
        print(f"(b) mosaicml-streaming {streaming.__version__}: MDS conversion + upload {mds_secs:.2f} s, "
              f"{mds_bytes / 2**20:.1f} MiB in MDS shards")


if __name__ == "__main__":
    main()
