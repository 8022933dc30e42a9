"""Restore bytes, counted outside trainforge: how many bytes the object store serves for one restore, per rank and
in all, and the restore time, for the ranged reader (trainer/checkpointing/store_reader.py) against the named
baseline, main's restore before it (rank 0 downloads and verifies every file; the local rank 0 of every other node
downloads them all again; DCP reads its part from that local copy), measured in the same run.

SeaweedFS (the tests' S3 server) on loopback holds one checkpoint of an FSDP2 or HSDP model of Linear layers with
AdamW state (tests/distributed/restore_worker.py; >= 256 MiB). Each rank's S3 client talks to its own port of a
counting TCP proxy in front of the S3 endpoint: the bytes counted are every byte the server sent to that rank,
HTTP headers included, as seen on the wire, not by the reader. The baseline runs one rank per node (a node per
rank: at 8 GPUs per node main reads world/8 copies instead of world). Each restore is a fresh torchrun gang with
empty staging folders; both paths must end with the same bits (per-rank digests compared).

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/restore_bytes.py [--worlds 2,4,8] [--layouts fsdp,hsdp]
     [--width 2048 --layers 6]    (about 10 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainforge.infra.storage.seaweedfs import SeaweedFSServer  # noqa: E402

MiB = 1024 * 1024
JOB = "teams/t/jobs/restore"


class CountingProxy:
    """A TCP relay per rank in front of one endpoint, counting the bytes the server sends back through each port."""

    def __init__(self, target: tuple[str, int], n: int):
        self.target = target
        self.served = [0] * n
        self._lock = threading.Lock()
        self._listeners = []
        self.ports = []
        for i in range(n):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            self._listeners.append(sock)
            self.ports.append(sock.getsockname()[1])
            threading.Thread(target=self._accept, args=(i, sock), daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.served = [0] * len(self.served)

    def _accept(self, index: int, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=60)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, index), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count_as: int | None) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if count_as is not None:
                    with self._lock:
                        self.served[count_as] += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for sock in self._listeners:
            sock.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(world: int, cfg: dict, env: dict[str, str], timeout: float = 900) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "tests.distributed.restore_worker"]
    # TMPDIR: torchrun's own log folder (torchelastic_*, no --log-dir here) goes into the run's folder, not /tmp
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RESTORE_CONFIG": json.dumps(cfg),
            "TMPDIR": cfg["out"], **env}
    proc = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def results(out: Path, name: str, world: int) -> list[dict]:
    return [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(world)]


def one(s3: SeaweedFSServer, bucket: str, layout: str, world: int, args: argparse.Namespace, tmp: Path) -> list[dict]:
    out = tmp / f"{layout}-{world}"
    out.mkdir()
    store_url = f"s3://{bucket}/{layout}-{world}"
    base = {"out": str(out), "store": store_url, "layout": layout, "width": args.width, "layers": args.layers,
            "steps": 2, "interval": 1, "ranks_per_node": 1}
    env = s3.env()
    torchrun(world, base | {"phases": ["train"]}, env)  # one checkpoint (step 1), written straight to the store
    store = s3.store(bucket, f"{layout}-{world}")
    from trainforge.registry.manifest import list_committed

    ref = list_committed(store, JOB)[-1]
    size = sum(f["bytes"] for f in ref.files)
    metadata = next(f["bytes"] for f in ref.files if f["name"] == ".metadata")
    host, port = s3.endpoint.removeprefix("http://").split(":")
    rows = []
    for phase, label in (("legacy", "main: whole copy per node"), ("restore", "ranged, each byte once")):
        proxy = CountingProxy((host, int(port)), world)
        try:
            penv = env | {"RESTORE_ENDPOINT_TEMPLATE": "http://127.0.0.1:{port}",
                          "RESTORE_ENDPOINT_PORTS": ",".join(map(str, proxy.ports))}
            t0 = time.perf_counter()
            torchrun(world, base | {"phases": [phase]}, penv)
            wall = time.perf_counter() - t0
            served = list(proxy.served)
        finally:
            proxy.close()
        res = results(out, f"{phase}-0", world)
        rows.append({"layout": layout, "world": world, "path": label, "phase": phase, "size": size,
                     "metadata": metadata, "served": served, "total": sum(served),
                     "restore_s": max(r["restore_s"] for r in res), "gang_wall_s": wall,
                     "digests": [r["digest"] for r in res], "start": res[0]["start"]})
    if rows[0]["digests"] != rows[1]["digests"]:
        raise SystemExit(f"{layout} world {world}: the two restores ended with different bits")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--layouts", default="fsdp,hsdp")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tf-restore-bench-") as tmp, SeaweedFSServer(Path(tmp) / "s3") as s3:
        bucket = s3.make_bucket()
        for layout in args.layouts.split(","):
            for world in map(int, args.worlds.split(",")):
                rows += one(s3, bucket, layout, world, args, Path(tmp))
                for r in rows[-2:]:
                    print(f"  {r['layout']} world {r['world']} {r['path']}: {r['total'] / MiB:.1f} MiB served, "
                          f"restore {r['restore_s']:.2f} s", flush=True)
    print(f"\n{'layout':6} {'world':>5} {'path':26} {'ckpt MiB':>8} {'served MiB':>10} {'x ckpt':>6} "
          f"{'max/rank MiB':>12} {'x ckpt/world':>12} {'restore s':>9}")
    ok = True
    for r in rows:
        share = r["size"] / r["world"]
        per_rank = max(r["served"])
        x_total, x_rank = r["total"] / r["size"], (per_rank - r["metadata"]) / share
        print(f"{r['layout']:6} {r['world']:>5} {r['path']:26} {r['size'] / MiB:8.1f} {r['total'] / MiB:10.1f} "
              f"{x_total:6.2f} {per_rank / MiB:12.1f} {x_rank:12.2f} {r['restore_s']:9.2f}")
        if r["phase"] == "restore":
            ok &= x_total <= 1.1 and (r["layout"] != "fsdp" or x_rank <= 1.1)
    print("(served: bytes the S3 server sent, counted by a TCP proxy per rank, headers included; max/rank minus the "
          ".metadata, which rank 0 reads once for the gang, against checkpoint/world; restore s: the slowest rank, "
          "from the gang's start of the restore to its end, through the proxy)")
    print(f"goal (ranged: in all <= 1.1x the checkpoint, FSDP per rank <= 1.1x size/world + metadata): "
          f"{'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
