"""What the dashboard shows, as one JSON-ready dict, read from the run's store.

The dashboard reads its own read-only connection to ``coordinator.sqlite3`` (WAL lets it read while the
engine writes, without taking the engine's lock), so the same code serves a live run and a finished one.
A peer's figures are as fresh as the engine's last write of it (every few seconds).
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Optional

from coordinator.api.views import peer_status, totals
from coordinator.store.database import Store
from coordinator.store.history import history_page
from coordinator.store.records import COMMITTED, EVICTED, VOIDED
from swarm.config import RunConfig
from swarm.core.fragments import round_end_step
from swarm.train.schedule import lr_at
from swarm.v1 import coordinator_pb2 as pb

HISTORY_ROUNDS = 5000  # the page plots at most this many latest rounds
PEERS_SHOWN = 500  # the page and /metrics show at most this many peers (the live ones first, by index)


def snapshot(store: Store, *, now: Optional[float] = None) -> dict[str, Any]:
    """The run, its rounds and its peers as the dashboard and /metrics show them."""
    now = time.time() if now is None else now
    run = store.get_run()
    if run is None:
        return {"run": None, "rounds": [], "peers": []}
    peers = store.peers()
    latest, committed = store.latest_round(), store.latest_committed_round()
    committed_hash = committed.committed_hash if committed is not None else run.initial_hash
    summed = totals(peers, ddp_equivalent_bytes=run.ddp_equivalent_bytes)
    history = history_page(store, after_round=_first_shown(latest), max_rounds=HISTORY_ROUNDS)
    rate = _round_lr(run.run_spec_json)
    return {
        "run": {
            "run_id": run.run_id,
            "round": latest.round if latest is not None else 0,
            "state": "finished"
            if run.finished
            else ("open" if latest is not None and latest.outcome not in (COMMITTED, VOIDED) else "waiting for peers"),
            "finished": run.finished,
            "committed_round": committed.round if committed is not None else 0,
            "committed_hash": committed_hash,
            "rounds_committed": store.count_rounds(COMMITTED),
            "rounds_voided": store.count_rounds(VOIDED),
            "peers_alive": sum(p.alive for p in peers),
            "peers_shown": min(len(peers), PEERS_SHOWN),
            "peers_total": len(peers),
            "peers_evicted": sum(p.state == EVICTED for p in peers),
            "tokens": summed.tokens,
            "bytes_sent": summed.bytes_sent,
            "ddp_equivalent_bytes": summed.ddp_equivalent_bytes,
            "utilization": summed.compute_utilization,
            "contributions_rejected": summed.contributions_rejected,
            "eval_loss": _number(run.eval_loss),
            "eval_round": run.eval_round,
            "initial_eval_loss": _number(run.initial_eval_loss),
        },
        "rounds": [dict(_round(r), lr=rate(r.round)) for r in history.rounds],
        "peers": [_peer(peer_status(p, now), p.alive, committed_hash) for p in _shown(peers)],
    }


def _shown(peers: list) -> list:
    """At most PEERS_SHOWN peers, the live ones first, each group by index: a page a browser can render."""
    alive = [p for p in peers if p.alive][:PEERS_SHOWN]
    return alive + [p for p in peers if not p.alive][: PEERS_SHOWN - len(alive)]


def _first_shown(latest) -> int:
    return max(0, (latest.round if latest is not None else 0) - HISTORY_ROUNDS)


def _round(row: pb.RoundHistory) -> dict[str, Any]:
    seconds = row.decided_at - row.opened_at
    return {
        "round": row.round,
        "outcome": pb.RoundOutcome.Name(row.outcome).removeprefix("ROUND_OUTCOME_").lower(),
        "participants": row.participants,
        "holders": row.holders,
        "codec": row.codec,
        "inner_steps": row.inner_steps,
        "fragments": row.fragments,
        "bytes_sent": row.bytes_sent,
        "ddp_equivalent_bytes": row.ddp_equivalent_bytes,
        "exchange_s": row.exchange_s,
        "inner_s": row.inner_s,
        "mean_loss": _number(row.mean_loss),
        "eval_loss": _number(row.eval_loss),
        "tokens": row.tokens,
        "utilization": row.utilization,
        "tokens_per_s": row.tokens / seconds if seconds > 0 else None,
        "reason": row.reason,
    }


@functools.lru_cache(maxsize=4)
def _round_lr(run_spec_json: str):
    """round -> the inner learning rate of its last step, from the run's config by the peers' own schedule
    (``swarm.train.schedule``), for a full-speed peer training since round 1 (a peer that joined later warms
    up again from its own first step). The peers do not report their rate to the coordinator."""
    run = RunConfig.from_json(run_spec_json)
    rc = run.rounds
    run_steps = round_end_step(rc.max_rounds, rc.inner_steps, rc.fragments) if rc.max_rounds else 0

    def rate(round_no: int) -> Optional[float]:
        step = round_end_step(round_no, rc.inner_steps, rc.fragments) - 1
        return None if step < 0 else lr_at(run.inner, peer_step=step, run_step=step, run_steps=run_steps)

    return rate


def _peer(status: pb.PeerStatus, alive: bool, committed_hash: str) -> dict[str, Any]:
    m = status.metrics
    return {
        "id": status.id,
        "name": status.name,
        "site": status.site,
        "state": status.state,
        "alive": alive,
        "tokens_per_s": m.tokens_per_s,
        "step_time_s": m.step_time_s,
        "upload_mbit_s": _number(m.upload_mbit_s),
        "download_mbit_s": _number(m.download_mbit_s),
        "rtt_ms": _number(m.rtt_ms),
        "rounds_joined": status.rounds_joined,
        "rounds_missed": status.rounds_missed,
        "state_hash": m.state_hash,
        "state_round": m.state_round,
        "hash_matches": bool(m.state_hash) and m.state_hash == committed_hash,
        "last_seen_s": status.last_seen_s,
        "utilization": status.compute_utilization,
        "bytes_sent": m.bytes_sent,
        "loss": _number(m.loss),
    }


def _number(value: float) -> Optional[float]:
    return None if value is None or not math.isfinite(value) else value
