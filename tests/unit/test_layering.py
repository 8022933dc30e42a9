"""The pure core stays pure: importing spec and plan pulls in no torch.distributed, prefect or mlflow.

Run: pytest tests/unit/test_layering.py
"""

import subprocess
import sys

import pytest

FORBIDDEN = ("torch", "torch.distributed", "prefect", "mlflow", "deepspeed", "boto3")


@pytest.mark.parametrize("module", ["trainforge.spec", "trainforge.plan", "trainforge.plan.memory",
                                    "trainforge.plan.resolve", "trainforge.validate", "trainforge.cli"])
def test_pure_modules_import_no_heavy_frameworks(module):
    code = (
        f"import sys, {module}\n"
        f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"{module} imported {out.stdout.strip()}"
