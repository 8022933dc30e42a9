"""Object-storage throughput: multipart upload with concurrent parts / concurrent ranged download, against the
named baseline: a single-stream PUT (and a single-stream GET) of the same file.

Starts its own SeaweedFS on loopback (the same launcher as the tests), writes a file of random bytes, and times
each mode `--repeats` times (median reported). Downloads are checked byte for byte (sha256).

Run: .venv/bin/python bench/storage_throughput.py [--size-mb 200] [--part-mb 16] [--concurrency 8] [--repeats 3]
Note: client and server share this machine's cores, so the numbers measure the client's overhead as much as
the network path; on a real S3 endpoint the concurrency gain is larger.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainforge.infra.storage.seaweedfs import SeaweedFSServer  # noqa: E402

MiB = 1024 * 1024


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--part-mb", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="tf-bench-s3-") as tmp:
        tmpdir = Path(tmp)
        src = tmpdir / "payload.bin"
        with open(src, "wb") as f:
            for _ in range(args.size_mb):
                f.write(os.urandom(MiB))
        size = src.stat().st_size
        digest = _sha256(src)
        results: dict[str, dict[str, float]] = {}

        with SeaweedFSServer(tmpdir / "seaweedfs") as server:
            bucket = server.make_bucket()
            modes = {"single-stream (baseline)": dict(multipart_threshold=size + 1, max_concurrency=1)}
            for c in args.concurrency:
                modes[f"multipart x{c} ({args.part_mb} MiB parts)"] = dict(
                    multipart_threshold=args.part_mb * MiB, part_size=args.part_mb * MiB, max_concurrency=c)
            for name, opts in modes.items():
                store = server.store(bucket, "bench", **opts)
                key = f"payload-{len(results)}"
                dest = tmpdir / f"{key}.out"
                up = _time(lambda store=store, key=key: store.put_file(key, src), args.repeats)
                down = _time(lambda store=store, key=key, dest=dest: store.get_file(key, dest), args.repeats)
                assert _sha256(dest) == digest, f"{name}: downloaded bytes differ"
                dest.unlink()
                store.delete(key)
                results[name] = {
                    "upload_MBps": size / MiB / statistics.median(up),
                    "download_MBps": size / MiB / statistics.median(down),
                    "upload_s": statistics.median(up),
                    "download_s": statistics.median(down),
                }
            server.delete_bucket(bucket)

    base = results["single-stream (baseline)"]
    print(f"object storage throughput: {size / MiB:.0f} MiB file, SeaweedFS {server.endpoint} (loopback), "
          f"median of {args.repeats}, {os.cpu_count()} CPUs")
    print(f"{'mode':34s} {'upload MB/s':>12s} {'x baseline':>10s} {'download MB/s':>14s} {'x baseline':>10s}")
    for name, r in results.items():
        print(f"{name:34s} {r['upload_MBps']:12.1f} {r['upload_MBps'] / base['upload_MBps']:10.2f} "
              f"{r['download_MBps']:14.1f} {r['download_MBps'] / base['download_MBps']:10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"size_bytes": size, "baseline": "single-stream (baseline)",
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
