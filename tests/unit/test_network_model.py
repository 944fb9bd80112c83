"""The network model behind scripts/sim_wan.py: the butterfly's ideal time, what two-level averaging saves
across sites, and the controller's codec rule."""

from __future__ import annotations

import pytest

from swarm.train.simulator.network_model import (
    Costs,
    butterfly,
    controlled_round,
    ideal_exchange_s,
    make_peers,
    round_time,
    two_level,
)

pytestmark = pytest.mark.timeout(10)
NO_OVERHEAD = Costs()


def test_ideal_time_is_the_butterflys_bytes_over_the_link():
    # 4 peers, 25 MB at 100 Mbit/s: 1.5 × 25e6 B / 12.5e6 B/s = 3 s
    assert ideal_exchange_s(25e6, 4, 100) == pytest.approx(3.0)
    assert ideal_exchange_s(25e6, 2, 100) == pytest.approx(2.0)
    assert ideal_exchange_s(25e6, 1, 100) == 0.0


def test_a_bare_butterfly_takes_its_ideal_time_over_the_payload_rate():
    peers = make_peers(4, up_mbit=100)
    ex = butterfly(25e6, peers, NO_OVERHEAD)
    assert ex.seconds == pytest.approx(3.0 / 0.96)
    assert ex.bytes_per_peer == pytest.approx(1.5 * 25e6)


def test_exchange_time_falls_as_bandwidth_rises_and_grows_with_latency():
    times = [butterfly(1e8, make_peers(8, up_mbit=m, one_way_ms=20), NO_OVERHEAD).seconds for m in (10, 100, 1000)]
    assert times[0] > times[1] > times[2]
    near = butterfly(1e8, make_peers(8, up_mbit=100, one_way_ms=1), NO_OVERHEAD).seconds
    far = butterfly(1e8, make_peers(8, up_mbit=100, one_way_ms=100), NO_OVERHEAD).seconds
    assert far > near


def test_one_slow_uplink_sets_the_flat_exchanges_pace():
    peers = make_peers(4, up_mbit=100)
    slow = [peers[0].__class__(up_mbit=10, down_mbit=100)] + peers[1:]
    assert butterfly(1e7, slow, NO_OVERHEAD).seconds == pytest.approx(10 * butterfly(1e7, peers, NO_OVERHEAD).seconds)


@pytest.mark.parametrize("count,sites", [(16, 2), (64, 4), (256, 16), (1024, 16)])
def test_two_level_sends_less_across_sites_than_flat(count, sites):
    peers = make_peers(count, sites=sites, up_mbit=100)
    flat, tiered = butterfly(1e8, peers, NO_OVERHEAD), two_level(1e8, peers, NO_OVERHEAD)
    assert tiered.cross_site_bytes <= flat.cross_site_bytes
    # with equal sites of s peers the saving is exactly s-fold
    assert tiered.cross_site_bytes == pytest.approx(flat.cross_site_bytes * sites / count)


def test_sub_groups_of_a_site_fate_share_through_their_representatives_only():
    peers = make_peers(1000, sites=4, up_mbit=100)
    by_site, capped = two_level(1e8, peers, NO_OVERHEAD), two_level(1e8, peers, NO_OVERHEAD, group_size=64)
    assert (by_site.must_complete, by_site.largest_subgroup) == (4, 250)
    assert (capped.must_complete, capped.largest_subgroup) == (16, 63)  # each site of 250 in 4 sub-groups of 62-63
    assert capped.cross_site_bytes > by_site.cross_site_bytes  # a site's sub-groups average across its uplink too
    flat = butterfly(1e8, peers, NO_OVERHEAD)
    assert (flat.must_complete, flat.largest_subgroup) == (1000, 1000)


def test_one_site_sends_nothing_across_sites():
    peers = make_peers(8, sites=1, up_mbit=100)
    assert butterfly(1e8, peers, NO_OVERHEAD).cross_site_bytes == 0
    assert two_level(1e8, peers, NO_OVERHEAD).cross_site_bytes == 0


def test_per_stream_cost_makes_a_large_flat_group_slower_than_two_level_in_small_sub_groups():
    costs = Costs(per_stream_s=0.005)
    peers = make_peers(1024, sites=16, up_mbit=1000, one_way_ms=30)
    assert two_level(1e8, peers, costs, group_size=8).seconds < butterfly(1e8, peers, costs).seconds


def test_a_representative_hands_the_fp32_result_to_each_member_of_its_sub_group():
    peers = make_peers(64, sites=4, up_mbit=100)
    small, whole = two_level(1e8, peers, NO_OVERHEAD, group_size=4), two_level(1e8, peers, NO_OVERHEAD)
    assert whole.bytes_per_peer - small.bytes_per_peer > 11 * 1e8  # 15 hand-offs against 3
    int4 = two_level(1e8 / 8, peers, NO_OVERHEAD, result_bytes=1e8)  # an int4 payload, the fp32 result
    assert int4.bytes_per_peer > 15 * 1e8


def test_a_shared_site_uplink_makes_flat_slower_than_two_level():
    costs = Costs(site_mbit=1000, lan_mbit=10_000)
    peers = make_peers(64, sites=4, up_mbit=1000, one_way_ms=50)
    flat, tiered = butterfly(1e9, peers, costs), two_level(1e9, peers, costs)
    # flat: per phase each site's 16 peers send 48 slices of 1/64 GB each through its 1 Gbit/s uplink;
    # two-level: one representative sends 3/4 GB per phase
    assert flat.seconds == pytest.approx(2 * (16 * 48 / 64 * 1e9 / (1000 * 1e6 / 8 * 0.96) + 0.1))
    assert flat.seconds > 4 * tiered.seconds


def test_overlap_hides_an_exchange_shorter_than_compute():
    peers = make_peers(4, up_mbit=100, step_s=1.0)
    hidden = round_time("flat", params=1_000_000, codec="fp32", inner_steps=10, peers=peers, costs=NO_OVERHEAD)
    assert hidden.utilization == pytest.approx(1.0)
    serial = round_time(
        "flat", params=1_000_000, codec="fp32", inner_steps=10, peers=peers, costs=NO_OVERHEAD, overlap=False
    )
    assert serial.utilization < 1.0


def test_without_time_budgets_a_slow_peer_idles_the_others():
    peers = make_peers(4, up_mbit=1000, slow_every=4, slow_factor=3.0)
    fixed = round_time(
        "flat", params=1000, codec="fp32", inner_steps=10, peers=peers, costs=NO_OVERHEAD, budgeted=False
    )
    budgeted = round_time("flat", params=1000, codec="fp32", inner_steps=10, peers=peers, costs=NO_OVERHEAD)
    assert fixed.utilization == pytest.approx((3 * 10 + 30) / (4 * 30))
    assert budgeted.utilization == pytest.approx(1.0)


def test_controller_keeps_fp32_when_it_hides_and_compresses_when_it_does_not():
    peers = make_peers(4, up_mbit=100, step_s=1.0)
    # 10M params fp32 = 40 MB: 1.5 × 40e6 / 12e6 ≈ 5 s
    assert controlled_round("flat", params=10_000_000, inner_steps=10, peers=peers, costs=NO_OVERHEAD).codec == "fp32"
    chosen = controlled_round("flat", params=10_000_000, inner_steps=3, peers=peers, costs=NO_OVERHEAD)
    assert chosen.codec in {"fp16", "int8"} and chosen.exchange.seconds <= 3.0
    # nothing hides behind one step: int4, and H raised until it does
    slowest = controlled_round("flat", params=100_000_000, inner_steps=1, peers=peers, costs=NO_OVERHEAD)
    assert slowest.codec == "int4" and slowest.inner_steps > 1 and slowest.utilization == pytest.approx(1.0)
    assert "H raised" in slowest.reason


def test_bad_input_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="sites"):
        make_peers(4, sites=8, up_mbit=100)
    with pytest.raises(ValueError, match="mode"):
        round_time("ring", params=1, codec="fp32", inner_steps=1, peers=make_peers(2, up_mbit=1), costs=NO_OVERHEAD)


def test_sim_wan_prints_flat_and_two_level_rows_as_json():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "sim_wan.py"
    out = subprocess.run(
        [sys.executable, str(script), "--json", "--peers", "16", "1024", "--sites", "0", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = {(r["peers"], r["sites"], r["mode"]): r for r in json.loads(out.strip().splitlines()[-1])}
    assert set(rows) == {
        (16, "own", "flat"),
        (16, 4, "flat"),
        (16, 4, "two_level"),
        (1024, "own", "flat"),
        (1024, 4, "flat"),
        (1024, 4, "two_level"),
    }
    assert rows[(1024, 4, "two_level")]["cross_site_gb"] < rows[(1024, 4, "flat")]["cross_site_gb"]
    assert rows[(1024, 4, "two_level")]["p_commit"] > rows[(1024, 4, "flat")]["p_commit"]
    bad = subprocess.run([sys.executable, str(script), "--sites", "20"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--sites must be between 0 and 16" in bad.stderr
