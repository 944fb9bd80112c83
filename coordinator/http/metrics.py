"""The coordinator's /metrics: the dashboard's snapshot as Prometheus counters and gauges (prometheus-client).

Counters are the run's totals (a restarted coordinator reads them back from its store, so they never go
down for the same run); per-peer gauges carry a ``peer`` label (and ``site``).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class SnapshotCollector(Collector):
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        yield from _load(self._state.get("load"))
        run = self._state.get("run")
        if run is None:
            return
        rounds = self._state["rounds"]
        yield _counter("swarm_rounds_committed", "Rounds committed", run["rounds_committed"])
        yield _counter("swarm_rounds_voided", "Rounds voided", run["rounds_voided"])
        yield _counter("swarm_bytes_sent", "Bytes the peers sent in exchanges", run["bytes_sent"])
        yield _counter(
            "swarm_ddp_equivalent_bytes",
            "Bytes per-step data-parallel training would have sent",
            run["ddp_equivalent_bytes"],
        )
        yield _counter("swarm_tokens", "Tokens trained on", run["tokens"])
        yield _counter("swarm_peers_evicted", "Peers evicted", run["peers_evicted"])
        yield _counter(
            "swarm_contributions_rejected", "Contributions left out of an average", run["contributions_rejected"]
        )
        yield _gauge(
            "swarm_exchange_seconds",
            "The last decided round's slowest exchange",
            rounds[-1]["exchange_s"] if rounds else 0.0,
        )
        yield _gauge("swarm_compute_utilization_ratio", "Inner-step time over wall time, all peers", run["utilization"])
        yield _gauge("swarm_round", "The latest round", run["round"])
        yield _gauge("swarm_committed_round", "The latest committed round", run["committed_round"])
        yield _gauge("swarm_peers_alive", "Peers in the run now", run["peers_alive"])
        yield _gauge("swarm_finished", "1 once the run finished", int(run["finished"]))
        if run["eval_loss"] is not None:
            yield _gauge("swarm_eval_loss", "The newest evaluation of the global state", run["eval_loss"])
        yield from self._peers()

    def _peers(self) -> Iterator[Metric]:
        labels = ["peer", "site"]
        families = {
            "tokens_per_s": GaugeMetricFamily("swarm_peer_tokens_per_second", "A peer's training speed", labels=labels),
            "utilization": GaugeMetricFamily(
                "swarm_peer_compute_utilization_ratio", "A peer's inner time over wall time", labels=labels
            ),
            "upload_mbit_s": GaugeMetricFamily(
                "swarm_peer_upload_megabits_per_second", "A peer's measured upload", labels=labels
            ),
            "download_mbit_s": GaugeMetricFamily(
                "swarm_peer_download_megabits_per_second", "A peer's measured download", labels=labels
            ),
            "rtt_ms": GaugeMetricFamily(
                "swarm_peer_rtt_milliseconds", "A peer's median round trip to groupmates", labels=labels
            ),
            "last_seen_s": GaugeMetricFamily(
                "swarm_peer_last_seen_seconds", "Seconds since a peer's last heartbeat", labels=labels
            ),
            "hash_matches": GaugeMetricFamily(
                "swarm_peer_state_hash_matches", "1 when a peer holds the committed state", labels=labels
            ),
            "rounds_missed": CounterMetricFamily(
                "swarm_peer_rounds_missed", "Rounds a peer took part in but missed", labels=labels
            ),
        }
        for peer in self._state["peers"]:
            if not peer["alive"]:
                continue
            for key, family in families.items():
                value = peer[key]
                if value is not None:
                    family.add_metric([peer["id"], peer["site"]], float(value))
        yield from families.values()


def _load(load: Any) -> Iterator[Metric]:
    """The coordinator's own load (coordinator.api.load, coordinator.pace): absent from a finished run's page."""
    if not load:
        return
    refused = CounterMetricFamily(
        "swarm_coordinator_calls_refused",
        "Calls refused because the coordinator was saturated, by method",
        labels=["method"],
    )
    for method, count in sorted(load["refused"].items()):
        refused.add_metric([method], float(count))
    yield refused
    yield _counter("swarm_coordinator_slowdowns", "Times the peers were asked to slow down", load["slowdowns"])
    yield _counter(
        "swarm_coordinator_eviction_pauses",
        "Times evictions for missed leases were paused while the coordinator was saturated",
        load["eviction_pauses"],
    )
    yield _gauge(
        "swarm_coordinator_slowdown_ratio",
        "How many times slower than its pace the peers are asked to call",
        load["slowdown"],
    )
    yield _gauge(
        "swarm_coordinator_overloaded",
        "1 while the coordinator refuses calls or queues them for long",
        int(load["overloaded"]),
    )
    yield _gauge(
        "swarm_coordinator_max_queue_wait_seconds",
        "The longest the server's event loop ran behind (a call's wait for it)",
        load["max_wait_s"],
    )
    yield _gauge(
        "swarm_coordinator_heartbeat_interval_seconds",
        "The heartbeat interval the peers are told",
        load["pace"]["heartbeat_interval_s"],
    )
    yield _gauge("swarm_coordinator_lease_seconds", "The lease a heartbeat renews", load["pace"]["lease_s"])


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=float(value))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def metrics_text(state: dict[str, Any]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(state))
    return generate_latest(registry)
