"""Full advisor search for a 405B model on 16,384 H100s: time and number of layouts considered (target < 2 s).

Baseline: the same search with strictly even pipeline stages (126 layers allow pp in {1, 2} only), which shows how
the uneven-stage space grows. Run: .venv/bin/python bench/plan_search.py
"""

from __future__ import annotations

import time

from trainforge.plan.advisor import PlanRequest, search
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.model import PRESETS
from trainforge.plan.topology import default_topology


def run(uneven: bool, repeats: int = 3) -> None:
    req = PlanRequest(PRESETS["llama-405b"], gpu_spec("h100"), default_topology("h100"), 16384, 2048, 8192,
                      uneven_stages=uneven)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = search(req)
        times.append(time.perf_counter() - start)
    best = result.best
    assert best.step is not None
    print(f"405B on 16,384 H100 ({'uneven' if uneven else 'even'} stages): {min(times):.3f} s (best of {repeats}), "
          f"{result.considered} layouts considered, {len(result.plans)} feasible, rejected {dict(result.rejected)}; "
          f"winner {best.layout.describe()} MFU {best.step.mfu:.1%}")


if __name__ == "__main__":
    run(uneven=False)
    run(uneven=True)
