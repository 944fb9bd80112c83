"""Values inside the caps cannot break the coordinator: reports and heartbeats carrying each field's largest valid
value, and stored records holding it (as a store written before reports were cut to what the round asked would),
are decided, recorded and served; after a restart over the same SQLite every RPC still answers, none INTERNAL.

The attack this stands for: two identities reported ``inner_steps = 10**15`` with a third participant pending; the
decision then failed building the round's history row, and every later call, also after a restart, failed with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.api.limits import MAX_COUNT, MAX_SECONDS
from coordinator.api.rate_limit import JoinLimits, Rate
from coordinator.api.servicer import CoordinatorServicer
from coordinator.engine import CoordinatorEngine
from coordinator.http.metrics import metrics_text
from coordinator.http.snapshot import snapshot
from coordinator.rounds.reports import BYTES_PER_PARAMETER
from coordinator.store.database import Store
from coordinator.store.records import OPEN, ReportRecord
from swarm.config import RoundConfig, RunConfig
from swarm.control.signing import CallSigner, signed_join
from swarm.core.trust.credential import PeerKey
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import pooled_identity
from tests.unit.test_limits import Aborted, FakeContext

pytestmark = pytest.mark.timeout(90)

HUGE_LOSS = 1.7e308  # finite: inside the caps


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Coordinator:
    """An engine over ``path`` and its servicer in this process; calls go through the servicer's wrapper (which
    turns any exception into INTERNAL), signed as the peer they name."""

    def __init__(self, path: Path, clock: Clock, signers: dict[str, CallSigner]) -> None:
        config = RunConfig(rounds=RoundConfig(min_peers=3, inner_steps=5, round_timeout_s=60.0, report_grace_s=5.0))
        self.engine = CoordinatorEngine(Store(path), config=config, lease_s=30.0, clock=clock)
        many = Rate(per_s=1000.0, burst=1000)
        self.servicer = CoordinatorServicer(
            self.engine,
            dht_initial_peers=[],
            join_limits=JoinLimits(challenges_per_address=many, joins_per_address=many, joins_per_token=many),
        )
        self.token, self.signers, self.clock = self.engine.run.token, signers, clock

    def call(self, method: str, request: Any) -> Any:
        """The answer; a refusal other than INTERNAL is an answer too (None)."""
        signer = self.signers.get(getattr(request, "peer_id", None) or "")
        metadata = signer.metadata(method, request, now=self.clock()) if signer else None
        try:
            return getattr(self.servicer, method)(request, FakeContext(metadata))
        except Aborted as refusal:
            assert refusal.code != grpc.StatusCode.INTERNAL, f"{method}: {refusal.details}"
            return None

    def join(self, index: int) -> str:
        key = PeerKey.generate()
        nonce = self.call("Challenge", pb.ChallengeRequest()).nonce
        joined = self.call("Join", signed_join(token=self.token, nonce=nonce, key=key, libp2p=pooled_identity(index)))
        self.signers[joined.peer_id] = CallSigner(key, joined.session)
        return joined.peer_id

    def beat(self, peer: str, **extreme: Any) -> Any:
        run = self.engine.run
        return self.call(
            "Heartbeat",
            pb.HeartbeatRequest(
                peer_id=peer,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash=run.initial_hash,
                    model_fingerprint=run.model_fingerprint,
                    param_count=run.param_count,
                    **extreme,
                ),
            ),
        )

    def every_rpc(self, peer: str) -> None:
        """Each of the 8 RPCs once (Leave last), none answering INTERNAL."""
        self.call("Challenge", pb.ChallengeRequest())
        self.call("Join", pb.JoinRequest(token=self.token))  # refused (no signature), not failed
        self.beat(peer)
        self.call("GetRound", pb.GetRoundRequest(peer_id=peer, round=0))
        self.call("GetRound", pb.GetRoundRequest(peer_id=peer, round=1))
        self.call("ReportRound", pb.ReportRoundRequest(peer_id=peer, round=1, ok=False, error="late"))
        status = self.call("GetStatus", pb.GetStatusRequest(token=self.token))
        assert status is not None and status.run.run_id == self.engine.run.run_id
        history = self.call("GetHistory", pb.GetHistoryRequest(token=self.token))
        assert history is not None and [r.round for r in history.rounds][:1] == [1]
        state = snapshot(self.engine._store, now=self.clock())  # the dashboard's and /metrics' source
        json.dumps(state, allow_nan=False)  # a browser's JSON.parse takes it
        metrics_text(state)
        self.call("Leave", pb.LeaveRequest(peer_id=peer, reason="done"))


EXTREME_METRICS = dict(
    loss=HUGE_LOSS,
    step_time_s=MAX_SECONDS,
    tokens_per_s=MAX_SECONDS,
    eval_loss=HUGE_LOSS,
    eval_round=0,
    inner_time_s=MAX_SECONDS,
    wall_time_s=MAX_SECONDS,
    inner_steps=MAX_COUNT,
    tokens=MAX_COUNT,
    bytes_sent=MAX_COUNT,
    bytes_received=MAX_COUNT,
    contributions_rejected=MAX_COUNT,
    contributions_clipped=MAX_COUNT,
    foreign_messages_dropped=MAX_COUNT,
    upload_mbit_s=MAX_SECONDS,
    download_mbit_s=MAX_SECONDS,
    rtt_ms=MAX_SECONDS,
)


def extreme_report(peer: str, round_no: int, group: list[str]) -> pb.ReportRoundRequest:
    return pb.ReportRoundRequest(
        peer_id=peer,
        round=round_no,
        ok=True,
        state_hash="0" * 64,
        group=group,
        samples=MAX_COUNT,
        inner_steps=MAX_COUNT,
        inner_time_s=MAX_SECONDS,
        exchange_time_s=MAX_SECONDS,
        bytes_sent=MAX_COUNT,
        bytes_received=MAX_COUNT,
        loss=HUGE_LOSS,
        param_count=MAX_COUNT,
        upload_mbit_s=MAX_SECONDS,
        download_mbit_s=MAX_SECONDS,
        rtt_ms=MAX_SECONDS,
    )


def test_reports_at_the_caps_are_cut_to_the_round_and_every_rpc_answers_before_and_after_a_restart(tmp_path) -> None:
    clock, signers, path = Clock(), {}, tmp_path / "coordinator.sqlite3"
    coordinator = Coordinator(path, clock, signers)
    a, b, c = (coordinator.join(i) for i in range(3))
    for peer in (a, b, c):
        coordinator.beat(peer, **EXTREME_METRICS)
    assert coordinator.engine.round_info(a, 1).outcome == pb.ROUND_OUTCOME_OPEN
    for peer in (a, b):  # c stays pending: the round is decided by the grace after a and b's quorum
        coordinator.call("ReportRound", extreme_report(peer, 1, [a, b]))
    stored = {r.peer_id: r for r in coordinator.engine._store.reports(1)}
    assert stored[a].inner_steps <= 5 and stored[a].samples <= 5 * coordinator.engine.config.data.batch_size * 64
    assert stored[a].bytes_sent <= BYTES_PER_PARAMETER * coordinator.engine.run.param_count
    assert stored[a].inner_time_s <= 60.0 and math.isnan(stored[a].loss)
    clock.now += 6
    coordinator.beat(a)
    assert coordinator.engine.round_info(a, 1).outcome == pb.ROUND_OUTCOME_COMMITTED
    coordinator.every_rpc(c)

    # a store written before reports were cut: the next round's reports and the run's total at the caps
    store = coordinator.engine._store
    open_round = store.latest_round()
    assert open_round is not None and open_round.outcome == OPEN
    for peer in (a, b):
        store.replace_report(
            ReportRecord(
                round=open_round.round,
                peer_id=peer,
                reported_at=clock.now,
                ok=True,
                state_hash="1" * 64,
                group=(a, b),
                samples=MAX_COUNT,
                inner_steps=MAX_COUNT,
                inner_time_s=MAX_SECONDS,
                exchange_time_s=MAX_SECONDS,
                bytes_sent=MAX_COUNT,
                bytes_received=MAX_COUNT,
                loss=HUGE_LOSS,
                param_count=MAX_COUNT,
            )
        )
    store.put_run(dataclasses.replace(store.get_run(), ddp_equivalent_bytes=2**63 - 1))
    clock.now += 100  # past the round's timeout: the restarted coordinator decides it from those reports
    restarted = Coordinator(path, clock, signers)
    restarted.beat(a)
    restarted.beat(b)
    assert restarted.engine._store.get_round(open_round.round).outcome != OPEN
    restarted.every_rpc(b)
    again = Coordinator(path, clock, signers)  # and once more over what that one stored
    again.every_rpc(a)
