"""Headless Chromium opens the Prefect UI's "custom run" page of the `train-job` deployment and checks it is a form
of the job spec's fields (the flow's `spec` parameter is a JobSpec, not a raw JSON box): the deployment registered
from prefect.yaml by `prefect deploy` on a real `prefect server start` (UI on). A screenshot is kept.

Run: .venv/bin/python -m pytest tests/browser/test_prefect_ui.py -q -rA   (deselect with -m "not browser")
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browser.conftest import find_chromium

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(find_chromium() is None and os.environ.get("TRAINFORGE_REQUIRE_BROWSER") != "1",
                                 reason="Chromium is not installed: apt-get install -y chromium chromium-driver "
                                        "(`make test` does it when run as root on Debian)")]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class PrefectServer:
    """`prefect server start` with its UI on a free loopback port and its own PREFECT_HOME (own process group)."""

    def __init__(self, home: Path, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{self.url}/api",
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1",
                    "TRAINFORGE_GIT_URL": str(REPO)}
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                          str(self.port)], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"prefect server not ready in {timeout_s} s: {self.log.read_text()[-2000:]}")

    def prefect(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run([str(BIN / "prefect"), *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=timeout_s)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    def api(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}/api{path}", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def test_a_deployment_run_of_train_job_is_a_form_of_the_job_spec(chrome, screenshots, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = PrefectServer(tmp_path / "prefect-home", tmp_path / "prefect-server.log")
    try:
        server.wait_ready(180)
        server.prefect("work-pool", "create", "trainforge", "--type", "process")
        server.prefect("--no-prompt", "deploy", "--name", "train-job")
        deployment = server.api("/deployments/name/train-job/train-job")
        assert deployment["parameter_openapi_schema"]["properties"]["spec"]["$ref"] == "#/definitions/JobSpec"

        chrome.get(f"{server.url}/deployments/deployment/{deployment['id']}/run")
        wait = WebDriverWait(chrome, 90, poll_frequency=0.5,
                             ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))
        body = wait.until(lambda d: (t := d.find_element(By.TAG_NAME, "body").text) and "Team" in t and t)
        chrome.save_screenshot(str(screenshots / "prefect-train-job-run-form.png"))
        # The spec's own fields, labelled with their titles and help (the field docstrings), as form inputs.
        for title in ("Name", "Team", "Code", "Dataset", "Resources", "Training", "Priority"):
            assert title in body, f"{title!r} not on the run page:\n{body[:3000]}"
        assert "Owning team: quotas, fair share" in body  # JobSpec.team's docstring as the field's help
        inputs = chrome.find_elements(By.CSS_SELECTOR, "input, select, button[role='combobox'], textarea")
        assert len(inputs) >= 10, f"{len(inputs)} inputs: a form, not one JSON box"
        assert (screenshots / "prefect-train-job-run-form.png").stat().st_size > 5_000
    finally:
        server.stop()
