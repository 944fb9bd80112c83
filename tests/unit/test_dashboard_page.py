"""The dashboard reads well to a new user: units instead of exponents, labelled axes with round-number ticks,
y ranges that fit each figure, a peer-id column, the learning rate per round and a grid that fills the window.

The page test serves a made-up run of 40 rounds (a coordinator's numbers: 14.5k tokens/s, 45 MB per round,
utilization 0.974-0.999) to Debian's chromium through playwright, and skips saying which is missing.
"""

import json
import math
import re
import urllib.request
from pathlib import Path

import pytest

from coordinator.http.charts import byte_size, percent, plain, run_charts, si
from coordinator.http.server import DashboardServer
from coordinator.http.snapshot import snapshot
from coordinator.server import CoordinatorServer
from coordinator.store.database import STORE_FILE, Store
from swarm.config import RunConfig
from swarm.config.optim_config import InnerOptConfig
from swarm.config.rounds_config import RoundConfig
from swarm.train.schedule import lr_at
from tests.integration.test_dashboard import CHROMIUM, LAUNCH_FLAGS
from tests.unit.test_history import RUN, _run_two_rounds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ROUNDS = 40
PEER_IDS = ("p-2125bedba73c1645", "p-9f0c33e1d2a47b58")


def _rounds() -> list[dict]:
    cfg = InnerOptConfig(lr=6e-4, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1)
    return [
        {
            "round": r,
            "outcome": "committed",
            "participants": 2,
            "holders": 2,
            "codec": "int8",
            "inner_steps": 50,
            "fragments": 1,
            "bytes_sent": 45_100_000 + 1000 * r,
            "ddp_equivalent_bytes": 4_510_000_000,
            "exchange_s": 1.2,
            "inner_s": 60.0,
            "mean_loss": 2.0 + 3.0 * math.exp(-r / 8),
            "eval_loss": 2.1 + 3.0 * math.exp(-r / 8),
            "tokens": 870_000,
            "utilization": 0.974 + 0.025 * (r % 3) / 2,
            "tokens_per_s": 14_500.0 + 37.7 * (r % 5),
            "reason": "",
            "lr": lr_at(cfg, peer_step=50 * r - 1, run_step=50 * r - 1, run_steps=50 * ROUNDS),
        }
        for r in range(1, ROUNDS + 1)
    ]


def _state() -> dict:
    return {
        "run": {
            "run_id": "r-5e1d0c9a",
            "round": ROUNDS,
            "state": "finished",
            "finished": True,
            "committed_round": ROUNDS,
            "committed_hash": "6a7a3458aa",
            "rounds_committed": ROUNDS,
            "rounds_voided": 0,
            "peers_alive": 2,
            "peers_evicted": 0,
            "tokens": 34_800_000,
            "bytes_sent": 1_804_000_000,
            "ddp_equivalent_bytes": 180_400_000_000,
            "utilization": 0.809,
            "contributions_rejected": 0,
            "eval_loss": 2.1234,
            "eval_round": ROUNDS,
            "initial_eval_loss": 5.5,
        },
        "rounds": _rounds(),
        "peers": [
            {
                "id": peer_id,
                "name": "vm",
                "site": "",
                "state": "ready",
                "alive": True,
                "tokens_per_s": 14_512.3,
                "step_time_s": 0.0141,
                "upload_mbit_s": 1234.5,
                "download_mbit_s": 987.6,
                "rtt_ms": 0.1234,
                "rounds_joined": ROUNDS,
                "rounds_missed": 0,
                "state_hash": "6a7a3458aa",
                "state_round": ROUNDS,
                "hash_matches": True,
                "last_seen_s": 1.23,
                "utilization": 0.81,
                "bytes_sent": 902_000_000,
                "loss": 2.01,
            }
            for peer_id in PEER_IDS
        ],
    }


def test_numbers_read_with_their_units() -> None:
    assert si(14_512.3) == "14.5k" and si(999) == "999" and si(2_100_000) == "2.1M" and si(34_800_000_000) == "34.8G"
    assert byte_size(45_100_000) == "45.1 MB" and byte_size(512) == "512 B" and byte_size(999_999) == "1 MB"
    assert percent(0.974) == "97.4%" and percent(1.0) == "100%"
    assert plain(0.0006) == "0.0006" and plain(6e-5) == "0.00006" and plain(1200) == "1200"


def test_every_chart_has_labelled_axes_round_ticks_and_a_range_that_fits() -> None:
    charts = run_charts(_rounds())
    assert set(charts) >= {"loss", "tokens_per_s", "utilization", "bytes", "participants", "lr", "choices"}
    for name, svg in charts.items():
        assert 'class="axis xlabel">round<' in svg, name
        assert re.search(r'class="axis ylabel">[^<]+<', svg), name
        assert "e+" not in svg and "e-0" not in svg, name  # no exponents anywhere, ticks included
        xticks = [int(t) for t in re.findall(r'class="tick xtick">(\d+)<', svg)]
        assert 5 <= len(xticks) <= 8, (name, xticks)
        assert len({b - a for a, b in zip(xticks, xticks[1:])}) == 1, (name, xticks)  # evenly spaced
    assert 'ylabel">tokens/s<' in charts["tokens_per_s"]
    assert re.search(r'class="tick ytick">1\dk<', charts["tokens_per_s"])
    assert re.search(r'class="tick ytick">[\d.]+ GB<', charts["bytes"])
    utilization = charts["utilization"]
    assert 'data-y-min="0" data-y-max="1"' in utilization and "(%)" in utilization
    assert re.findall(r'class="tick ytick">([^<]+)<', utilization) == ["0%", "25%", "50%", "75%", "100%"]
    assert "per round" in utilization  # what the chart is, unlike the card's whole-run figure
    for counter in ("tokens_per_s", "bytes", "participants", "lr"):
        assert 'data-y-min="0"' in charts[counter], counter
    low = float(re.search(r'data-y-min="([^"]+)"', charts["loss"]).group(1))
    assert 0 <= low < min(r["mean_loss"] for r in _rounds())
    assert charts["lr"].count('data-series="lr"') == ROUNDS
    assert re.findall(r'class="tick ytick">([^<]+)<', charts["participants"]) == ["0", "1", "2"]  # whole peers


def test_the_coordinator_derives_each_rounds_learning_rate_from_the_run_config(tmp_path: Path) -> None:
    server = CoordinatorServer(run=RUN, state_dir=tmp_path / "c")
    server.start()
    try:
        _run_two_rounds(server)
    finally:
        server.stop()
    store = Store(tmp_path / "c" / STORE_FILE, read_only=True)
    try:
        rounds = snapshot(store)["rounds"]
    finally:
        store.close()
    inner = RUN.rounds.inner_steps  # constant schedule, warmup 20 steps: rounds 1 and 2 are in the warmup
    assert [r["lr"] for r in rounds] == [lr_at(RUN.inner, peer_step=inner * r - 1) for r in (1, 2)]
    assert rounds[0]["lr"] == pytest.approx(RUN.inner.lr * inner / RUN.inner.warmup_steps)


def test_a_decaying_schedule_falls_to_its_floor_by_the_last_round() -> None:
    from coordinator.http.snapshot import _round_lr

    run = RunConfig(
        rounds=RoundConfig(max_rounds=10, inner_steps=4),
        inner=InnerOptConfig(lr=1e-3, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1),
    )
    rate = _round_lr(run.to_json())
    assert rate(1) == lr_at(run.inner, peer_step=3, run_step=3, run_steps=40)  # the warmup's last step
    assert rate(10) == lr_at(run.inner, peer_step=39, run_step=39, run_steps=40)
    assert 1e-3 > rate(1) > rate(5) > rate(10) > 1e-4 and rate(10) == pytest.approx(1e-4, rel=0.02)


def _browser_or_skip():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: run scripts/setup.sh as root on Debian (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is missing: run scripts/setup.sh (pip install -e '.[dev]')")
    return sync_playwright


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


@pytest.mark.timeout(120)
def test_the_page_reads_well_in_a_1400_px_window(tmp_path: Path) -> None:
    sync_playwright = _browser_or_skip()
    dashboard = DashboardServer(_state)
    url = dashboard.start()
    try:
        with urllib.request.urlopen(url + "api/state", timeout=10) as response:
            assert "e+" not in json.dumps(json.loads(response.read())["charts"])
        with sync_playwright() as p:
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
                visible = page.evaluate(
                    "document.body.innerText + [...document.querySelectorAll('svg text')]"
                    ".map(t => t.textContent).join(' ')"
                )
                assert not re.search(r"\de[+-]\d", visible), visible
                cards = {
                    page.locator(".card .k").nth(i).inner_text(): page.locator(".card .v").nth(i).inner_text()
                    for i in range(page.locator(".card").count())
                }
                assert (
                    cards["tokens"] == "34.8M" and cards["bytes sent"] == "1.8 GB" and cards["utilization"] == "80.9%"
                )
                utilization_card = page.locator("[data-key=utilization]")
                assert "whole run" in utilization_card.inner_text()
                assert "per round" in utilization_card.get_attribute("title")
                # the peers: a short id column, the whole id in its tooltip, speeds with units
                assert page.locator("#peers th").nth(1).inner_text() == "id"
                for i, peer_id in enumerate(PEER_IDS):
                    row = page.locator("#peers tbody tr.peer").nth(i)
                    id_cell = row.locator("td").nth(1)
                    assert id_cell.inner_text() == peer_id[:10] and id_cell.get_attribute("title") == peer_id
                    assert row.locator("td").nth(4).inner_text() == "14.5k tok/s"
                # the charts: labelled axes, the utilization on 0-100%, the lr per round
                for chart in page.locator("svg.chart").all():
                    assert chart.locator(".xlabel").text_content() == "round"
                    assert chart.locator(".ylabel").text_content()
                assert page.locator("#chart-utilization .ylabel").text_content() == "utilization (%)"
                assert page.locator("#chart-tokens .ylabel").text_content() == "tokens/s"
                assert page.locator("#chart-utilization .ytick").all_text_contents() == [
                    "0%",
                    "25%",
                    "50%",
                    "75%",
                    "100%",
                ]
                assert page.locator("#chart-lr circle.pt").count() == ROUNDS
                # no two legend entries overlap, none overlaps the title, and each lies inside its chart
                for chart_id in ("chart-loss", "chart-bytes", "chart-choices"):
                    boxes, frame, title = page.evaluate(
                        "id => { const box = e => { const b = e.getBoundingClientRect();"
                        " return {x: b.x, y: b.y, width: b.width, height: b.height}; };"
                        " return [[...document.querySelectorAll('#' + id + ' g.legend')].map(box),"
                        " box(document.getElementById(id)), box(document.querySelector('#' + id + ' .title'))]; }",
                        chart_id,
                    )
                    assert len(boxes) >= 2 and not any(_overlap(title, b) for b in boxes), (chart_id, title, boxes)
                    for i, a in enumerate(boxes):
                        assert frame["x"] <= a["x"] and a["x"] + a["width"] <= frame["x"] + frame["width"], chart_id
                        assert not any(_overlap(a, b) for b in boxes[i + 1 :]), (chart_id, boxes)
                # the charts fill the window's width, several to a row
                # measured in one evaluation: the page re-renders its charts every second, so a box read chart by
                # chart can catch one between its removal and its replacement
                boxes = page.evaluate(
                    "[...document.querySelectorAll('svg.chart')].map(c => {"
                    " const b = c.getBoundingClientRect();"
                    " return {x: b.x, y: b.y, width: b.width, height: b.height}; })"
                )
                right = max(b["x"] + b["width"] for b in boxes)
                assert right >= 1400 - 16 - 20, right  # the body's margin, a scroll bar
                assert len({round(b["y"]) for b in boxes}) <= 3  # 7 charts on at most 3 rows: 3 to a row
                page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            finally:
                browser.close()
    finally:
        dashboard.stop()
    assert errors == [], f"the page logged errors: {errors}"
