"""Link estimates from an exchange's timings: throughput over the seconds transfers took, per groupmate and
overall, smoothed over exchanges; transfers too small or too short to time are left out."""

from __future__ import annotations

import math

import pytest

from swarm.net.link.link_stats import (
    EWMA_ALPHA,
    MIN_TRANSFER_BYTES,
    LinkEstimates,
    LinkTimings,
    Transfer,
    throughput_mbit_s,
)

pytestmark = pytest.mark.timeout(10)

MB = 1_000_000


def test_throughput_is_bytes_over_the_seconds_the_transfer_took() -> None:
    assert throughput_mbit_s([Transfer("a", 10 * MB, 5.0, 9.0)]) == pytest.approx(20.0)  # 80 Mbit in 4 s


def test_concurrent_transfers_count_their_shared_seconds_once() -> None:
    # two 1 s sends at once over a 16 Mbit/s link: the link moved 16 Mbit in 1 s, not 8 Mbit/s per send
    both = [Transfer("a", MB, 0.0, 1.0), Transfer("b", MB, 0.0, 1.0)]
    assert throughput_mbit_s(both) == pytest.approx(16.0)
    apart = [Transfer("a", MB, 0.0, 1.0), Transfer("b", MB, 3.0, 4.0)]  # the idle gap is not counted
    assert throughput_mbit_s(apart) == pytest.approx(8.0)


def test_zero_small_and_instant_transfers_are_not_timed() -> None:
    assert throughput_mbit_s([]) is None
    assert throughput_mbit_s([Transfer("a", 0, 0.0, 1.0)]) is None
    assert throughput_mbit_s([Transfer("a", MIN_TRANSFER_BYTES - 1, 0.0, 0.001)]) is None  # a ping, not a rate
    assert throughput_mbit_s([Transfer("a", 10 * MB, 1.0, 1.0)]) is None  # no time: no absurd rate
    estimates = LinkEstimates()
    estimates.observe(LinkTimings(uploads=[Transfer("a", 100, 0.0, 0.5)], downloads=[Transfer("a", 0, 1.0, 1.0)]))
    assert math.isnan(estimates.upload_mbit_s) and math.isnan(estimates.download_mbit_s)
    assert math.isnan(estimates.rtt_ms)


def test_estimates_are_an_ewma_over_exchanges_per_groupmate() -> None:
    estimates = LinkEstimates()
    estimates.observe(
        LinkTimings(
            uploads=[Transfer("a", 10 * MB, 0.0, 4.0)],  # 20 Mbit/s
            downloads=[Transfer("b", 10 * MB, 0.0, 8.0)],  # 10 Mbit/s
            rtt_s={"a": 0.040, "b": 0.100},
        )
    )
    assert estimates.upload_mbit_s == pytest.approx(20.0)
    assert estimates.download_mbit_s == pytest.approx(10.0)
    estimates.observe(
        LinkTimings(
            uploads=[Transfer("a", 10 * MB, 0.0, 2.0)],  # 40 Mbit/s
            rtt_s={"a": 0.060, "c": 0.500},
        )
    )
    assert estimates.upload_mbit_s == pytest.approx(EWMA_ALPHA * 40 + (1 - EWMA_ALPHA) * 20)
    assert estimates.download_mbit_s == pytest.approx(10.0)  # nothing timed this exchange: unchanged
    a, b = estimates.groupmate("a"), estimates.groupmate("b")
    assert a.upload_mbit_s.value == pytest.approx(EWMA_ALPHA * 40 + (1 - EWMA_ALPHA) * 20)
    assert math.isnan(a.download_mbit_s.value) and b.download_mbit_s.value == pytest.approx(10.0)
    assert a.rtt_s.value == pytest.approx(EWMA_ALPHA * 0.060 + (1 - EWMA_ALPHA) * 0.040)
    # median over groupmates a (46 ms), b (100 ms), c (500 ms)
    assert estimates.rtt_ms == pytest.approx(100.0)
    assert estimates.groupmate("nobody") is None


def test_non_finite_or_negative_samples_are_ignored() -> None:
    estimates = LinkEstimates()
    estimates.observe(LinkTimings(rtt_s={"a": math.inf, "b": -1.0, "c": math.nan}))
    assert math.isnan(estimates.rtt_ms)


def test_a_link_ten_times_slower_is_taken_at_once_while_noise_is_smoothed():
    from swarm.net.link.link_stats import Ewma

    estimate = Ewma()
    for sample in (100.0, 120.0, 85.0, 110.0):
        estimate.add(sample)
    assert 90 < estimate.value < 115, "noise of ±20% moves the estimate only part of the way"
    estimate.add(10.0)
    assert estimate.value == 10.0, "a 10× slower link is believed after one exchange"
    estimate.add(100.0)
    assert estimate.value == 100.0, "and so is its recovery"
