"""The adaptive controller ([rounds] controller = "auto"): as a round opens, the codec every member sends
with and each member's share of the reduction, chosen from the peers' measured links and step times.

``choose`` is a pure function of the measurements and the previous choice. It predicts each codec's
exchange time on the slowest link of a butterfly all-reduce and takes the least lossy codec whose
exchange stays hidden behind computation: within the overlap window (τ inner steps) when the run
overlaps, else within ``controller_exchange_fraction`` of the round. When none does, it takes the most
compact codec and a longer round: the H whose round keeps what the overlap does not hide within that
fraction of the round, capped at ``controller_max_inner_steps``; ``coordinator.rounds.budgets`` turns that H into
the round's time budget (H × the fastest believable step time) and each participant's steps. Fragments and
overlap stay the run's; with the controller on, a peer whose exchange outlasts the overlap window keeps
training and merges when it ends (``RoundRunner.merge_when_ready``), so a short prediction costs staleness,
not idle time. Shares follow each member's uplink, so a slow uplink owns a smaller slice; a round planned with
more than ``LISTED_PARTICIPANTS`` participants gets equal slices (its RoundInfo names only the requester's own
entries, and the shares would be as large as the round).
``for_round`` is the engine's one call; ``message`` puts a choice into RoundInfo.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from coordinator.api.limits import LISTED_PARTICIPANTS
from coordinator.rounds.step_times import reference_step_s
from coordinator.store.records import PeerRecord, RoundRecord
from swarm.config import RunConfig
from swarm.config.run import RoundConfig
from swarm.core.codecs.codec import get_codec
from swarm.core.round_length import longest_inner_steps
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

# How much each codec loses, least first; a codec is taken only when every less lossy one does not fit.
LOSSINESS = {"fp32": 0, "fp16": 1, "bf16": 1, "int8": 2, "int4": 3}
# Hysteresis: a less lossy codec than the previous round's comes back only once its predicted exchange
# fits in this share of the window; a lossier one is taken as soon as the current one no longer fits.
# A codec step changes the bytes about 2x, so noise must swing the estimate ~40% to flap.
UPGRADE_HEADROOM = 0.7
SHARE_DIGITS = 4  # shares travel rounded: every member computes its slice bounds from the same numbers


@dataclass(frozen=True)
class PeerLink:
    """One participant's latest measurements (NaN: not measured yet)."""

    peer_id: str
    upload_mbit_s: float = math.nan
    download_mbit_s: float = math.nan
    rtt_ms: float = math.nan
    step_time_s: float = math.nan

    @classmethod
    def of(cls, peer: PeerRecord) -> "PeerLink":
        m = peer.metrics
        return cls(
            peer.peer_id, _known(m.upload_mbit_s), _known(m.download_mbit_s), _known(m.rtt_ms), _known(m.step_time_s)
        )


@dataclass(frozen=True)
class Choice:
    round: int
    codec: str
    inner_steps: int  # the round's H: its time budget is H x the fastest believable step time
    fragments: int  # the run's (not changed mid-run)
    overlap_steps: int  # the run's (not changed mid-run)
    shares: dict[str, float] = field(default_factory=dict)  # peer id -> weight of its slice ({}: equal)
    reason: str = ""
    predicted_exchange_s: float = math.nan
    window_s: float = math.nan


@dataclass(frozen=True)
class Prediction:
    seconds: float
    peer_id: str  # the member whose link takes longest
    direction: str  # "uplink" or "downlink"
    mbit_s: float


def choose(
    links: Sequence[PeerLink],
    *,
    param_count: int,
    rounds: RoundConfig,
    round_no: int,
    previous: Optional[Choice] = None,
) -> Choice:
    """The codec, shares and H for round ``round_no`` of the participants ``links``."""
    allowed = sorted(dict.fromkeys(rounds.controller_codecs), key=lambda c: LOSSINESS[c])
    base = dict(
        round=round_no, inner_steps=rounds.inner_steps, fragments=rounds.fragments, overlap_steps=rounds.overlap_steps
    )
    kept = (
        previous.codec
        if previous is not None and previous.codec in allowed
        else (rounds.codec if rounds.codec in allowed else allowed[0])
    )
    measured = [link for link in links if _positive(link.upload_mbit_s) or _positive(link.download_mbit_s)]
    # the round lasts H steps of its fastest believable participant (the slower ones get fewer steps)
    step_s = reference_step_s([link.step_time_s for link in links]) or math.nan
    if not measured or not _positive(step_s) or param_count <= 0:
        missing = "no link measured yet" if not measured else "no inner step timed yet"
        return Choice(codec=kept, reason=f"{kept}: {missing}; it decides once the first exchange is timed", **base)
    links = _filled(links)
    shares = upload_shares(links) if len(links) <= LISTED_PARTICIPANTS else {}
    sized = shares or {link.peer_id: 1.0 for link in links}  # {}: equal slices
    numel = -(-param_count // max(1, rounds.fragments))  # one fragment syncs per round
    window_s, window = _window(rounds, step_s)
    predicted = {c: predict(links, sized, numel, c, gathered=rounds.all_gathered()) for c in allowed}
    limit = {c: window_s * (UPGRADE_HEADROOM if LOSSINESS[c] < LOSSINESS[kept] else 1.0) for c in allowed}
    fitting = [c for c in allowed if predicted[c].seconds <= limit[c]]
    if fitting:
        codec = fitting[0]
        reason = _fit_reason(codec, allowed, predicted, window_s, window, limit)
        return Choice(
            codec=codec,
            shares=shares,
            reason=reason,
            predicted_exchange_s=predicted[codec].seconds,
            window_s=window_s,
            **base,
        )
    compact = min(allowed, key=lambda c: (get_codec(c).encoded_size(numel), -LOSSINESS[c]))
    p = predicted[compact]
    base["inner_steps"], advice = _longer_round(rounds, p.seconds, step_s)
    reason = (
        f"{compact}: even {compact} would take {_s(p.seconds)} s on {_where(p)}, longer than the "
        f"{_s(window_s)} s {window}; {advice}"
    )
    return Choice(
        codec=compact, shares=shares, reason=reason, predicted_exchange_s=p.seconds, window_s=window_s, **base
    )


def predict(
    links: Sequence[PeerLink], shares: Mapping[str, float], numel: int, codec: str, *, gathered: bool = False
) -> Prediction:
    """Seconds the butterfly all-reduce of ``numel`` elements takes in ``codec``, on its slowest link: the
    member owning share s of a group of K sends (1 − s) of its payload to the other owners and s × payload to
    each of the K − 1 others, and receives the same amounts; each of the two phases costs an RTT more.
    ``gathered`` (a run whose exchange is the all-gather): each member sends and receives K − 1 payloads."""
    k = len(links)
    if k < 2:
        return Prediction(0.0, links[0].peer_id if links else "", "uplink", math.nan)
    payload_bits = 8 * get_codec(codec).encoded_size(numel)
    total = sum(shares.values())
    worst = Prediction(-1.0, "", "uplink", math.nan)
    for link in links:
        s = shares[link.peer_id] / total
        bits = payload_bits * ((k - 1) if gathered else (1 - s) + (k - 1) * s)
        latency_s = 2 * link.rtt_ms / 1000 if math.isfinite(link.rtt_ms) else 0.0
        for direction, rate in (("uplink", link.upload_mbit_s), ("downlink", link.download_mbit_s)):
            seconds = bits / (rate * 1e6) + latency_s
            if seconds > worst.seconds:
                worst = Prediction(seconds, link.peer_id, direction, rate)
    return worst


def max_share(members: int) -> float:
    """The largest share of the vector one member may own in a group of ``members``: 2/K, and 3/4 in a group of
    two. The uplinks that size the shares are what the members say; the cap keeps one that says it is very fast
    from owning (and so averaging alone) almost every coordinate."""
    return min(2.0 / members, 0.75) if members > 1 else 1.0


def upload_shares(links: Sequence[PeerLink]) -> dict[str, float]:
    """Each member's share of the reduction in proportion to its uplink (as hivemind balances load by
    bandwidth), none above ``max_share`` (what a capped member would own beyond it goes to the others in
    proportion to theirs), rounded to SHARE_DIGITS decimals and never 0."""
    cap = max_share(len(links))
    capped: set[str] = set()
    while True:
        free = math.fsum(link.upload_mbit_s for link in links if link.peer_id not in capped)
        room = 1.0 - cap * len(capped)
        fractions = {
            link.peer_id: cap if link.peer_id in capped else room * link.upload_mbit_s / free for link in links
        }
        over = {p for p, f in fractions.items() if f > cap and p not in capped}
        if not over:
            break
        capped |= over
    floor = 10**-SHARE_DIGITS
    return {p: max(floor, round(f, SHARE_DIGITS)) for p, f in fractions.items()}


def _filled(links: Sequence[PeerLink]) -> list[PeerLink]:
    """Missing rates replaced by the median of the measured ones (a newcomer is assumed typical)."""

    def median(name: str) -> float:
        known = [getattr(link, name) for link in links if _positive(getattr(link, name))]
        return statistics.median(known) if known else math.nan

    up, down = median("upload_mbit_s"), median("download_mbit_s")
    up, down = (up if _positive(up) else down), (down if _positive(down) else up)
    return [
        dataclasses.replace(
            link,
            upload_mbit_s=link.upload_mbit_s if _positive(link.upload_mbit_s) else up,
            download_mbit_s=link.download_mbit_s if _positive(link.download_mbit_s) else down,
        )
        for link in links
    ]


def _window(rounds: RoundConfig, step_s: float) -> tuple[float, str]:
    """The computation an exchange should hide behind, in seconds and in words."""
    if rounds.overlap_steps > 0:
        return rounds.overlap_steps * step_s, "overlap window"
    return (
        rounds.controller_exchange_fraction * rounds.inner_steps * step_s,
        f"{rounds.controller_exchange_fraction:.0%} of the round",
    )


def _longer_round(rounds: RoundConfig, exchange_s: float, step_s: float) -> tuple[int, str]:
    """The H whose round keeps what the overlap window does not hide of ``exchange_s`` within
    ``controller_exchange_fraction`` of the round (all of it without overlap), capped, and that in words."""
    exposed_s = max(0.0, exchange_s - rounds.overlap_steps * step_s)
    needed = math.ceil(exposed_s / (rounds.controller_exchange_fraction * step_s))
    cap = longest_inner_steps(rounds)
    steps = max(rounds.inner_steps, min(cap, needed))
    hides = (
        f"would keep what the {rounds.overlap_steps}-step overlap does not hide within "
        f"{rounds.controller_exchange_fraction:.0%} of it"
        if rounds.overlap_steps
        else "would hide it"
    )
    if needed <= cap:
        return steps, f"a round of {steps} inner steps {hides}"
    return steps, f"a round of {steps} inner steps (controller_max_inner_steps) comes closest"


def _fit_reason(
    codec: str,
    allowed: list[str],
    predicted: Mapping[str, Prediction],
    window_s: float,
    window: str,
    limit: Mapping[str, float],
) -> str:
    p = predicted[codec]
    if not math.isfinite(p.mbit_s):
        return f"{codec}: a group of one peer exchanges nothing"
    fits = f"{codec} takes {_s(p.seconds)} s on {_where(p)}, within the {_s(window_s)} s {window}"
    better = [c for c in allowed if LOSSINESS[c] < LOSSINESS[codec]]
    if not better:
        return f"{codec}: {fits}"
    b = better[-1]
    q = predicted[b]
    if q.seconds <= window_s:  # held back by hysteresis
        return (
            f"{codec}, kept: {b} would take {_s(q.seconds)} s on {_where(q)}, within the {_s(window_s)} s "
            f"{window} but not within {_s(limit[b])} s, the headroom it needs to come back"
        )
    return f"{codec}: {b} would take {_s(q.seconds)} s on {_where(q)}, longer than the {_s(window_s)} s {window}"


def _where(p: Prediction) -> str:
    return f"{p.peer_id}'s {_s(p.mbit_s)} Mbit/s {p.direction}"


def _s(x: float) -> str:
    """A number for a sentence: 120, 3.2, 0.04."""
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _known(x: float) -> float:
    """A heartbeat's metric; 0 in a field is a peer that never measured it."""
    return x if math.isfinite(x) and x > 0 else math.nan


# --- the engine's call, and the wire ----------------------------------------------------------------


def for_round(
    config: RunConfig,
    planned: RoundRecord,
    peers: Mapping[str, PeerRecord],
    param_count: int,
    previous: Optional[RoundRecord],
) -> RoundRecord:
    """``planned`` with the controller's choice for it (unchanged when the controller is off), logged;
    ``previous``: the round before it, whose choice the hysteresis starts from."""
    if config.rounds.controller != "auto":
        return planned
    links = [PeerLink.of(peers[p]) if p in peers else PeerLink(p) for p in planned.participants]
    choice = choose(
        links,
        param_count=param_count,
        rounds=config.rounds,
        round_no=planned.round,
        previous=from_json(previous.choice) if previous is not None else None,
    )
    shares = ", ".join(f"{p} {s:.2f}" for p, s in choice.shares.items()) or "equal"
    logger.info("round %d: %s (shares %s)", planned.round, choice.reason, shares)
    return dataclasses.replace(planned, choice=to_json(choice))


def to_json(choice: Choice) -> str:
    return json.dumps(dataclasses.asdict(choice), sort_keys=True)


def from_json(text: str) -> Optional[Choice]:
    """The stored choice ("" or a row an older version wrote: None)."""
    if not text:
        return None
    try:
        data = json.loads(text)
        return Choice(**{f.name: data[f.name] for f in dataclasses.fields(Choice) if f.name in data})
    except (ValueError, TypeError):
        return None


def message(text: str) -> Optional[pb.RoundChoice]:
    """The stored choice as it travels in RoundInfo and status (None: none stored)."""
    choice = from_json(text)
    if choice is None:
        return None
    return pb.RoundChoice(
        round=choice.round,
        codec=choice.codec,
        shares=choice.shares,
        inner_steps=choice.inner_steps,
        fragments=choice.fragments,
        overlap_steps=choice.overlap_steps,
        reason=choice.reason,
        predicted_exchange_s=choice.predicted_exchange_s,
        window_s=choice.window_s,
    )
