"""A peer's /metrics (``swarm peer --metrics-port N``): its ``PeerMetrics`` in Prometheus text format.

prometheus-client's own HTTP server, on a daemon thread; each scrape reads a copy of the stats, so the
training loop never waits for it.  Cumulative fields are counters (``_total``), the rest gauges.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.v1 import coordinator_pb2 as pb

# PeerMetrics field -> (Prometheus name, help); counters get "_total" from prometheus-client
COUNTERS = {
    "bytes_sent": ("swarm_peer_bytes_sent", "Bytes this peer sent in exchanges"),
    "bytes_received": ("swarm_peer_bytes_received", "Bytes this peer received in exchanges"),
    "tokens": ("swarm_peer_tokens", "Tokens this peer trained on"),
    "inner_steps": ("swarm_peer_inner_steps", "Inner steps this peer took"),
    "inner_time_s": ("swarm_peer_inner_seconds", "Seconds of inner steps"),
    "contributions_rejected": ("swarm_peer_contributions_rejected", "Groupmates' contributions left out"),
    "contributions_clipped": ("swarm_peer_contributions_clipped", "Groupmates' contributions clipped"),
    "foreign_messages_dropped": ("swarm_peer_foreign_messages_dropped", "Messages from a non-member dropped"),
}
GAUGES = {
    "round": ("swarm_peer_round", "The round this peer works on"),
    "state_round": ("swarm_peer_state_round", "The committed round of the state it holds"),
    "loss": ("swarm_peer_loss", "Mean training loss of its latest inner steps"),
    "eval_loss": ("swarm_peer_eval_loss", "Its latest evaluation on the held-out split"),
    "tokens_per_s": ("swarm_peer_tokens_per_second", "Training speed"),
    "step_time_s": ("swarm_peer_step_seconds", "Seconds per inner step"),
    "upload_mbit_s": ("swarm_peer_upload_megabits_per_second", "Measured upload"),
    "download_mbit_s": ("swarm_peer_download_megabits_per_second", "Measured download"),
    "rtt_ms": ("swarm_peer_rtt_milliseconds", "Median round trip to groupmates"),
    "wall_time_s": ("swarm_peer_uptime_seconds", "Seconds since the peer started"),
}


class PeerMetricsCollector(Collector):
    def __init__(self, metrics: Callable[[], pb.PeerMetrics], peer_id: Callable[[], str]) -> None:
        self._metrics = metrics
        self._peer_id = peer_id

    def collect(self) -> Iterator[Metric]:
        m = self._metrics()
        labels = {"peer": self._peer_id() or "joining"}
        for field, (name, documentation) in COUNTERS.items():
            family = CounterMetricFamily(name, documentation, labels=list(labels))
            family.add_metric(list(labels.values()), float(getattr(m, field)))
            yield family
        for field, (name, documentation) in GAUGES.items():
            value = float(getattr(m, field))
            if math.isfinite(value):
                family = GaugeMetricFamily(name, documentation, labels=list(labels))
                family.add_metric(list(labels.values()), value)
                yield family
        utilization = m.inner_time_s / m.wall_time_s if m.wall_time_s > 0 else 0.0
        family = GaugeMetricFamily(
            "swarm_compute_utilization_ratio", "Inner-step time over wall time", labels=list(labels)
        )
        family.add_metric(list(labels.values()), utilization)
        yield family


def start_metrics_server(
    metrics: Callable[[], pb.PeerMetrics], peer_id: Callable[[], str], *, port: int, host: str = "127.0.0.1"
) -> tuple[str, Callable[[], None]]:
    """Serve /metrics on ``host:port`` (0: any free port); returns its URL and a function that stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PeerMetricsCollector(metrics, peer_id))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {host}:{port} ({e.strerror}); choose another --metrics-port.") from e

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return f"http://{host}:{server.server_port}/metrics", stop
