"""Write examples/traces/synthetic-2k.csv: a synthetic job trace for `trainforge simulate`, in the simulator's
uniform schema (trainforge/infra/simulator/traces.py), generated here so the example needs no download.

Shape, chosen to load the 10,240-GPU example fleet (examples/clusters/fleet-10k.yaml) enough that policies differ:
Poisson arrivals over 12 hours, mostly small jobs with a few large gangs (1 to 256 GPUs), log-normal durations
(median 2 h), 8 teams. Public traces (Philly, Alibaba PAI) have the same small-job-heavy shape but far smaller
gangs; replay them the same way with `--trace PATH`.

Run: python examples/traces/make_synthetic_trace.py   (deterministic: the same file every time)
"""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

NUM_JOBS = 2000
SPAN_S = 12 * 3600
GANGS = ((1, 0.55), (2, 0.10), (4, 0.10), (8, 0.12), (16, 0.06), (32, 0.04), (64, 0.02), (128, 0.007), (256, 0.003))
TEAMS = ("nlp", "vision", "speech", "recsys", "research", "platform", "ads", "safety")
COLUMNS = ("job_id", "submit_time_s", "submit_time_iso", "duration_s", "num_gpus", "gpu_milli", "user", "team",
           "gpu_type", "status", "source_trace")


def rows(seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    sizes, weights = zip(*GANGS, strict=True)
    t, out = 0.0, []
    for i in range(NUM_JOBS):
        t += rng.expovariate(NUM_JOBS / SPAN_S)
        gpus = rng.choices(sizes, weights)[0]
        duration = min(7 * 86400.0, math.exp(rng.gauss(math.log(7200), 1.2)))
        out.append({"job_id": f"syn-{i:05d}", "submit_time_s": round(t), "submit_time_iso": "",
                    "duration_s": round(duration), "num_gpus": gpus, "gpu_milli": gpus * 1000, "user": "",
                    "team": rng.choice(TEAMS), "gpu_type": "", "status": "", "source_trace": "synthetic"})
    return out


def main() -> None:
    path = Path(__file__).with_name("synthetic-2k.csv")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows())
    print(f"wrote {path} ({NUM_JOBS} jobs)")


if __name__ == "__main__":
    main()
