"""A peer's metrics travel as one PeerMetrics: PeerStats fills it, the heartbeat carries it, the
coordinator keeps it and `swarm status` shows it, field for field."""

import math

import pytest
from rich.console import Console

from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from peer.report.stats import PeerStats
from swarm.app.status import status_tables, status_to_dict
from swarm.config import RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(20)


def test_update_sets_add_accumulates_and_the_request_carries_a_copy() -> None:
    stats = PeerStats()
    stats.update(state=pb.PEER_STATE_READY, round=3, state_hash="h2", state_round=2, dht_maddrs=("/a", "/b"))
    stats.add(bytes_sent=10, tokens=100, inner_time_s=0.5)
    stats.add(bytes_sent=5, inner_time_s=0.25)
    stats.update(dht_maddrs=("/c",), round=0)  # a list is replaced, a zero is set
    request = stats.heartbeat_request("p-1")
    m = request.metrics
    assert request.peer_id == "p-1" and m.state == pb.PEER_STATE_READY and m.round == 0
    assert (m.state_hash, m.state_round, list(m.dht_maddrs)) == ("h2", 2, ["/c"])
    assert (m.bytes_sent, m.tokens, m.inner_time_s) == (15, 100, 0.75)
    assert math.isnan(m.loss) and math.isnan(m.eval_loss)  # not measured yet
    assert m.wall_time_s > 0
    m.bytes_sent = 0
    assert stats.heartbeat_request("p-1").metrics.bytes_sent == 15  # the request does not alias the stats


def test_a_name_that_is_not_a_metric_is_refused() -> None:
    with pytest.raises(ValueError, match='no "bogus" field'):
        PeerStats().update(bogus=1)


def test_what_a_peer_measures_is_what_status_shows() -> None:
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig())
    peer, _ = engine_join(engine, name="a")
    stats = PeerStats()
    stats.update(
        state=pb.PEER_STATE_READY,
        state_hash=engine.run.initial_hash,
        state_round=0,
        model_fingerprint=engine.run.model_fingerprint,
        param_count=9,
        dht_peer_id="Qm",
        loss=2.5,
        tokens_per_s=1234.0,
        eval_loss=3.0,
        eval_round=0,
    )
    stats.add(bytes_sent=2_000_000, inner_time_s=1.0, tokens=640)
    sent = stats.heartbeat_request(peer.peer_id)
    engine.heartbeat(sent)

    (shown,) = engine.status(engine.run.token).peers
    assert shown.metrics == sent.metrics
    status = status_to_dict(engine.status(engine.run.token))
    metrics = status["peers"][0]["metrics"]
    assert metrics["state"] == "PEER_STATE_READY" and metrics["bytes_sent"] == 2_000_000 and metrics["loss"] == 2.5
    assert status["totals"]["tokens"] == 640
    console = Console(width=200, record=True)
    for table in status_tables(status):
        console.print(table)
    row = next(line for line in console.export_text().splitlines() if peer.peer_id in line)
    for shown_text in ("ready", engine.run.initial_hash[:8], "1,234", "2.500", "2.0 MB"):
        assert shown_text in row, row
