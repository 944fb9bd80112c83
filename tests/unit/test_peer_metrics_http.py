"""A peer's /metrics: its stats as Prometheus counters and gauges, parsed as Prometheus would."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peer.report.metrics_http import start_metrics_server
from peer.report.stats import PeerStats
from swarm.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)


def test_a_peers_metrics_are_scraped_with_its_id_and_unmeasured_links_left_out() -> None:
    stats = PeerStats()
    stats.update(state=pb.PEER_STATE_TRAINING, round=3, tokens_per_s=900.0, upload_mbit_s=42.0)
    stats.add(bytes_sent=5000, tokens=640, inner_time_s=2.0)
    url, stop = start_metrics_server(stats.metrics, lambda: "p-1234", port=0)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        with urllib.request.urlopen(url, timeout=10) as response:  # a second scrape: counters are not re-registered
            assert response.status == 200
    finally:
        stop()
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["swarm_peer_bytes_sent_total"].value == 5000
    assert samples["swarm_peer_bytes_sent_total"].labels == {"peer": "p-1234"}
    assert samples["swarm_peer_tokens_total"].value == 640
    assert samples["swarm_peer_round"].value == 3 and samples["swarm_peer_upload_megabits_per_second"].value == 42
    assert 0 < samples["swarm_compute_utilization_ratio"].value
    assert "swarm_peer_rtt_milliseconds" not in samples  # NaN: not measured yet, so not exported


def test_a_taken_metrics_port_is_one_sentence() -> None:
    url, stop = start_metrics_server(PeerStats().metrics, lambda: "", port=0)
    try:
        port = int(url.split(":")[2].split("/")[0])
        with pytest.raises(OSError, match="choose another --metrics-port"):
            start_metrics_server(PeerStats().metrics, lambda: "", port=port)
    finally:
        stop()
