"""The exchange's arithmetic where it saves memory: a group of one averages alone, bit for bit as the butterfly and
the all-gather of one member (the simulator's references); a mean may be written over a contribution's memory."""

from __future__ import annotations

import pytest
import torch

from swarm.core.aggregation import Aggregation
from swarm.core.all_gather import gather_reference
from swarm.core.average import butterfly_reference, weighted_average
from swarm.core.codecs.codec import get_codec
from swarm.core.codecs.error_feedback import DroppedInPlace
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.net.exchange.alone import average_alone
from swarm.net.exchange.slices.reduction import ExchangeFailed

pytestmark = [pytest.mark.timeout(60)]

NUMEL = 70_001


def delta(seed: int, numel: int = NUMEL) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("rule", ["mean", "trimmed_mean"])
def test_a_group_of_one_gets_the_butterflys_and_the_all_gathers_average_bit_for_bit(codec: str, rule: str) -> None:
    aggregation = Aggregation(rule=rule)
    reduce = lambda d, w: aggregation.reduce(d, w).average  # noqa: E731
    for gathered, reference in ((False, butterfly_reference), (True, gather_reference)):
        mine = delta(1)
        expected = reference([mine.clone()], [7.0], codec, reduce=reduce)
        average, _ = average_alone(
            aggregation, get_codec(codec), mine, [7.0], "k", gathered=gathered, owner=None, into_delta=False
        )
        assert torch.equal(average, expected)
        assert not torch.equal(average, delta(1)) or codec == "fp32"  # a lossy codec's average is not Δ


def test_fp32_alone_into_delta_takes_deltas_memory_and_leaves_it_alone_otherwise() -> None:
    mine = delta(2)
    expected = butterfly_reference([mine.clone()], [3.0], "fp32")
    average, _ = average_alone(
        Aggregation(), get_codec("fp32"), mine, [3.0], "k", gathered=False, owner=None, into_delta=True
    )
    assert average.data_ptr() == mine.data_ptr() and torch.equal(average, expected)
    kept = delta(2)
    average, _ = average_alone(
        Aggregation(), get_codec("fp32"), kept, [3.0], "k", gathered=False, owner=None, into_delta=False
    )
    assert average.data_ptr() != kept.data_ptr() and torch.equal(kept, delta(2)) and torch.equal(average, expected)


def test_alone_int4_leaves_error_feedbacks_residual_in_delta_as_the_butterfly_does() -> None:
    codec = get_codec("int4")
    mine = delta(3)
    sent = codec.decode(codec.encode(delta(3)), NUMEL)
    expected_residual = delta(3) - sent
    DroppedInPlace.expect(mine)
    average_alone(Aggregation(), codec, mine, [1.0], "k", gathered=False, owner=None, into_delta=True)
    assert torch.equal(mine, expected_residual)


def test_alone_with_owner_feedback_matches_the_butterfly_and_stages_the_same_residual() -> None:
    codec = get_codec("sign")
    if not codec.owner_feedback:
        pytest.skip("no codec asks for owner feedback")
    ours, theirs = OwnerFeedback(), OwnerFeedback()
    expected = butterfly_reference([delta(4)], [2.0], codec, owners=[theirs])
    average, _ = average_alone(Aggregation(), codec, delta(4), [2.0], "k", gathered=False, owner=ours, into_delta=False)
    assert torch.equal(average, expected)


def test_a_vector_with_a_non_finite_value_is_refused_alone_as_in_a_group() -> None:
    bad = delta(5)
    bad[17] = float("nan")
    with pytest.raises(ExchangeFailed, match="cannot encode this slice"):
        average_alone(Aggregation(), get_codec("fp32"), bad, [1.0], "k", gathered=False, owner=None, into_delta=True)


@pytest.mark.parametrize("into", [0, 1, 2])
def test_a_mean_written_over_a_contributions_memory_is_the_same_bits(into: int) -> None:
    numel = 3 * (1 << 16) + 123  # several of the mean's chunks
    parts = [delta(10 + i, numel) for i in range(3)]
    expected = weighted_average(parts, [5.0, 1.0, 3.0])
    assert torch.equal(weighted_average(parts, [5.0, 1.0, 3.0], out=parts[into]), expected)
