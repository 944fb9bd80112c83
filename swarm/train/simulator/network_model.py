"""A model of one round on a network of peers (no traffic, no tensors): per-peer link rates, latency and
compute speed in, predicted exchange and round time, bytes per link and utilization out, for the flat
butterfly all-reduce and for two-level (site) averaging. ``scripts/sim_wan.py`` runs it at scale and
``scripts/bench_wan.py`` calibrates it against the WAN testbed.

The butterfly: each of K members owns 1/K of the vector. Phase 1 sends every slice to its owner, phase 2
sends every owner's averaged slice to everyone, so each member sends and receives 2(K−1)/K of the payload.
Two-level: the sub-groups of ``swarm.core.site_plan.plan_sites`` (a site's members, cut into sub-groups of at
most ``group_size``; a peer on a link of its own is a sub-group of one) do that among themselves first, one
representative per sub-group does it across sub-groups with the sub-group's partial sum, then each representative
sends the result, in fp32, to each other member of its sub-group (``swarm.net.exchange.site_broadcast``). A sub-group whose member fails is left out of level 2, so only the
representatives must all complete the round.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
PAYLOAD_EFFICIENCY = 0.96  # TCP/IP headers on 1500-byte frames: what one flow on a shaped link delivers as payload
LOSSLESS_FIRST = ("fp32", "bf16", "fp16", "int8", "int4")  # least lossy first: the controller's order
BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4 / 64, "int4": 0.5 + 4 / 64}


@dataclass(frozen=True, kw_only=True)
class Peer:
    up_mbit: float
    down_mbit: float
    one_way_ms: float = 0.0  # to any peer outside its site
    step_s: float = 1.0  # seconds per inner step
    site: int = 0  # peers of a site talk over its LAN; make_peers gives each peer a site of its own by default


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What moving a byte costs beside the link: the codec's encode + reduce + decode (CPU seconds per byte
    of encoded payload, serial with the sends as the exchange runs today), and the transport's CPU per byte
    sent or received (it runs while the link is busy, so a phase takes the longer of the two)."""

    codec_s_per_byte: float = 0.0
    transport_s_per_byte: float = 0.0
    per_stream_s: float = 0.0  # opening one stream (one slice to one groupmate): CPU + scheduling
    lan_mbit: float = 1000.0  # links between peers of one site
    site_mbit: float | None = None  # each site's uplink to the others, shared by its peers (None: unlimited)
    lan_one_way_ms: float = 0.5
    # payload share of the link rate; several flows into one shaped link get less than one flow (the WAN
    # testbed's raw TCP butterfly: ~0.7 at 4 peers), so calibration measures it
    link_efficiency: float = PAYLOAD_EFFICIENCY


@dataclass(frozen=True, kw_only=True)
class Exchange:
    seconds: float
    bytes_per_peer: float  # the most any one peer sends (its upload)
    cross_site_bytes: float  # the sum over all peers of what they send to another site
    must_complete: int = 0  # peers one failure of which voids the round: all (flat), the representatives (two-level)
    largest_subgroup: int = 0  # the most contributions one failure leaves out (flat: every one)


@dataclass(frozen=True, kw_only=True)
class Round:
    mode: str  # "flat" or "two_level"
    codec: str
    inner_steps: int
    compute_s: float
    exchange: Exchange
    round_s: float
    utilization: float  # mean over peers of the fraction of the round they spend computing
    reason: str = ""


def ideal_exchange_s(payload_bytes: float, peers: int, mbit: float) -> float:
    """2(K−1)/K × payload / link rate: the butterfly's bytes on a link of ``mbit`` both ways, nothing else."""
    if peers < 2:
        return 0.0
    return 2 * (peers - 1) / peers * payload_bytes / (mbit * MBIT)


def _rate(mbit: float, costs: Costs) -> float:
    return mbit * MBIT * costs.link_efficiency


def _phase_s(slice_bytes: float, peers: list[Peer], costs: Costs) -> float:
    """One butterfly phase: every member sends a slice of ``slice_bytes`` to each other member and receives one
    from each, over the LAN to its own site and over its own link (and its site's shared uplink) to the rest.
    Its time: the slowest member's link (or transport CPU), or the busiest site uplink, plus one round trip."""
    k = len(peers)
    if k < 2:
        return 0.0
    sizes = Counter(p.site for p in peers)
    worst = 0.0
    for p in peers:
        local, remote = (sizes[p.site] - 1) * slice_bytes, (k - sizes[p.site]) * slice_bytes
        link_s = max(local / _rate(costs.lan_mbit, costs), remote / _rate(min(p.up_mbit, p.down_mbit), costs))
        cpu_s = 2 * (local + remote) * costs.transport_s_per_byte + (k - 1) * costs.per_stream_s
        worst = max(worst, link_s, cpu_s)
    if costs.site_mbit is not None and len(sizes) > 1:
        worst = max(worst, max(n * (k - n) for n in sizes.values()) * slice_bytes / _rate(costs.site_mbit, costs))
    one_way_ms = costs.lan_one_way_ms if len(sizes) == 1 else max(p.one_way_ms for p in peers)
    return worst + 2 * one_way_ms / 1000


def butterfly(payload_bytes: float, peers: list[Peer], costs: Costs) -> Exchange:
    """The flat butterfly all-reduce of ``payload_bytes`` (encoded) among ``peers``."""
    k = len(peers)
    if k < 2:
        return Exchange(seconds=0.0, bytes_per_peer=0.0, cross_site_bytes=0.0, must_complete=k, largest_subgroup=k)
    slice_bytes = payload_bytes / k
    seconds = 2 * _phase_s(slice_bytes, peers, costs) + costs.codec_s_per_byte * payload_bytes
    per_site = Counter(p.site for p in peers)
    cross = sum(2 * (k - per_site[p.site]) * slice_bytes for p in peers)
    return Exchange(
        seconds=seconds,
        bytes_per_peer=2 * (k - 1) * slice_bytes,
        cross_site_bytes=cross,
        must_complete=k,
        largest_subgroup=k,
    )


def two_level(
    payload_bytes: float, peers: list[Peer], costs: Costs, group_size: int = 0, result_bytes: float | None = None
) -> Exchange:
    """Butterfly inside each sub-group (a site's LAN), butterfly of one representative per sub-group, then each
    representative sends the result (``result_bytes``: the fp32 vector; default ``payload_bytes``) to each other
    member of its sub-group over the LAN. The sub-groups are the exchange's own plan (``plan_sites``) of
    sub-groups of at most ``group_size``."""
    subgroups = _subgroups(peers, group_size)
    inside = [butterfly(payload_bytes, members, costs) for members in subgroups]
    representatives = [members[0] for members in subgroups]
    across = butterfly(payload_bytes, representatives, costs)
    handed = (payload_bytes if result_bytes is None else result_bytes) * (max(len(m) for m in subgroups) - 1)
    share_s = max(handed / _rate(costs.lan_mbit, costs), handed * costs.transport_s_per_byte) + (
        2 * costs.lan_one_way_ms / 1000 if handed else 0.0
    )
    seconds = max(e.seconds for e in inside) + across.seconds + share_s
    rep_bytes = max(e.bytes_per_peer for e in inside) + across.bytes_per_peer + handed
    return Exchange(
        seconds=seconds,
        bytes_per_peer=rep_bytes,
        cross_site_bytes=across.cross_site_bytes,
        must_complete=len(subgroups),
        largest_subgroup=max(len(m) for m in subgroups),
    )


def _subgroups(peers: list[Peer], group_size: int) -> list[list[Peer]]:
    """One sub-group per site, or the exchange's own cut of each site into sub-groups of at most ``group_size``
    (imported only then: it brings torch, which the model does not otherwise need)."""
    if not group_size:
        sites: dict[int, list[Peer]] = {}
        for p in peers:
            sites.setdefault(p.site, []).append(p)
        return list(sites.values())
    from swarm.core.site_plan import plan_sites

    return [[peers[i] for i in s.positions] for s in plan_sites([str(p.site) for p in peers], group_size).subgroups]


def exchange(
    mode: str,
    payload_bytes: float,
    peers: list[Peer],
    costs: Costs,
    group_size: int = 0,
    result_bytes: float | None = None,
) -> Exchange:
    if mode == "flat":
        return butterfly(payload_bytes, peers, costs)
    if mode == "two_level":
        return two_level(payload_bytes, peers, costs, group_size, result_bytes)
    raise ValueError(f"mode must be 'flat' or 'two_level', got {mode!r}")


def round_time(
    mode: str,
    *,
    params: int,
    codec: str,
    inner_steps: int,
    peers: list[Peer],
    costs: Costs,
    overlap: bool = True,
    budgeted: bool = True,
    reason: str = "",
    group_size: int = 0,
) -> Round:
    """One round: ``inner_steps`` at the slowest peer's pace make the time budget (``budgeted``: every peer
    trains until then, as time-budgeted rounds do; otherwise each does ``inner_steps`` and waits). With
    ``overlap`` the exchange runs behind the next round's compute, so a round takes the longer of the two."""
    if not peers:
        raise ValueError("a round needs at least one peer")
    compute_s = inner_steps * max(p.step_s for p in peers)
    ex = exchange(mode, params * BYTES_PER_PARAM[codec], peers, costs, group_size, params * BYTES_PER_PARAM["fp32"])
    round_s = max(compute_s, ex.seconds) if overlap else compute_s + ex.seconds
    busy = [compute_s if budgeted else inner_steps * p.step_s for p in peers]
    utilization = sum(busy) / (len(peers) * round_s) if round_s > 0 else 1.0
    return Round(
        mode=mode,
        codec=codec,
        inner_steps=inner_steps,
        compute_s=compute_s,
        exchange=ex,
        round_s=round_s,
        utilization=utilization,
        reason=reason,
    )


def controlled_round(
    mode: str,
    *,
    params: int,
    inner_steps: int,
    peers: list[Peer],
    costs: Costs,
    codecs: tuple[str, ...] = ("fp32", "fp16", "int8", "int4"),
    group_size: int = 0,
) -> Round:
    """The controller's rule: the least lossy codec whose exchange hides behind the round's compute; when none
    does, the smallest codec and enough more inner steps that it does."""
    ordered = [c for c in LOSSLESS_FIRST if c in codecs]
    if not ordered:
        raise ValueError(f"codecs must name some of {LOSSLESS_FIRST}, got {codecs}")
    compute_s = inner_steps * max(p.step_s for p in peers)
    for codec in ordered:
        r = round_time(
            mode, params=params, codec=codec, inner_steps=inner_steps, peers=peers, costs=costs, group_size=group_size
        )
        if r.exchange.seconds <= compute_s:
            return replace(
                r, reason=f"{codec}: exchange {r.exchange.seconds:.1f}s hides behind {compute_s:.1f}s of compute"
            )
    smallest = ordered[-1]
    slow = round_time(
        mode, params=params, codec=smallest, inner_steps=inner_steps, peers=peers, costs=costs, group_size=group_size
    )
    steps = math.ceil(slow.exchange.seconds / max(p.step_s for p in peers))
    r = round_time(
        mode, params=params, codec=smallest, inner_steps=steps, peers=peers, costs=costs, group_size=group_size
    )
    return replace(
        r,
        reason=f"{smallest} takes {slow.exchange.seconds:.1f}s > {compute_s:.1f}s of compute: "
        f"H raised from {inner_steps} to {steps}",
    )


def make_peers(
    count: int,
    *,
    sites: int | None = None,
    up_mbit: float,
    down_mbit: float | None = None,
    one_way_ms: float = 0.0,
    step_s: float = 1.0,
    slow_every: int = 0,
    slow_factor: float = 1.0,
) -> list[Peer]:
    """``count`` peers spread evenly (round-robin) over ``sites`` (None: each peer a site of its own); every ``slow_every``-th one
    ``slow_factor`` times slower to compute (0: none)."""
    sites = count if sites is None else sites
    if count < 1 or not 1 <= sites <= count:
        raise ValueError(f"need at least one peer and 1 to {count} sites, got {count} peers in {sites} sites")
    return [
        Peer(
            up_mbit=up_mbit,
            down_mbit=down_mbit if down_mbit is not None else up_mbit,
            one_way_ms=one_way_ms,
            step_s=step_s * (slow_factor if slow_every and i % slow_every == slow_every - 1 else 1.0),
            site=i % sites,
        )
        for i in range(count)
    ]
