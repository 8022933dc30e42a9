"""scripts/setup-debian.sh: reports each package, does nothing when all are present, names what is missing, and
refuses clearly without root. Never installs anything and never touches the network: --check, and a non-root run
that stops before apt-get.

Run: .venv/bin/python -m pytest tests/unit/test_setup_debian.py -q
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "setup-debian.sh"
MISSING = "tf-no-such-package-0xdead"

pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="not a Debian-based system")


def _run(*args: str, packages: str | None = None, user: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINFORGE_SETUP_PACKAGES"}
    if packages is not None:
        env["TRAINFORGE_SETUP_PACKAGES"] = packages
    cmd = [str(SCRIPT), *args]
    if user:
        cmd = ["runuser", "-u", user, "--", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_the_default_list_covers_the_stack_and_the_browser_test():
    out = _run("--check")
    for pkg in ("postgresql", "chromium", "chromium-driver", "git"):
        assert f"  {pkg}\n" in out.stdout.replace("present ", "").replace("missing ", ""), out.stdout
    assert "chromium" not in _run("--check", "--no-browser").stdout


def test_nothing_to_do_when_everything_is_present():
    out = _run("--check", packages="dpkg")  # dpkg is on every Debian system
    assert out.returncode == 0 and "present  dpkg" in out.stdout and "nothing to do" in out.stdout
    again = _run(packages="dpkg")  # without --check too: no root needed, no apt-get run
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_check_names_what_is_missing():
    out = _run("--check", packages=f"dpkg {MISSING}")
    assert out.returncode == 1
    assert f"missing  {MISSING}" in out.stdout and f"Missing: {MISSING}" in out.stderr


def test_without_root_it_says_how_to_run_it():
    if os.geteuid() == 0:
        user = "nobody"
        if shutil.which("runuser") is None:
            pytest.skip("no runuser to drop root")
    else:
        user = None
        if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
            pytest.skip("passwordless sudo: the script would use it")
    out = _run(packages=f"dpkg {MISSING}", user=user)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "needs root" in out.stderr and f"apt-get install {MISSING}" in out.stderr


def test_unknown_option_is_refused():
    out = _run("--frobnicate")
    assert out.returncode == 2 and "unknown option '--frobnicate'" in out.stderr
