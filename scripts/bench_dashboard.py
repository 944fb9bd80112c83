#!/usr/bin/env python3
"""What watching a run costs it: the same short real run (a coordinator and 2 peers on loopback, the tiny
model) without any observer, and with a headless browser keeping the dashboard open (the page polls its
state every second) while a scraper fetches /metrics from the coordinator and both peers every second.

    .venv/bin/python scripts/bench_dashboard.py --pairs 3 --rounds 20 --json

The runs alternate (plain, watched, plain, watched, ...) so that drift in the machine's load hits both
alike. A run's speed is its committed rounds per second between the first round's decision and the last
one's (the coordinator's history), so start-up and joins do not count. The last stdout line (with --json)
is one JSON object: each run's rounds/s, the mean of each kind and watched / plain (the target: >= 0.98).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.app.history import history_from_state_dir  # noqa: E402
from swarm.v1 import coordinator_pb2 as pb  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_TOML = """
[model]
preset = "tiny"

[rounds]
inner_steps = {inner_steps}
max_rounds = {rounds}
min_peers = 2
matchmaking_window_s = 10.0
exchange_timeout_s = 10.0
round_timeout_s = 30.0
"""


def spawn(args: list[str], log: Path, stdout=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.app.cli", *args],
        stdout=stdout or open(log, "ab"),
        stderr=open(log, "ab"),
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def read_line(proc: subprocess.Popen, prefix: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"the coordinator printed no {prefix!r} line; see its log")


def peer_metrics_url(log: Path, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"metrics at (http://\S+)", log.read_text(errors="replace")) if log.exists() else None
        if found:
            return found.group(1)
        time.sleep(0.2)  # the peer logs its metrics address once it starts serving
    raise RuntimeError(f"{log.name} logged no metrics address")


class Scraper(threading.Thread):
    """GET every URL once a second, as Prometheus with a 1 s scrape interval would."""

    def __init__(self, urls: list[str], stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.urls, self.stop, self.scrapes, self.failures = urls, stop, 0, 0

    def run(self) -> None:
        while not self.stop.is_set():
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as response:
                        response.read()
                    self.scrapes += 1
                except OSError:
                    self.failures += 1  # a peer that finished stops serving
            self.stop.wait(1.0)


class Browser(threading.Thread):
    """Headless chromium with the dashboard open: the page itself polls the run's state every second."""

    def __init__(self, url: str, profile: Path, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.profile, self.stop, self.error = url, profile, stop, ""
        self.loaded = threading.Event()

    def run(self) -> None:
        from playwright.sync_api import sync_playwright

        try:
            with sync_playwright() as p:
                browser = p.chromium.launch_persistent_context(
                    str(self.profile), executable_path=CHROMIUM, headless=True, args=BROWSER_FLAGS
                )
                try:
                    page = browser.new_page()
                    page.goto(self.url, wait_until="load", timeout=60_000)
                    self.loaded.set()
                    while not self.stop.is_set():
                        page.wait_for_timeout(500)  # lets playwright pump its events while the page polls
                finally:
                    browser.close()
        except Exception as e:  # reported in the result: a watched run without a browser is not a measurement
            self.error = str(e)
            self.loaded.set()


def run_once(workdir: Path, *, watched: bool, rounds: int, inner_steps: int) -> dict:
    workdir.mkdir(parents=True)
    config = workdir / "run.toml"
    config.write_text(RUN_TOML.format(rounds=rounds, inner_steps=inner_steps))
    http = ["--http-port", "0"] if watched else []
    coordinator = spawn(
        [
            "coordinator",
            "--state-dir",
            str(workdir / "coordinator"),
            "--config",
            str(config),
            "--exit-grace-s",
            "1",
            *http,
        ],
        workdir / "coordinator.log",
        stdout=subprocess.PIPE,
    )
    stop, observers, peers = threading.Event(), [], []
    try:
        join = read_line(coordinator, "join: ")
        if watched:  # the page is open before the peers start: chromium's start-up is not the run's cost
            browser = Browser(read_line(coordinator, "dashboard: "), workdir / "chromium-profile", stop)
            browser.start()
            observers.append(browser)
            browser.loaded.wait(120)
        for name in ("a", "b"):
            metrics = ["--metrics-port", "0"] if watched else []
            peers.append(
                spawn(
                    [
                        "peer",
                        "--join",
                        join,
                        "--state-dir",
                        str(workdir / name),
                        "--threads",
                        "1",
                        "--name",
                        name,
                        *metrics,
                    ],
                    workdir / f"{name}.log",
                )
            )
        if watched:
            urls = [browser.url + "metrics"] + [peer_metrics_url(workdir / f"{n}.log") for n in ("a", "b")]
            observers.append(Scraper(urls, stop))
            observers[-1].start()
        codes = [p.wait(timeout=900) for p in peers]
        if any(codes):
            raise RuntimeError(f"a peer exited with {codes}; see the logs in {workdir}")
        coordinator.wait(timeout=120)
    finally:
        stop.set()
        for proc in [*peers, coordinator]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for thread in observers:
            thread.join(timeout=30)
    history = history_from_state_dir(workdir / "coordinator")
    committed = [r for r in history.rounds if r.outcome == pb.ROUND_OUTCOME_COMMITTED]
    span_s = committed[-1].decided_at - committed[0].decided_at if len(committed) > 1 else float("nan")
    result = {
        "watched": watched,
        "rounds_committed": len(committed),
        "peer_exit_codes": codes,
        "rounds_per_s": round((len(committed) - 1) / span_s, 4) if span_s > 0 else None,
    }
    if watched:
        browser, scraper = observers
        result |= {"browser_error": browser.error, "scrapes": scraper.scrapes, "scrape_failures": scraper.failures}
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="plain/watched pairs, run alternately (default 3)")
    parser.add_argument("--rounds", type=int, default=20, help="committed rounds per run (default 20)")
    parser.add_argument("--inner-steps", type=int, default=5, help="H (default 5: short rounds, where any cost shows)")
    parser.add_argument("--workdir", type=Path, help="keep the runs' logs here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="last stdout line: the result as JSON")
    args = parser.parse_args(argv)
    if not Path(CHROMIUM).exists():
        parser.error(f"{CHROMIUM} is missing; run scripts/setup.sh as root on Debian (it installs chromium).")
    if args.pairs < 1 or args.rounds < 3:
        parser.error("--pairs must be at least 1 and --rounds at least 3.")
    base = args.workdir or Path(tempfile.mkdtemp(prefix="swarm-bench-dashboard-"))
    runs = []
    for pair in range(args.pairs):
        for watched in (False, True):
            name = f"{pair}-{'watched' if watched else 'plain'}"
            runs.append(run_once(base / name, watched=watched, rounds=args.rounds, inner_steps=args.inner_steps))
            print(f"{name}: {runs[-1]}", file=sys.stderr, flush=True)
    plain = [r["rounds_per_s"] for r in runs if not r["watched"] and r["rounds_per_s"]]
    watched = [r["rounds_per_s"] for r in runs if r["watched"] and r["rounds_per_s"]]
    ratio = statistics.mean(watched) / statistics.mean(plain) if plain and watched else None
    summary = {
        "runs": runs,
        "plain_rounds_per_s": round(statistics.mean(plain), 4) if plain else None,
        "watched_rounds_per_s": round(statistics.mean(watched), 4) if watched else None,
        "watched_over_plain": round(ratio, 4) if ratio else None,
        "within_2_percent": ratio is not None and ratio >= 0.98,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "workdir": str(base),
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
