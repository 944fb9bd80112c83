"""Status at the size of a large swarm: a GetStatus answer lists one page of peers, found from the roster's
index, with totals kept as peers change, so it costs the same with ten peers or ten thousand."""

import pytest

from coordinator.api.views import totals
from coordinator.engine import CoordinatorEngine
from coordinator.http.metrics import metrics_text
from coordinator.store.database import Store
from swarm.app.status import fetch_all_pages, status_to_dict
from swarm.config import RoundConfig, RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(60)


def test_status_pages_walk_every_listed_peer_once_with_totals_kept_as_peers_change() -> None:
    now = [1_000.0]
    engine = CoordinatorEngine(
        Store(":memory:"), config=RunConfig(rounds=RoundConfig(min_peers=100_000)), clock=lambda: now[0]
    )
    peers = [engine_join(engine)[0].peer_id for _ in range(250)]
    for i, p in enumerate(peers):
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=p,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_JOINING,
                    state_round=-1,
                    tokens=1000 + i,
                    bytes_sent=7,
                    inner_time_s=1.0,
                    wall_time_s=2.0,
                ),
            )
        )
    engine.leave(peers[3], "bye")  # gone lately: still listed
    engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peers[5], metrics=pb.PeerMetrics(tokens=5000, bytes_sent=7, inner_time_s=1.0, wall_time_s=2.0)
        )
    )
    token = engine.run.token
    sizes = []

    def get_page(page_token: str) -> pb.GetStatusResponse:
        page = engine.status(token, page_size=100, page_token=page_token)
        sizes.append(len(page.peers))
        return page

    everything = fetch_all_pages(get_page)
    assert [p.id for p in everything.peers] == peers and sizes == [100, 100, 50]
    whole = totals(list(engine._state.peers.values()), ddp_equivalent_bytes=0)
    assert everything.totals.tokens == whole.tokens == sum(1000 + i for i in range(250)) - 1005 + 5000
    assert everything.totals.bytes_sent == 250 * 7 and everything.totals.compute_utilization == pytest.approx(0.5)
    first = status_to_dict(fetch_all_pages(get_page, max_peers=120))  # what `swarm status` lists by default
    assert [p["id"] for p in first["peers"]] == peers[:120] and first["peers_more"]
    assert "peers_more" not in status_to_dict(fetch_all_pages(get_page, max_peers=250))
    now[0] += 300.0
    newcomer = engine_join(engine)[0].peer_id
    now[0] += 301.0  # the others were last seen over ten minutes ago: counted, not listed
    later = engine.status(token, page_size=100)
    assert later.peers_omitted == 250 and [p.id for p in later.peers] == [newcomer]
    with pytest.raises(Exception, match="page_token"):
        engine.status(token, page_size=10, page_token="x1")


def test_metrics_export_the_coordinators_load() -> None:
    state = {
        "run": None,
        "load": {
            "refused": {"Join": 3},
            "slowdowns": 2,
            "eviction_pauses": 1,
            "slowdown": 4.0,
            "overloaded": True,
            "max_wait_s": 1.5,
            "pace": {"heartbeat_interval_s": 6.7, "lease_s": 50.0, "poll_interval_s": 6.7},
        },
    }
    text = metrics_text(state).decode()
    assert 'swarm_coordinator_calls_refused_total{method="Join"} 3.0' in text
    assert "swarm_coordinator_heartbeat_interval_seconds 6.7" in text
    assert "swarm_coordinator_eviction_pauses_total 1.0" in text and "swarm_coordinator_overloaded 1.0" in text
