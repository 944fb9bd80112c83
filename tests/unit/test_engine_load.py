"""The coordinator's per-call cost: a heartbeat that changes nothing the run decides by writes nothing
at once, yet every change of membership or state is durable immediately."""

import pytest

from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from coordinator.store.peer_writes import METRICS_PERSIST_S
from swarm.config import RunConfig
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = pytest.mark.timeout(30)


class CountingStore(Store):
    def __init__(self, path) -> None:
        super().__init__(path)
        self.peer_writes = 0

    def put_peer(self, peer) -> None:
        self.peer_writes += 1
        super().put_peer(peer)


def beat(engine: CoordinatorEngine, peer_id: str, state: int = pb.PEER_STATE_JOINING, tokens: int = 0) -> pb.RoundInfo:
    return engine.heartbeat(
        pb.HeartbeatRequest(
            peer_id=peer_id,
            metrics=pb.PeerMetrics(state=state, state_round=-1, tokens=tokens, dht_peer_id="dht-" + peer_id),
        )
    )


def test_heartbeats_write_a_peer_only_on_a_change_or_every_few_seconds(tmp_path) -> None:
    now = [1_000.0]
    store = CountingStore(tmp_path / "c.sqlite3")
    engine = CoordinatorEngine(store, config=RunConfig(), clock=lambda: now[0])
    peer, _ = engine_join(engine)
    beat(engine, peer.peer_id)
    written = store.peer_writes
    for i in range(4):  # only the lease and the counters change
        now[0] += 1.0
        beat(engine, peer.peer_id, tokens=i)
    assert store.peer_writes == written
    now[0] += METRICS_PERSIST_S
    beat(engine, peer.peer_id, tokens=99)  # the counters reach the store every few seconds
    assert store.peer_writes == written + 1
    beat(engine, peer.peer_id, state=pb.PEER_STATE_READY, tokens=99)  # a state change is written at once
    assert store.peer_writes == written + 2
    store.close()
    reopened = CoordinatorEngine(Store(tmp_path / "c.sqlite3"), config=RunConfig(), clock=lambda: now[0])
    status = {p.id: p for p in reopened.status(reopened.run.token).peers}
    assert status[peer.peer_id].state == "ready" and status[peer.peer_id].metrics.tokens == 99


def test_many_peers_heartbeat_with_live_and_behind_counted(tmp_path) -> None:
    now = [1_000.0]
    engine = CoordinatorEngine(Store(":memory:"), config=RunConfig(), clock=lambda: now[0])
    peers = [engine_join(engine)[0].peer_id for _ in range(300)]
    for p in peers:
        info = beat(engine, p)
    assert (info.live_peers, info.behind_peers) == (300, 300)  # none holds round 0's state yet
    engine.leave(peers[0], "bye")
    assert beat(engine, peers[1]).live_peers == 299
