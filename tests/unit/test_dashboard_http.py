"""The dashboard's HTTP side without a browser: the page, its JSON, SVG charts and /metrics in Prometheus format."""

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.http.server import DASHBOARD_URL_FILE, DashboardServer
from coordinator.http.snapshot import snapshot
from coordinator.server import CoordinatorServer
from coordinator.store.database import STORE_FILE, Store
from tests.unit.test_history import RUN, _run_two_rounds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers.get("Content-Type", ""), response.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_live_coordinator_serves_its_page_state_and_metrics(tmp_path: Path) -> None:
    server = CoordinatorServer(run=RUN, state_dir=tmp_path / "c", http_port=0)
    server.start()
    try:
        group = _run_two_rounds(server)
        url = (tmp_path / "c" / DASHBOARD_URL_FILE).read_text().strip()
        assert url == server.dashboard.url and url.startswith("http://127.0.0.1:")
        kind, page = _get(url)
        assert kind.startswith("text/html") and "api/state" in page and "<script src" not in page  # works offline
        _, text = _get(url + "api/state")
        state = json.loads(text)
        assert [r["outcome"] for r in state["rounds"]] == ["committed", "voided"]
        assert state["run"]["rounds_committed"] == 1 and state["run"]["rounds_voided"] == 1
        assert sorted(p["id"] for p in state["peers"]) == sorted(group)
        loss_svg = state["charts"]["loss"]
        assert loss_svg.count('data-series="train"') == 1 and loss_svg.count('data-series="eval"') == 1
        kind, metrics = _get(url + "metrics")
    finally:
        server.stop()
    assert kind.startswith("text/plain")
    samples = _samples(metrics)
    assert samples[("swarm_rounds_committed_total", ())] == 1
    assert samples[("swarm_rounds_voided_total", ())] == 1
    assert samples[("swarm_bytes_sent_total", ())] >= 0
    assert ("swarm_exchange_seconds", ()) in samples and ("swarm_compute_utilization_ratio", ()) in samples
    assert ("swarm_peers_evicted_total", ()) in samples and ("swarm_contributions_rejected_total", ()) in samples
    speeds = {
        dict(labels)["peer"]: v for (name, labels), v in samples.items() if name == "swarm_peer_tokens_per_second"
    }
    assert speeds == {peer_id: 1234.0 for peer_id in group}


def test_a_finished_runs_state_dir_serves_the_same_page(tmp_path: Path) -> None:
    server = CoordinatorServer(run=RUN, state_dir=tmp_path / "c")
    server.start()
    try:
        _run_two_rounds(server)
    finally:
        server.stop()
    store = Store(tmp_path / "c" / STORE_FILE, read_only=True)
    dashboard = DashboardServer(lambda: snapshot(store))
    try:
        url = dashboard.start()
        state = json.loads(_get(url + "api/state")[1])
    finally:
        dashboard.stop()
        store.close()
    assert [r["round"] for r in state["rounds"]] == [1, 2] and len(state["peers"]) == 2


def test_a_taken_http_port_is_one_sentence(tmp_path: Path) -> None:
    first = DashboardServer(lambda: {"run": None, "rounds": [], "peers": []})
    url = first.start()
    try:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        with pytest.raises(
            OSError, match=r"cannot serve the dashboard on 127\.0\.0\.1:\d+ .*choose another --http-port"
        ):
            DashboardServer(lambda: {}, port=port).start()
    finally:
        first.stop()
