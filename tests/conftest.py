"""Shared test set-up: every test gets its own TRAINFORGE_HOME so nothing touches ~/.trainforge.

Fixture modules live in tests/fixtures/ and are registered here."""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import settings

from tests.fixtures.suite import make_test_home

# The CI runs the property tests on fixed examples (`derandomize`: the same ones every run, so a red CI reproduces
# and a green one is not luck): .ci/run sets TRAINFORGE_HYPOTHESIS_PROFILE=ci. By hand they draw fresh examples
# every run (the default profile); a failure prints the blob that reproduces it. Long hunts for counterexamples
# are run by hand (the counts are in the docs of what each property checks, e.g. docs/scheduler.md).
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("default", print_blob=True)
# `make test-fast`: the inner loop, a small example count (the full counts run in `make test`).
settings.register_profile("fast", max_examples=10, print_blob=True)
settings.load_profile(os.environ.get("TRAINFORGE_HYPOTHESIS_PROFILE", "default"))

# A suite started as a background job of a non-interactive shell (`./.ci/run &`, nohup) inherits SIGINT and
# SIGQUIT *ignored* (POSIX), and every process it spawns would too: `trainforge submit` would then never see
# Ctrl-C and the cancel tests would fail for the launcher's sake. Restore the interactive default here, so the
# processes the tests start get SIGINT at its default disposition as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

pytest_plugins: list[str] = ["tests.fixtures.suite", "tests.fixtures.s3", "tests.fixtures.prefect", "tests.fixtures.lakefs", "tests.fixtures.postgres"]


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch, request):
    # A test that may run a flow (slow, timing) gets a migrated MLflow database in its home.
    tracking = any(request.node.get_closest_marker(m) for m in ("slow", "timing"))
    with make_test_home(tmp_path_factory, monkeypatch, "tf-home", tracking=tracking) as home:
        yield home


@pytest.fixture(scope="session", autouse=True)
def _warm_starters_closed():
    """The offline work's warm starters (registry/offline.py) this test process started end with its session, before
    the leak check looks (they would end with the process anyway: its exit, or their PR_SET_PDEATHSIG)."""
    yield
    from trainforge.registry.offline import close_warm_starters

    close_warm_starters()
