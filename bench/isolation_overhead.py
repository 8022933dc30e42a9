"""What tenant isolation costs (issue 23): per-job S3 identities on a real SeaweedFS, and output masking.

1. Issue and revoke a job identity (SeaweedFSIdentities: identities file under lock, SIGHUP, probe until the
   server accepts / refuses the key): median and max over N jobs, against the baseline of one plain signed S3
   request (list_buckets with the admin key) on the same server.
2. A worker's output through the masking pump (trainer/output_mask.py) against the same bytes written directly
   to a file (the baseline): a child process writes LINES 111-byte log lines; best of 3 each, alternating.

  .venv/bin/python bench/isolation_overhead.py [--jobs 10] [--lines 200000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import os, sys
from trainforge.trainer import output_mask
output_mask.start_from_env()
line = b"step 123 loss 2.345 tokens/s 12345.6 " * 3 + b"\\n"
for _ in range(int(sys.argv[1])):
    os.write(1, line)
output_mask.close()
"""


def identities(jobs: int) -> None:
    from trainforge.infra.storage.iam import JobGrant
    from trainforge.infra.storage.seaweedfs import SeaweedFSServer

    with tempfile.TemporaryDirectory() as d, SeaweedFSServer(d) as server:
        bucket, ids, admin = server.make_bucket(), server.identities(), server.client()
        plain, issue, revoke = [], [], []
        for i in range(jobs):
            t = time.perf_counter()
            admin.list_buckets()
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            creds = ids.issue(JobGrant(bucket, "nlp", f"job-{i}", "platform"), 3600)
            issue.append(time.perf_counter() - t)
            t = time.perf_counter()
            ids.revoke(creds)
            revoke.append(time.perf_counter() - t)
    base = statistics.median(plain)
    for name, xs in (("issue", issue), ("revoke", revoke)):
        print(f"{name:7s} median {statistics.median(xs) * 1e3:6.0f} ms  max {max(xs) * 1e3:6.0f} ms  "
              f"({statistics.median(xs) / base:.0f}x one signed request, {base * 1e3:.1f} ms; {jobs} jobs)")


def masking(lines: int) -> None:
    secret_env = {**os.environ, "DEMO": "tf-secret-value-123456", "TRAINFORGE_MASKED_ENV": "DEMO"}
    plain_env = {k: v for k, v in secret_env.items() if k not in ("TRAINFORGE_MASKED_ENV", "AWS_SECRET_ACCESS_KEY",
                                                                    "AWS_SESSION_TOKEN")}
    best = {"direct": float("inf"), "masked": float("inf")}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.txt")
        for _ in range(3):
            for name, env in (("direct", plain_env), ("masked", secret_env)):
                with open(out, "wb") as f:
                    t = time.perf_counter()
                    subprocess.run([sys.executable, "-c", CHILD, str(lines)], env=env, stdout=f, check=True)
                    best[name] = min(best[name], time.perf_counter() - t)
        size = os.path.getsize(out)
    print(f"output  masked {best['masked']:.2f} s vs direct {best['direct']:.2f} s for {size / 1e6:.0f} MB "
          f"(ratio {best['masked'] / best['direct']:.2f}, best of 3; includes the pump process's start)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--lines", type=int, default=200_000)
    args = ap.parse_args()
    identities(args.jobs)
    masking(args.lines)


if __name__ == "__main__":
    main()
