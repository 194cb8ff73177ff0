"""The live dashboard in a real headless Chromium (Debian's, driven by selenium).

The page of one replica is loaded while a load runs on it; the test reads the numbers the
page rendered and sees them change, and keeps a screenshot as an artifact
(``build/test-artifacts/dashboard.png``).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.deploy.conftest import REPO, require_tool

pytestmark = pytest.mark.slow

ARTIFACT = REPO / "build" / "test-artifacts" / "dashboard.png"
# Flags Chromium needs here: no sandbox as root, and no background connections (refused by
# a machine without a network).
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1100",
)


@pytest.fixture
def browser():
    chromium = require_tool("chromium")
    chromedriver = require_tool("chromedriver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=Service(chromedriver), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def read_number(driver, element_id: str) -> float | None:
    text = driver.find_element("id", element_id).text.replace("%", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def wait_until(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the page did not show it in time"
        time.sleep(0.3)


def test_dashboard_renders_live_numbers(replicas, browser):
    replica = next(r for r in replicas if r.proc.poll() is None)
    browser.get(replica.url + "/dashboard")
    wait_until(lambda: browser.find_element("id", "status").text == "live")
    assert browser.find_element("id", "model-name").text == "SmolLM2-135M-Instruct"
    assert "max_num_seqs" in browser.find_element("id", "config").text
    generated_before = read_number(browser, "generation-tokens-total")
    requests_before = read_number(browser, "requests-total")
    assert generated_before is not None and requests_before is not None

    def load() -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The sea", "max_tokens": 40,
                "ignore_eos": True}  # fmt: skip
        threads = [
            threading.Thread(target=replica.post, args=("/v1/completions", body))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        # while the load runs: tokens/s above zero, then the totals grow
        wait_until(lambda: (read_number(browser, "gen-tps") or 0) > 0)
        wait_until(lambda: read_number(browser, "generation-tokens-total") > generated_before)
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACT))
    finally:
        loader.join()
    wait_until(lambda: read_number(browser, "requests-total") >= requests_before + 3)
    assert read_number(browser, "generation-tokens-total") >= generated_before + 120
    # the charts were drawn (uPlot renders into canvases)
    assert len(browser.find_elements("css selector", ".uplot canvas")) >= 5
    assert Path(ARTIFACT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
