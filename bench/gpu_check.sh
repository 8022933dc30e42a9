#!/usr/bin/env bash
# GPU check (issue 22): trainforge's real worker (torchrun --nproc-per-node=1 -m trainforge.trainer.worker, a
# SegmentConfig built by trainforge.tasks.prepare) on one NVIDIA H200 with CUDA/NCCL at world size 1, for
#   (a) the tiny demo job (examples/tiny-cpu.yaml on 1 x h200) and
#   (b) a ~1B-parameter Llama in bf16 on synthetic tokens, 40 steps with two async checkpoints.
# Checks: measured MFU (metrics events) vs the planner's plan["predicted"]["mfu"] (targets: >= 40%, within 10%),
# async-checkpoint blocked time (checkpoint_staged events; pinned host staging on CUDA), and real NVML telemetry
# (system events with source nvml). Exit 0 when every check that ran passed; numbers in OUT/gpu_check.json.
#
#   bench/gpu_check.sh [--out DIR] [--work DIR]      on the H200 (~6-8 min, no network needed)
#   bench/gpu_check.sh --smoke [--out DIR]           CPU-only smoke (gloo, tiny shapes, ~1.5 min; GPU checks skipped)
#
# Other options: --steps N (1B job), --only tiny|llama1b, --keep, --budget-s S (see bench/gpu_check.py --help).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${repo}/.venv/bin/python"
[[ -x "${py}" ]] || py="$(command -v python3)"
cd "${repo}"
# the script keeps its own budget (470 s on the GPU); this is the backstop for a hung interpreter
exec timeout --kill-after=15 510 "${py}" "${repo}/bench/gpu_check.py" "$@"
