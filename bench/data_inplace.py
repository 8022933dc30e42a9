"""Datasets read in place: the cost of submit -> first step does not grow with the data.

On a real S3 server (SeaweedFS on loopback), two JSONL prefixes: a small one (~10 MB in 20 objects) and a large one
(~1 GB in 1,000+ objects, at least 50 times as many). For each, the steps a submit takes before the first
optimizer step can start, all in this process, timed and with the bytes read from the store counted:
  pin     list the prefix into a manifest (keys, sizes, ETags) and record it in the catalog
  gate    the quality gate on its bounded sample (quality.SAMPLE_BYTES in at most SAMPLE_CHUNKS chunks)
  step 1  open the order and the reader and read the first global batch (every data-parallel rank's slice)
The named baseline, measured in the same run: copying the prefix first (a GET of every object, the least a
`datasets build` or any copy into a catalog must read), as a platform that trains only on its own copy must.
What the figures leave out: torchrun's start and the model's build (the same for both sizes, ~10 s here), and the
network (loopback: a real bucket adds latency per request, and the in-place path makes few requests).

Run: .venv/bin/python bench/data_inplace.py [--small-mb 10] [--large-mb 1024] [--seq-len 1024] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainforge.infra.storage.seaweedfs import SeaweedFSServer  # noqa: E402

WORDS = [f"w{i:04d}" for i in range(5000)]


def object_body(index: int, size: int) -> bytes:
    """JSONL of distinct ~500-byte documents, `size` bytes or a little more."""
    out, n, j = [], 0, 0
    while n < size:
        words = " ".join(WORDS[(index * 7919 + j * 31 + k * 17) % len(WORDS)] for k in range(80))
        line = json.dumps({"text": f"object {index} document {j}: {words}", "id": f"{index}-{j}"}) + "\n"
        out.append(line)
        n += len(line)
        j += 1
    return "".join(out).encode()


def upload(client, bucket: str, prefix: str, objects: int, size: int) -> int:
    def put(i: int) -> int:
        body = object_body(i, size)
        client.put_object(Bucket=bucket, Key=f"{prefix}/part-{i:05d}.jsonl", Body=body)
        return len(body)

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(put, range(objects)))


def in_place(ref: str, seq_len: int, batch: int, dp: int) -> dict[str, float]:
    from trainforge.datasets.gate import gate_for_submit
    from trainforge.datasets.pin_prefix import pin_prefix
    from trainforge.datasets.training_data import open_training_data
    from trainforge.spec import DatasetSpec

    t0 = time.perf_counter()
    ds = pin_prefix(ref, DatasetSpec(ref=ref, format="jsonl", license="CC-BY-4.0"))
    t_pin = time.perf_counter()
    report = gate_for_submit(ds)
    t_gate = time.perf_counter()
    assert report["passed"], report["failures"]
    read = 0
    for rank in range(dp):  # each rank opens its own reader, as the workers do
        data = open_training_data(ds.path, ds.ref, eval_fraction=0.01, seed=1, seq_len=seq_len)
        rows = data.reader.get(data.order.rank_slice(0, batch, rank, dp))
        assert rows.shape == (batch // dp, seq_len + 1)
        read += data.reader.objects.bytes_read
        data.close()
    t_step = time.perf_counter()
    return {"objects": len(ds.manifest.objects), "bytes": ds.manifest.total_bytes, "pin_s": t_pin - t0,
            "gate_s": t_gate - t_pin, "step1_s": t_step - t_gate, "total_s": t_step - t0,
            "gate_bytes": report["bytes_read"], "step1_bytes": read}


def copy_all(client, bucket: str, prefix: str) -> dict[str, float]:
    t0 = time.perf_counter()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
            for o in page.get("Contents", [])]

    def get(key: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    with ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(get, keys))
    return {"copy_s": time.perf_counter() - t0, "copy_bytes": total}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--small-mb", type=float, default=10)
    p.add_argument("--large-mb", type=float, default=1024)
    p.add_argument("--small-objects", type=int, default=20)
    p.add_argument("--object-mb", type=float, default=1.0, help="object size of the large prefix")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dp", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-inplace-"))
    os.environ["TRAINFORGE_HOME"] = str(work / "home")
    os.environ["TRAINFORGE_DATA_CACHE"] = str(work / "cache" / "shards")
    with SeaweedFSServer(work / "s3") as server:
        os.environ.update(server.env())
        client = server.client()
        bucket = server.make_bucket("corpus")
        small_objects = args.small_objects
        large_objects = max(50 * small_objects, int(args.large_mb / args.object_mb))
        t0 = time.perf_counter()
        sizes = {"small": upload(client, bucket, "small", small_objects, int(args.small_mb * 2**20 / small_objects)),
                 "large": upload(client, bucket, "large", large_objects, int(args.large_mb * 2**20 / large_objects))}
        print(f"uploaded {sizes['small'] / 1e6:.1f} MB in {small_objects} objects and {sizes['large'] / 1e6:.1f} MB "
              f"in {large_objects} objects ({time.perf_counter() - t0:.1f} s)", flush=True)
        # great-expectations' first import and context take ~3 s: paid once, before anything is timed
        from trainforge._optional import require

        require("great_expectations").get_context(mode="ephemeral")
        rows = {}
        for name in ("small", "large"):
            os.environ["TRAINFORGE_DATA_CACHE"] = str(work / "cache" / name)  # cold cache for each
            rows[name] = in_place(f"s3://{bucket}/{name}", args.seq_len, args.batch, args.dp)
            rows[name].update(copy_all(client, bucket, name))
        print(f"\n{'prefix':8} {'objects':>8} {'MB':>8} {'pin s':>7} {'gate s':>7} {'step1 s':>8} {'total s':>8} "
              f"{'MB read before step 1':>22} {'copy s (baseline)':>18} {'copy MB':>8}")
        for name, r in rows.items():
            before = (r["gate_bytes"] + r["step1_bytes"]) / 1e6
            print(f"{name:8} {r['objects']:>8} {r['bytes'] / 1e6:>8.1f} {r['pin_s']:>7.2f} {r['gate_s']:>7.2f} "
                  f"{r['step1_s']:>8.2f} {r['total_s']:>8.2f} {before:>22.2f} {r['copy_s']:>18.2f} "
                  f"{r['copy_bytes'] / 1e6:>8.1f}")
        s, g = rows["small"], rows["large"]
        data_ratio = g["bytes"] / s["bytes"]
        print(f"\nlarge/small: data x{data_ratio:.0f}, objects x{g['objects'] / s['objects']:.0f}")
        print(f"  in place, submit -> first step:   x{g['total_s'] / s['total_s']:.2f} time, "
              f"x{(g['gate_bytes'] + g['step1_bytes']) / (s['gate_bytes'] + s['step1_bytes']):.2f} bytes read")
        print(f"  baseline, copy the prefix first:  x{g['copy_s'] / s['copy_s']:.2f} time, "
              f"x{g['copy_bytes'] / s['copy_bytes']:.2f} bytes read")
        print(f"  large prefix: in place reads {(g['gate_bytes'] + g['step1_bytes']) / g['copy_bytes']:.2%} of what "
              f"the copy reads, in {g['total_s'] / g['copy_s']:.2f}x its time")


if __name__ == "__main__":
    main()
