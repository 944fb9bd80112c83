"""The dashboard of a real run (coordinator + 2 peers, tiny model), looked at in a real headless browser.

Needs Debian's chromium (scripts/setup.sh installs it as root) and the playwright package; skips saying
which is missing.  The screenshot lands in the test's tmp dir, and in $SWARM_SCREENSHOT_DIR when set.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import ROOT, TWO_PEER_RUN, Swarm, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
LAUNCH_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _browser_or_skip():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/setup.sh as root on Debian (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is missing: run scripts/setup.sh (pip install -e '.[dev]')")
    return sync_playwright


def _read_dashboard_url(swarm: Swarm) -> str:
    line = swarm.coordinator.stdout.readline().decode()
    assert line.startswith("dashboard: http://127.0.0.1:"), line
    return line.split(" ", 1)[1].strip()


def test_the_dashboard_of_a_real_run_shows_its_peers_and_loss_curve(tmp_path: Path) -> None:
    sync_playwright = _browser_or_skip()
    config = tmp_path / "run.toml"
    config.write_text(TWO_PEER_RUN)
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--config", str(config), "--http-port", "0", "--linger-s", "120")
        url = _read_dashboard_url(swarm)
        swarm.start_peer("a")
        swarm.start_peer("b")
        assert swarm.wait_peers(timeout_s=150) == {"a": 0, "b": 0}
        history = json.loads(
            subprocess.run(
                [sys.executable, "-m", "swarm.app.cli", "history", swarm.join, "--json"],
                cwd=ROOT,
                capture_output=True,
                check=True,
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
            ).stdout
        )
        committed = sum(r["outcome"] == "committed" for r in history["rounds"])
        assert committed == 2
        shot = tmp_path / "dashboard.png"
        with sync_playwright() as p:
            # a new, empty profile (playwright passes it as --user-data-dir)
            browser = p.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=LAUNCH_FLAGS,
                viewport={"width": 1400, "height": 900},
            )
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url, wait_until="load", timeout=30_000)
                page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
                # the page polls: wait until it shows the finished run
                poll(
                    lambda: page.locator("[data-key=state] .v").inner_text() == "finished",
                    timeout_s=30,
                    what="the page to show the finished run",
                )
                assert page.locator("#peers tbody tr.peer").count() == 2
                assert page.locator("#chart-loss circle[data-series=train]").count() == committed
                rounds = int(page.locator("body").get_attribute("data-rounds"))
                assert page.locator("#chart-lr circle.pt").count() == rounds  # the schedule's rate per round
                assert page.locator("#chart-utilization").get_attribute("data-y-max") == "1"  # on 0-100%
                for id_cell in page.locator("#peers tbody td.id").all():  # short ids, the whole one on hover
                    assert id_cell.get_attribute("title").startswith(id_cell.inner_text())
                assert "e+" not in page.evaluate("document.body.innerText")
                page.screenshot(path=str(shot), full_page=True)
            finally:
                browser.close()
        assert errors == [], f"the page logged errors: {errors}"
        assert shot.stat().st_size > 10_000
        if os.environ.get("SWARM_SCREENSHOT_DIR"):
            Path(os.environ["SWARM_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, Path(os.environ["SWARM_SCREENSHOT_DIR"]) / "dashboard.png")
    finally:
        swarm.close()
