"""What the coordinator tells peers and the status CLI: RoundInfo and GetStatusResponse from records.

Pure functions; the engine passes the records in.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from coordinator.api.errors import BadRequest
from coordinator.api.limits import MAX_DHT_MADDRS, MAX_LABEL_BYTES
from coordinator.roster import SUMMED_METRICS
from coordinator.rounds import controller
from coordinator.store.records import COMMITTED, PeerRecord, RoundRecord, RunRecord
from swarm.config import ConfigError, ModelConfig, RunConfig
from swarm.v1 import coordinator_pb2 as pb

GONE_LISTED_S = 600.0  # a peer that left or was evicted longer ago than this is counted, not listed
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 200  # a listed peer is at most ~4 KB (its fields are capped): a page stays well under 4 MB


@dataclass(frozen=True)
class RunPosition:
    """Where the run stands: the facts every RoundInfo repeats."""

    last_committed_round: int
    last_committed_hash: str
    open_round: int  # 0: none open
    finished: bool
    state_holders: tuple[str, ...]  # live peer ids known to hold the last committed state


def round_info(
    number: int,
    round_row: Optional[RoundRecord],
    position: RunPosition,
    peers: Mapping[str, PeerRecord],
    *,
    listed: bool = True,
) -> pb.RoundInfo:
    """Describe round ``number`` (its record may be missing: round 0, or a round not opened yet).

    ``holders`` lists DHT peer ids to download a state from: for a committed round, its live
    holders (for the last committed round, also the live peers that synced or resumed it since);
    for round 0 and for rounds without a committed state of their own (open, voided, not yet
    opened), the live peers that hold the run's last committed state.  ``live_peers`` and
    ``behind_peers`` are left to the caller, which keeps them counted. ``listed=False``: without the
    per-participant lists (participants, their libp2p ids, the plan's peers and left-out ones), which the
    caller adds a requester's own entries of (``coordinator.rounds.info_cache``).
    """
    info = pb.RoundInfo(
        round=number,
        last_committed_round=position.last_committed_round,
        last_committed_hash=position.last_committed_hash,
        finished=position.finished,
        open_round=position.open_round,
    )
    if round_row is not None:
        info.outcome = round_row.outcome
        choice = controller.message(round_row.choice)
        if choice is not None:
            info.choice.CopyFrom(choice)
        if round_row.budgets or round_row.left_out:
            info.plan.CopyFrom(round_plan(round_row, listed=listed))
        decided = round_row.outcome == COMMITTED or round_row.outcome == pb.ROUND_OUTCOME_VOIDED
        if listed and decided:
            info.participants.extend(round_row.participants)
        elif listed:  # an open round: only the live ones, so groupmates stop waiting for a peer that left
            info.participants.extend(p for p in round_row.participants if p in peers and peers[p].alive)
            info.participant_dht_ids.extend(peers[p].dht_peer_id for p in info.participants)
        if round_row.outcome == COMMITTED:
            info.committed_hash = round_row.committed_hash
            holders = list(round_row.holders)
            if number == position.last_committed_round:  # also peers that synced or resumed it since
                holders += position.state_holders
            info.holders.extend(_dht_ids(tuple(dict.fromkeys(holders)), peers))
            return info
    elif number == 0 and position.last_committed_round == 0 and position.last_committed_hash:
        info.outcome = COMMITTED  # round 0 is the initial state
        info.committed_hash = position.last_committed_hash
    info.holders.extend(_dht_ids(position.state_holders, peers))
    return info


HOLDERS_SENT = 16  # holders a RoundInfo names at most: enough to download from, a bounded answer in any swarm


def holder_sample(holders: Sequence[str], requester: str, *, round_no: int, k: int = HOLDERS_SENT) -> list[str]:
    """At most ``k`` of ``holders`` (DHT ids) for ``requester`` (a peer id): consecutive ones from a place the
    requester and the round choose, so a requester gets the same ones each time it asks about a round, and
    different requesters spread their downloads over all holders."""
    if len(holders) <= k:
        return list(holders)
    digest = hashlib.sha256(f"{requester}/{round_no}".encode()).digest()
    start = int.from_bytes(digest[:8], "big") % len(holders)
    return [holders[(start + i) % len(holders)] for i in range(k)]


def round_plan(round_row: RoundRecord, *, listed: bool = True) -> pb.RoundPlan:
    """The round's time budget as peers read it (``coordinator.rounds.budgets``); ``listed=False``: without its
    per-participant lists."""
    plan = pb.RoundPlan(budget_s=round_row.budget_s, deadline_s=round_row.deadline_s)
    if not listed:
        return plan
    plan.left_out.extend(round_row.left_out)
    if len(round_row.budgets) == len(round_row.participants):
        plan.peers.extend(
            pb.PlannedPeer(peer_id=p, inner_steps=steps, step_time_s=t)
            for p, steps, t in zip(round_row.participants, round_row.budgets, round_row.step_times_s)
        )
    return plan


def _dht_ids(peer_ids: Sequence[str], peers: Mapping[str, PeerRecord]) -> list[str]:
    known = [peers[p] for p in peer_ids if p in peers and peers[p].alive]
    return [p.metrics.dht_peer_id for p in known if p.metrics.dht_peer_id]


def state_word(state: int) -> str:
    """PEER_STATE_TRAINING -> "training"."""
    return pb.PeerState.Name(state).removeprefix("PEER_STATE_").lower() if state in pb.PeerState.values() else "unknown"


def status_response(
    *,
    run: RunRecord,
    config: RunConfig,
    peers: Sequence[PeerRecord],
    position: RunPosition,
    last_committed: Optional[RoundRecord],
    rounds_committed: int,
    rounds_voided: int,
    now: float,
    started_at: float,
    latest: Optional[RoundRecord] = None,
    summed: Mapping[str, float],
    peers_omitted: int,
    next_page_token: str = "",
) -> pb.GetStatusResponse:
    """The status with ``peers`` (a page of them, in index order) listed; ``summed``: every peer's metrics added
    up (``Roster.sums``); ``latest``: the newest round, whose controller choice status shows."""
    rounds = config.rounds
    status = pb.RunStatus(
        run_id=run.run_id,
        open_round=position.open_round,
        rounds_committed=rounds_committed,
        rounds_voided=rounds_voided,
        committed_hash=position.last_committed_hash,
        committed_round=position.last_committed_round,
        fragments=rounds.fragments,
        overlap_steps=rounds.overlap_steps,
        outer_optimizer=config.outer.name,
        error_feedback=rounds.error_feedback,
        aggregation=rounds.aggregation_rule(),  # "auto" resolved: the rule the owners apply
        eval_loss=run.eval_loss if run.eval_round >= 0 else math.nan,
        eval_round=max(run.eval_round, 0),
        initial_eval_loss=run.initial_eval_loss,
        finished=position.finished,
        max_rounds=rounds.max_rounds or 0,
        inner_steps=rounds.inner_steps,
        codec=rounds.codec,
        model_preset=config.model.preset if config.model.kind == "preset" else "",
        model=model_name(config.model),
        model_source=MODEL_SOURCES[config.model.kind],
        param_count=run.param_count,
        loss=last_committed.mean_loss if last_committed is not None else math.nan,
        uptime_s=max(0.0, now - started_at),
    )
    choice = controller.message(latest.choice) if latest is not None else None
    if choice is not None:
        status.controller.CopyFrom(choice)
    return pb.GetStatusResponse(
        run=status,
        peers=[peer_status(p, now) for p in peers],
        totals=summed_totals(summed, ddp_equivalent_bytes=run.ddp_equivalent_bytes),
        peers_omitted=peers_omitted,
        next_page_token=next_page_token,
    )


def listed_in_status(peer: PeerRecord, now: float) -> bool:
    """Whether status lists ``peer``: alive, or gone for at most GONE_LISTED_S (older ones are only counted)."""
    return peer.alive or now - peer.last_seen <= GONE_LISTED_S


def page_request(page_size: int, page_token: str) -> tuple[int, int]:
    """(the peer index a status page starts from, its size at most) for a GetStatus request."""
    size = min(page_size, MAX_PAGE_SIZE) if page_size > 0 else DEFAULT_PAGE_SIZE
    if page_token and not page_token.isdigit():
        raise BadRequest("the status page_token is not one this coordinator gave; ask again without it.")
    return (int(page_token) if page_token else 0), size


MODEL_SOURCES = {"preset": "preset", "factory": "factory", "hf": "hf_config"}  # ModelConfig.kind -> status word


def model_name(model: ModelConfig) -> str:
    """What the run trains, as status shows it: the preset's name, the factory spec, or the hf_config's model_type."""
    if model.kind == "factory":
        return model.factory
    if model.kind == "preset":
        return model.preset
    if isinstance(model.hf_config, dict):
        return str(model.hf_config.get("model_type") or "unknown")
    return _hf_model_type(str(model.hf_config))


@functools.lru_cache(maxsize=8)
def _hf_model_type(path: str) -> str:
    """The model_type of the config.json at ``path`` (read once: status is asked often)."""
    from swarm.train.model.hf_model import hf_config_dict

    try:
        return str(hf_config_dict(path)["model_type"])
    except ConfigError:  # the coordinator's copy is gone: the run still trains what its peers built
        return "unknown"


def peer_status(peer: PeerRecord, now: float) -> pb.PeerStatus:
    metrics = pb.PeerMetrics()
    metrics.CopyFrom(peer.metrics)
    del metrics.dht_maddrs[MAX_DHT_MADDRS:]  # a row an older version stored unbounded
    for name in _LINK_METRICS:
        if getattr(metrics, name) == 0:  # never measured: no heartbeat yet, or a peer that predates them
            setattr(metrics, name, math.nan)
    return pb.PeerStatus(
        id=peer.peer_id,
        name=_bounded(peer.name),
        site=_bounded(peer.site),
        state=state_word(peer.state),
        device=_bounded(peer.device),
        rounds_joined=peer.rounds_joined,
        rounds_missed=peer.rounds_missed,
        last_seen_s=max(0.0, now - peer.last_seen),
        compute_utilization=_ratio(peer.metrics.inner_time_s, peer.metrics.wall_time_s),
        metrics=metrics,
        restarts=max(0, peer.session - 1),
    )


_LINK_METRICS = ("upload_mbit_s", "download_mbit_s", "rtt_ms")  # NaN until measured; never 0 once measured


def _bounded(label: str) -> str:
    """At most MAX_LABEL_BYTES of UTF-8, cut on a character boundary (rows older versions stored whole)."""
    return label.encode()[:MAX_LABEL_BYTES].decode(errors="ignore")


def totals(peers: Sequence[PeerRecord], *, ddp_equivalent_bytes: int) -> pb.Totals:
    """The cumulative metrics that add up over peers (every peer that ever joined, gone ones included)."""
    summed = {name: sum(getattr(p.metrics, name) for p in peers) for name in SUMMED_METRICS}
    return summed_totals(summed, ddp_equivalent_bytes=ddp_equivalent_bytes)


def summed_totals(summed: Mapping[str, float], *, ddp_equivalent_bytes: int) -> pb.Totals:
    counts = {
        name: int(value) if name not in ("inner_time_s", "wall_time_s") else value for name, value in summed.items()
    }
    return pb.Totals(
        ddp_equivalent_bytes=ddp_equivalent_bytes,
        compute_utilization=_ratio(summed["inner_time_s"], summed["wall_time_s"]),
        **counts,
    )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0
