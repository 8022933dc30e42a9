"""Trigger a training job programmatically through the `train-job` deployment and wait for it.

What a pipeline, notebook or another service does instead of the CLI: the run goes to the Prefect server, a worker
on the `trainforge` pool picks it up (the stack's worker after `trainforge servers up`), and this script waits
(bounded) for the flow run to finish and prints its outcome and the job record.

    trainforge servers up
    set -a; . ~/.trainforge/servers/stack.env; set +a      # PREFECT_API_URL and the platform settings
    .venv/bin/python examples/trigger_training.py examples/tiny-cpu.yaml --max-steps 8 --timeout 600

Exit status: 0 when the run completed, 1 when it failed/crashed/was cancelled, 2 when it did not finish within
--timeout (the run keeps going on the worker; follow it with `prefect flow-run inspect ID`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="job spec (YAML), e.g. examples/tiny-cpu.yaml")
    ap.add_argument("--deployment", default="train-job/train-job", help="flow-name/deployment-name")
    ap.add_argument("--max-steps", type=int, help="override training.max_steps (a quick run)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the run to finish")
    args = ap.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print("PREFECT_API_URL is not set: load the stack's env file (see the docstring)", file=sys.stderr)
        return 2

    from prefect.deployments import run_deployment

    doc = yaml.safe_load(args.spec.read_text())
    if args.max_steps:
        doc["training"]["max_steps"] = args.max_steps
    # The worker reads `base_dir` (relative paths in the spec resolve against it): send an absolute path.
    params = {"spec": doc, "source": args.spec.name, "base_dir": str(args.spec.resolve().parent)}
    # run_deployment creates the flow run and polls it until it is final or `timeout` seconds have passed.
    run = run_deployment(args.deployment, parameters=params, timeout=args.timeout, poll_interval=5)
    state = run.state
    print(f"flow run {run.id} ({run.name}): {state.type.value if state else 'UNKNOWN'}")
    if state is None or not state.is_final():
        print(f"not finished within {args.timeout:g} s; it keeps running on the worker", file=sys.stderr)
        return 2
    if not state.is_completed():
        print(f"failed: {state.message}", file=sys.stderr)
        return 1
    # The job's record (the flow run id links them); the same store the worker wrote when it shares TRAINFORGE_HOME.
    from trainforge.registry.jobs import JobStore

    records = [r for r in JobStore().list() if r.data.get("flow_run_id") == str(run.id)]
    if records:
        data = records[0].data
        print(json.dumps({k: data.get(k) for k in ("job_id", "state", "mlflow_run_id", "model")}, indent=1,
                         default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
