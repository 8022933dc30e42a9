"""Headless Chromium opens the MLflow UI of a finished demo run and the job's HTML report, and checks the loss
chart is drawn in both: MLflow's own chart of the `loss` metric (one vertex per training step), the report.html
artifact inside MLflow's artifact viewer, and the report file itself. Screenshots are kept (see conftest.py).

The run is real: the tiny demo job (2 CPU workers, 6 steps) through the train-job flow, tracked in a SQLite store
that a real `mlflow server` serves to the browser.

Run: .venv/bin/python -m pytest tests/browser -q -rA   (deselect with -m "not browser")
"""

from __future__ import annotations

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
from tests.integration.test_train_job import run_flow, small_spec

# Skip before any fixture starts servers (the `chrome` fixture says the same, for other browser tests).
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(find_chromium() is None and os.environ.get("TRAINFORGE_REQUIRE_BROWSER") != "1",
                                 reason="Chromium is not installed: apt-get install -y chromium chromium-driver "
                                        "(`make test` does it when run as root on Debian)")]
STEPS = 6


class MlflowServer:
    """`mlflow server` on a free loopback port over the given store (its own process group, stopped by pid)."""

    def __init__(self, store_uri: str, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no extra job processes
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                 str(self.port), "--workers", "1", "--backend-store-uri", store_uri],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"mlflow server not ready in {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own group: the uvicorn worker goes with it
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def vertices(path_d: str) -> int:
    return sum(path_d.count(c) for c in "ML")


def test_mlflow_ui_and_job_report_show_the_loss_chart(prefect_api, chrome, screenshots, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.registry.jobs import JobStore
    from trainforge.registry.tracking import Tracker, tracking_uri

    t0 = time.monotonic()
    ensure_demo_dataset()
    experiment = Tracker().experiment_id("demo")  # creates the store first: the server then only opens it
    server = MlflowServer(tracking_uri(), tmp_path / "mlflow-server.log")
    try:
        doc = small_spec(max_steps=STEPS)
        doc["checkpoint"]["interval_steps"] = 3
        doc["evaluation"]["batches"] = 1
        result = run_flow(doc)  # trains while the server starts
        assert result["state"] == "completed"
        t_job = time.monotonic()
        server.wait_ready(120)
        run_id = result["mlflow_run_id"]
        # React and plotly re-render while data arrives: an element found a moment ago may be replaced.
        wait = WebDriverWait(chrome, 60, poll_frequency=0.25,
                             ignored_exceptions=(NoSuchElementException, StaleElementReferenceException))

        # 1. MLflow's run page, model metrics tab, filtered to the loss charts.
        chrome.get(f"{server.url}/#/experiments/{experiment}/runs/{run_id}/model-metrics")
        box = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[placeholder='Search metric charts']"))
        box.send_keys("loss")
        card = ("//div[@data-testid='experiment-view-compare-runs-card']"
                "[.//h4[normalize-space(text())='loss']]")
        line = wait.until(lambda d: next((p for p in d.find_elements(By.XPATH, card + "//*[name()='path']")
                                          if "js-line" in (p.get_attribute("class") or "")
                                          and vertices(p.get_attribute("d") or "") == STEPS), None))
        assert line.size["width"] > 50  # drawn, not a degenerate path
        chrome.save_screenshot(str(screenshots / "mlflow-model-metrics-loss.png"))

        # 2. The report artifact, rendered by MLflow's artifact viewer (a sandboxed iframe).
        chrome.get(f"{server.url}/#/experiments/{experiment}/runs/{run_id}/artifacts/report.html")
        frame = wait.until(lambda d: d.find_element(By.TAG_NAME, "iframe"))
        chrome.switch_to.frame(frame)
        figure = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "figure#chart-loss"))
        assert figure.find_element(By.CSS_SELECTOR, "svg").is_displayed()
        assert chrome.find_element(By.ID, "job-state").text == "completed"
        chrome.execute_script("arguments[0].scrollIntoView()", figure)
        chrome.switch_to.default_content()
        chrome.save_screenshot(str(screenshots / "mlflow-artifact-report.png"))

        # 3. The report file of the job folder, as a user opens it.
        report = JobStore().get(result["job_id"]).folder / "report.html"
        chrome.get(report.as_uri())
        figure = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "figure#chart-loss"))
        svg = figure.find_element(By.CSS_SELECTOR, "svg")
        assert svg.size["width"] > 300 and svg.size["height"] > 100
        path = figure.find_element(By.CSS_SELECTOR, "g#loss-train-0 path")
        assert vertices(path.get_attribute("d")) == STEPS
        assert figure.find_elements(By.CSS_SELECTOR, "g#loss-eval path")  # eval loss at checkpoints 3 and 6
        chrome.execute_script("arguments[0].scrollIntoView()", svg)  # an element screenshot is cut at the viewport
        svg.screenshot(str(screenshots / "report-loss-chart.png"))
        chrome.set_window_size(1400, 4000)
        chrome.save_screenshot(str(screenshots / "report-page.png"))
        for name in ("mlflow-model-metrics-loss", "mlflow-artifact-report", "report-loss-chart", "report-page"):
            assert (screenshots / f"{name}.png").stat().st_size > 5_000, name
        print(f"job {t_job - t0:.1f} s, browser part {time.monotonic() - t_job:.1f} s; screenshots in {screenshots}")
    finally:
        server.stop()
