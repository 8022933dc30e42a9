"""scripts/setup-debian.sh: reports each package, does nothing when all are present, names what is missing, and
refuses clearly without root. Never installs anything and never touches the network: --check, and a non-root run
that stops before apt-get.

No test depends on where the checkout lives: the run as another user (`nobody`, when the tests run as root) reads
the script from its standard input in `/`, so a checkout under a folder other users cannot enter (root's home, 0700)
passes too; `test_a_checkout_other_users_cannot_enter_still_gets_the_root_message` runs it from such a folder.

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


def _run(*args: str, packages: str | None = None, user: str | None = None,
         script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINFORGE_SETUP_PACKAGES"}
    if packages is not None:
        env["TRAINFORGE_SETUP_PACKAGES"] = packages
    if not user:
        return subprocess.run([str(script), *args], env=env, capture_output=True, text=True, timeout=60)
    # Another user may not be able to enter the checkout's folders (a checkout in root's 0700 home): bash reads the
    # script from stdin, run in `/`, so no path of the checkout is opened as that user.
    with script.open("rb") as source:
        done = subprocess.run(["runuser", "-u", user, "--", "bash", "-s", "--", *args], stdin=source, env=env,
                              cwd="/", capture_output=True, timeout=60)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


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


def _says_how_to_run_it_without_root(script: Path) -> None:
    if os.geteuid() == 0:
        user = "nobody"
        if shutil.which("runuser") is None:
            pytest.skip("no runuser to drop root")
    else:
        user = None
        if shutil.which("sudo") and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
            pytest.skip("passwordless sudo: the script would use it")
    out = _run(packages=f"dpkg {MISSING}", user=user, script=script)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "needs root" in out.stderr and f"apt-get install {MISSING}" in out.stderr


def test_without_root_it_says_how_to_run_it():
    _says_how_to_run_it_without_root(SCRIPT)


def test_a_checkout_other_users_cannot_enter_still_gets_the_root_message(tmp_path: Path):
    """The check above, from a copy of the checkout's script in a 0700 folder (as in root's home): `nobody` could
    not open that path, so a run that did would say "Permission denied" instead of "needs root"."""
    if os.geteuid() != 0:
        pytest.skip("only root drops to another user here; as that user the checkout's location does not matter")
    private = tmp_path / "private"
    (private / "checkout" / "scripts").mkdir(parents=True)
    private.chmod(0o700)
    copy = private / "checkout" / "scripts" / SCRIPT.name
    shutil.copy2(SCRIPT, copy)
    denied = subprocess.run(["runuser", "-u", "nobody", "--", "test", "-r", str(copy)], capture_output=True)
    assert denied.returncode != 0, "nobody can read the copy: the folder does not stand for a 0700 home"
    _says_how_to_run_it_without_root(copy)


def test_unknown_option_is_refused():
    out = _run("--frobnicate")
    assert out.returncode == 2 and "unknown option '--frobnicate'" in out.stderr
