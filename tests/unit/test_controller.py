"""The adaptive controller: measurements in, the round's codec, shares and reason out (a pure function,
so the table needs no network); and the engine puts its choice into RoundInfo and status."""

from __future__ import annotations

import math
import random

import pytest

from coordinator.engine import CoordinatorEngine
from coordinator.rounds import controller
from coordinator.rounds.controller import Choice, PeerLink, choose
from coordinator.store.database import Store
from swarm.app.status import status_tables, status_to_dict
from swarm.config import RoundConfig, RunConfig
from swarm.core.average import part_bounds
from swarm.net.exchange.slices.reduction import slice_bounds
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join
from tests.unit.test_membership import ready_beat

pytestmark = pytest.mark.timeout(60)

PARAMS = 1_000_000  # fp32: 4 MB a contribution
# H = 50 steps of 0.1 s: a 5 s round; without overlap an exchange may take 10% of it, 0.5 s
PLAIN = RoundConfig(inner_steps=50, controller="auto")
OVERLAP = RoundConfig(inner_steps=50, overlap_steps=10, controller="auto")  # a 1.0 s overlap window


def links(*uploads: float, download: float | None = None, rtt_ms: float = 1.0, step_s: float = 0.1) -> list[PeerLink]:
    return [
        PeerLink(f"p{i}", up, download if download is not None else up, rtt_ms, step_s) for i, up in enumerate(uploads)
    ]


CASES = [
    # (what, links, rounds, previous codec, expected codec, words the reason must hold)
    (
        "fast links keep fp32",
        links(1000, 1000, 1000, 1000),
        PLAIN,
        None,
        "fp32",
        ["fp32: fp32 takes", "within the 0.5 s 10% of the round"],
    ),
    (
        "80 Mbit/s needs half the bytes",
        links(80, 80, 80, 80),
        PLAIN,
        None,
        "fp16",
        ["fp16: fp32 would take", "80 Mbit/s", "longer than the 0.5 s 10% of the round"],
    ),
    (
        "overlap hides fp32 at 100 Mbit/s",
        links(100, 100, 100, 100),
        OVERLAP,
        None,
        "fp32",
        ["within the 1.0 s overlap window"],
    ),
    (
        "one 8 Mbit/s uplink pushes to int4",
        links(100, 100, 100, 8, download=100),
        OVERLAP,
        None,
        "int4",
        ["int4: int8 would take", "p3's 8.0 Mbit/s uplink", "longer than the 1.0 s overlap window"],
    ),
    (
        "nothing hides behind a 0.4 Mbit/s link: int4 and a longer round",
        links(100, 0.4),
        OVERLAP,
        None,
        "int4",
        [
            "int4: even int4 would take",
            "p1's 0.4 Mbit/s uplink",
            "a round of 200 inner steps (controller_max_inner_steps) comes closest",
        ],
    ),
    (
        "a 4 Mbit/s uplink: int4 and a round long enough to hide it",
        links(100, 4),
        PLAIN,
        None,
        "int4",
        ["int4: even int4 would take 1.1 s", "a round of 113 inner steps would hide it"],
    ),
    (
        "the round is the fastest peer's: a peer 3x slower does not widen the window",
        [PeerLink("p0", 20, 20, 1.0, 0.1), PeerLink("p1", 20, 20, 1.0, 0.3)],
        PLAIN,
        None,
        "int8",
        ["int8: fp16 would take 0.8 s", "longer than the 0.5 s 10% of the round"],
    ),
    (
        "a codec outside the allowed list is never taken",
        links(80, 80, 80, 80),
        RoundConfig(inner_steps=50, controller="auto", controller_codecs=("fp32", "int8")),
        None,
        "int8",
        ["int8: fp32 would take"],
    ),
    (
        "hysteresis: fp32 would fit, not with headroom: fp16 stays",
        links(110, 110, 110, 110),
        PLAIN,
        "fp16",
        "fp16",
        ["fp16, kept: fp32 would take", "not within 0.35 s, the headroom it needs"],
    ),
    ("without hysteresis the same links take fp32", links(110, 110, 110, 110), PLAIN, None, "fp32", []),
    ("no link measured yet: the run's codec", links(math.nan, math.nan), PLAIN, None, "fp32", ["no link measured yet"]),
    (
        "no link measured yet: the previous choice holds",
        links(math.nan, math.nan),
        PLAIN,
        "int8",
        "int8",
        ["no link measured yet"],
    ),
    ("a single peer exchanges nothing", links(1), PLAIN, None, "fp32", ["a group of one peer exchanges nothing"]),
]


@pytest.mark.parametrize("what, peers, rounds, previous, codec, words", CASES, ids=[c[0] for c in CASES])
def test_measurements_give_the_codec_and_a_readable_reason(what, peers, rounds, previous, codec, words) -> None:
    before = Choice(round=1, codec=previous, inner_steps=50, fragments=1, overlap_steps=0) if previous else None
    choice = choose(peers, param_count=PARAMS, rounds=rounds.validate() or rounds, round_no=2, previous=before)
    assert choice.codec == codec, choice.reason
    for word in words:
        assert word in choice.reason, choice.reason
    assert choice.reason.count(".") <= 4 and "\n" not in choice.reason  # one sentence (numbers have dots)


def test_a_slow_uplink_owns_a_smaller_slice() -> None:
    choice = choose(links(100, 100, 10), param_count=PARAMS, rounds=OVERLAP, round_no=1)
    assert choice.shares == {
        "p0": pytest.approx(100 / 210, abs=1e-4),
        "p1": pytest.approx(100 / 210, abs=1e-4),
        "p2": pytest.approx(10 / 210, abs=1e-4),
    }
    equal = {p.peer_id: 1.0 for p in links(100, 100, 10)}
    # with its small slice the slow peer sends less, so the exchange is faster than with equal slices
    balanced = controller.predict(links(100, 100, 10), choice.shares, PARAMS, "fp32").seconds
    assert balanced < 0.8 * controller.predict(links(100, 100, 10), equal, PARAMS, "fp32").seconds


@pytest.mark.parametrize("members", [2, 3, 4, 8])
def test_a_member_claiming_a_huge_uplink_owns_at_most_two_in_k_of_the_vector(members) -> None:
    """A member reporting upload_mbit_s = 1e10 (the cap of a request) against honest 10 Mbit/s uplinks: without
    a cap its share would be ~1.0 and it would average almost every coordinate alone as their owner."""
    claimed = links(1e10, *[10.0] * (members - 1))
    shares = controller.upload_shares(claimed)
    total = sum(shares.values())
    assert shares["p0"] / total <= controller.max_share(members) + 1e-4
    assert shares["p0"] / total <= 2 / members + 1e-4
    honest = [shares[f"p{i}"] / total for i in range(1, members)]
    assert max(honest) - min(honest) < 1e-4 and sum(honest) >= 1 - controller.max_share(members) - 1e-4
    owned = slice_bounds(100_000, members, 64, [shares[f"p{i}"] for i in range(members)])[0]
    assert owned[1] - owned[0] <= 2 / members * 100_000 + 64  # the coordinates it averages as their owner


def test_a_heartbeat_claiming_the_largest_uplink_a_request_may_carry_gets_no_more_than_two_in_k() -> None:
    """The attack end to end through the engine: three honest members measured at 10 Mbit/s and one saying 1e10
    (the cap of a request). The round's choice, which every member cuts its slices by, gives it 2/4."""
    now = [1_000.0]
    config = RunConfig(rounds=RoundConfig(inner_steps=10, min_peers=4, controller="auto"))
    engine = CoordinatorEngine(Store(":memory:"), config=config, clock=lambda: now[0])
    honest = [engine_join(engine)[0].peer_id for _ in range(3)]
    liar = engine_join(engine)[0].peer_id
    for peer in honest:
        engine.heartbeat(ready_beat(peer, engine, upload_mbit_s=10.0, download_mbit_s=10.0, step_time_s=0.1))
    info = engine.heartbeat(ready_beat(liar, engine, upload_mbit_s=1e10, download_mbit_s=1e10, step_time_s=0.1))
    assert info.open_round == 1 and set(info.choice.shares) == {*honest, liar}
    total = sum(info.choice.shares.values())
    assert info.choice.shares[liar] / total == pytest.approx(0.5, abs=1e-3)  # not ~1.0
    assert all(info.choice.shares[p] / total == pytest.approx(1 / 6, abs=1e-3) for p in honest)


def run_rounds(uploads_by_round: list[list[float]], rounds: RoundConfig = OVERLAP) -> list[str]:
    codecs, previous = [], None
    for number, uploads in enumerate(uploads_by_round, start=1):
        previous = choose(links(*uploads), param_count=PARAMS, rounds=rounds, round_no=number, previous=previous)
        codecs.append(previous.codec)
    return codecs


def test_a_link_ten_times_slower_changes_the_codec_within_two_rounds_and_back() -> None:
    normal, cut = [200, 200, 200, 200], [200, 200, 200, 20]
    codecs = run_rounds([normal] * 4 + [cut] * 4 + [normal] * 4)
    assert codecs[:4] == ["fp32"] * 4
    assert "fp32" not in codecs[5:8], codecs  # changed by the second round of the cut at the latest
    assert codecs[9:] == ["fp32"] * 3, codecs  # back by the second round after it is restored


def test_noisy_measurements_do_not_flap_the_codec() -> None:
    """Links whose fp32 exchange sits right at the window, measured with ±20% noise each round."""
    noise = random.Random(7)
    level = 4 * 8 * PARAMS * 1.5 / 1.0 / 1e6  # Mbit/s at which fp32 takes exactly the 1.0 s overlap window
    codecs = run_rounds([[level * noise.uniform(0.8, 1.2) for _ in range(4)] for _ in range(40)])
    changes = sum(a != b for a, b in zip(codecs, codecs[1:]))
    assert changes <= 1, codecs


def test_the_choice_survives_its_json_and_reaches_the_wire() -> None:
    choice = choose(links(100, 10), param_count=PARAMS, rounds=OVERLAP, round_no=3)
    message = controller.message(controller.to_json(choice))
    assert (message.round, message.codec, dict(message.shares), message.reason) == (
        3,
        choice.codec,
        pytest.approx(choice.shares),
        choice.reason,
    )
    assert controller.message("") is None and controller.from_json("not json") is None


def test_the_engine_puts_its_choice_in_round_info_and_status() -> None:
    now = [1_000.0]
    config = RunConfig(rounds=RoundConfig(inner_steps=10, min_peers=2, controller="auto"))
    engine = CoordinatorEngine(Store(":memory:"), config=config, clock=lambda: now[0])
    a, _ = engine_join(engine)
    b, _ = engine_join(engine)
    engine.heartbeat(ready_beat(a.peer_id, engine, upload_mbit_s=100.0, download_mbit_s=100.0, step_time_s=0.1))
    info = engine.heartbeat(ready_beat(b.peer_id, engine, upload_mbit_s=0.1, download_mbit_s=0.1, step_time_s=0.1))
    assert info.open_round == 1 and info.HasField("choice")
    assert info.choice.codec == "int4" and info.choice.round == 1 and "uplink" in info.choice.reason
    # the faster uplink owns more, but in a group of two no more than 3/4 (controller.max_share)
    assert (info.choice.shares[a.peer_id], info.choice.shares[b.peer_id]) == (0.75, 0.25)
    assert engine.round_info(a.peer_id, 1).choice == info.choice  # the same choice for every peer who asks

    status = status_to_dict(engine.status(engine.run.token))
    assert status["run"]["controller"]["codec"] == "int4"
    assert status["run"]["controller"]["shares"][b.peer_id] == pytest.approx(info.choice.shares[b.peer_id])
    shown = " ".join(str(row) for table in status_tables(status) for column in table.columns for row in column._cells)
    assert "round 1: int4" in shown


def test_a_link_cut_reported_with_the_round_decides_the_next_rounds_codec() -> None:
    """The link figures a peer measured in round r's exchange come with its report of round r, before round r
    is decided: round r + 1's choice already sees the cut (a heartbeat after the decision would be a round late)."""
    now = [1_000.0]
    config = RunConfig(rounds=RoundConfig(inner_steps=10, min_peers=2, controller="auto"))
    engine = CoordinatorEngine(Store(":memory:"), config=config, clock=lambda: now[0])
    a, _ = engine_join(engine)
    b, _ = engine_join(engine)
    engine.heartbeat(ready_beat(a.peer_id, engine, upload_mbit_s=1e4, download_mbit_s=1e4, step_time_s=0.1))
    info = engine.heartbeat(ready_beat(b.peer_id, engine, upload_mbit_s=1e4, download_mbit_s=1e4, step_time_s=0.1))
    assert info.open_round == 1 and info.choice.codec == "fp32"
    group = [a.peer_id, b.peer_id]
    engine.report(
        pb.ReportRoundRequest(
            peer_id=a.peer_id,
            round=1,
            ok=True,
            state_hash="h1",
            group=group,
            upload_mbit_s=1e4,
            download_mbit_s=1e4,
            rtt_ms=1.0,
        )
    )
    info = engine.report(
        pb.ReportRoundRequest(
            peer_id=b.peer_id,
            round=1,
            ok=True,
            state_hash="h1",
            group=group,
            upload_mbit_s=0.1,
            download_mbit_s=0.1,
            rtt_ms=float("nan"),
        )
    )
    assert engine.round_info(a.peer_id, 1).outcome == pb.ROUND_OUTCOME_COMMITTED
    assert info.open_round == 2 and info.choice.codec == "int4", "round 2 is planned with round 1's measurement"


def test_with_the_controller_off_rounds_carry_no_choice() -> None:
    engine = CoordinatorEngine(
        Store(":memory:"), config=RunConfig(rounds=RoundConfig(min_peers=1)), clock=lambda: 1_000.0
    )
    a, _ = engine_join(engine)
    info = engine.heartbeat(ready_beat(a.peer_id, engine, upload_mbit_s=0.1, step_time_s=0.1))
    assert info.open_round == 1 and not info.HasField("choice")
    assert status_to_dict(engine.status(engine.run.token))["run"]["controller"] is None


@pytest.mark.parametrize(
    "numel, align, shares",
    [
        (100_003, 1, [0.6, 0.3, 0.1]),
        (100_003, 64, [0.6, 0.3, 0.1]),
        (1000, 64, [0.999, 0.001]),
        (130, 64, [1.0, 1.0, 1.0, 1.0]),
        (0, 64, [0.5, 0.5]),
    ],
)
def test_share_sized_slices_cover_the_vector_block_aligned(numel, align, shares) -> None:
    bounds = slice_bounds(numel, len(shares), align, shares)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert all(start % align == 0 for start, _ in bounds if start < numel)
    for (start, end), share in zip(bounds, shares):
        assert abs((end - start) - numel * share / sum(shares)) <= align
    assert slice_bounds(numel, len(shares), align, None) == part_bounds(numel, len(shares), align)
    with pytest.raises(ValueError, match="positive finite shares"):
        slice_bounds(numel, len(shares), align, [0.0] * len(shares))
