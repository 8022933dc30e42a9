"""Browser tests: headless Chromium from Debian's packages (`chromium`, `chromium-driver`) driven by Selenium.

They are marked `browser` (deselect with `-m "not browser"`) and skip, saying why, only when Chromium or its
driver is not installed; `make test` installs both when it runs as root on Debian, and with
TRAINFORGE_REQUIRE_BROWSER=1 (set by .ci/run) a missing browser fails instead. Screenshots go to
$TRAINFORGE_TEST_ARTIFACTS/browser (default: $TMPDIR/trainforge-test-artifacts/browser), named at the end of the
run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

SCREENSHOT_DIRS: list[Path] = []
# Debian's /usr/bin/chromium is a shell wrapper; chromedriver needs the binary itself.
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "browser: drives headless Chromium (deselect with -m 'not browser')")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001 (pytest's hook signature)
    for folder in SCREENSHOT_DIRS:
        terminalreporter.write_line(f"browser screenshots: {folder}")


def find_chromium() -> tuple[str, str] | None:
    """(chromium binary, chromedriver) when both are installed."""
    driver = shutil.which("chromedriver")
    for candidate in CHROMIUM_CANDIDATES:
        binary = candidate if os.path.isabs(candidate) and os.access(candidate, os.X_OK) else shutil.which(candidate)
        if binary and driver:
            return binary, driver
    return None


@pytest.fixture
def chrome():
    """A headless Chromium session; Selenium Manager is never asked for anything (the driver path is given)."""
    paths = find_chromium()
    if paths is None and os.environ.get("TRAINFORGE_REQUIRE_BROWSER") == "1":  # the CI: never a silent skip
        pytest.fail("TRAINFORGE_REQUIRE_BROWSER=1 but chromium / chromedriver are not installed: "
                    "scripts/setup-debian.sh (as root) installs them")
    if paths is None:
        pytest.skip("Chromium is not installed: apt-get install -y chromium chromium-driver "
                    "(`make test` does it when run as root on Debian)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = paths
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--no-first-run", "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def screenshots(request) -> Path:
    # Not under pytest's basetemp: pytest keeps only its last three, and concurrent sessions rotate them away.
    root = os.environ.get("TRAINFORGE_TEST_ARTIFACTS") or Path(tempfile.gettempdir()) / "trainforge-test-artifacts"
    base = Path(root) / "browser"
    folder = base / request.node.name
    folder.mkdir(parents=True, exist_ok=True)
    if base not in SCREENSHOT_DIRS:
        SCREENSHOT_DIRS.append(base)
    return folder
