"""The "balanced" fragment pattern: near-equal fragments cut across tensors on codec blocks, their outer
steps and merges on parts of tensors, and a streaming simulation that uses them."""

import dataclasses
import functools
import types

import numpy as np
import pytest
import torch

from swarm.config import ModelConfig, OuterOptConfig, RoundConfig
from swarm.core import spans
from swarm.core.average import flatten
from swarm.core.codecs.codec_base import BLOCK
from swarm.core.fragments import fragment_spans, fragments
from swarm.core.outer import OuterOptimizer
from swarm.train.model.model import GPT, gpt_config
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


@functools.cache
def _gpt_params(preset):
    model = GPT(gpt_config(ModelConfig(preset=preset)))  # names and shapes only: skip the portable init
    return tuple((name, p.shape) for name, p in model.named_parameters())


def _covered(groups, params):
    """Per parameter, a count per element of how many fragments hold it."""
    counts = [np.zeros(shape.numel(), dtype=int) for _, shape in params]
    for group in groups:
        for s in group:
            counts[s.param][s.start : s.stop] += 1
    return counts


@pytest.mark.parametrize("preset, num_fragments", [("bench", 4), ("bench", 2), ("small", 3)])
def test_balanced_fragments_hold_every_element_once_in_equal_block_aligned_pieces(preset, num_fragments):
    params = _gpt_params(preset)
    groups = fragment_spans(params, num_fragments, "balanced")
    assert len(groups) == num_fragments and all(count.min() == count.max() == 1 for count in _covered(groups, params))
    sizes = [sum(s.numel for s in group) for group in groups]
    assert max(sizes) - min(sizes) <= BLOCK  # equal to a codec block: the peak sync is 1/F of the model
    total = sum(shape.numel() for _, shape in params)
    starts = np.cumsum([0] + [shape.numel() for _, shape in params])
    cuts = {int(starts[s.param]) + s.start for group in groups for s in group} - set(starts.tolist())
    assert cuts and all(c % BLOCK == 0 for c in cuts)  # every cut inside a tensor is on a codec block
    assert max(sizes) <= total / 3.5 if num_fragments == 4 else True


def test_balanced_splits_the_embeddings_that_whole_blocks_cannot():
    params = _gpt_params("bench")  # 4 blocks: the embeddings make strided fragment 0 a third of the model
    total = sum(shape.numel() for _, shape in params)
    strided = [sum(params[i][1].numel() for i in g) for g in fragments(params, 4, "strided")]
    balanced = fragment_spans(params, 4, "balanced")
    assert total / max(strided) < 3.1 and total / max(sum(s.numel for s in g) for g in balanced) > 3.99
    split = [i for i in range(len(params)) if sum(i in g for g in fragments(params, 4, "balanced")) > 1]
    assert split  # some tensors are shared by two fragments, and listed in both
    assert fragment_spans(params, 1, "balanced") == [spans.whole([s for _, s in params], range(len(params)))]
    whole = fragment_spans(params, 4, "strided")
    assert [[s.param for s in g] for g in whole] == fragments(params, 4, "strided")


def test_balanced_on_a_model_smaller_than_its_pieces_cuts_elements_or_refuses():
    shapes = [torch.Size([50]), torch.Size([30])]  # 80 elements: fewer than 2 x 64, so unaligned cuts
    assert fragment_spans(shapes, 2, "balanced") == [
        [spans.Span(0, 0, 40)],
        [spans.Span(0, 40, 50), spans.Span(1, 0, 30)],
    ]
    with pytest.raises(ValueError, match="lower \\[rounds\\] fragments"):
        fragment_spans([torch.Size([3])], 4, "balanced")
    with pytest.raises(ValueError, match="shapes"):
        fragments(["a.weight", "b.weight"], 2, "balanced")


def test_stepping_the_balanced_fragments_one_by_one_equals_one_step_of_the_whole_model():
    # Nesterov is elementwise: stepping each fragment's spans with its part of a full delta gives the
    # same bits as stepping every tensor at once, split tensors included.
    shapes = [torch.Size([7, 50]), torch.Size([130]), torch.Size([3, 3]), torch.Size([300])]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    momentum = [torch.randn(s, generator=gen) for s in shapes]
    delta = [torch.randn(s, generator=gen) for s in shapes]
    before = flatten(params).clone()
    outer = OuterOptimizer(OuterOptConfig(), shapes)
    outer.load_state_tensors(momentum)
    expected, expected_state = outer.tentative_step(params, delta)
    groups = fragment_spans(shapes, 3, "balanced")
    assert spans.splits_tensors(groups, shapes)
    got, state = list(params), outer.state_tensors()
    for group in groups:
        part = spans.gather(delta, group)
        new, state = spans.tentative_step(outer, got, part, group)
        untouched = set(range(len(shapes))) - {s.param for s in group}
        assert all(new[i] is got[i] for i in untouched)
        got = new
        outer.load_state_tensors(state)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(state, expected_state))
    assert torch.equal(flatten(params), before)  # the inputs were not modified


def test_part_of_a_tensor_needs_an_elementwise_outer_optimizer():
    shapes = [torch.Size([100]), torch.Size([100])]
    adam = types.SimpleNamespace(name="Adam")  # refused before it is used (a real one takes seconds to build)
    with pytest.raises(ValueError, match="nesterov"):
        spans.tentative_step(adam, [torch.zeros(s) for s in shapes], [torch.ones(64)], [spans.Span(0, 0, 64)])
    # valid, not validated here: validating a torch.optim outer optimizer takes seconds
    run = RUN.replace(
        outer=OuterOptConfig(name="Adam", lr=0.01),
        rounds=RoundConfig(inner_steps=4, fragments=2, fragment_pattern="balanced"),
    )
    with pytest.raises(ValueError, match="fragment_pattern = 'balanced' splits tensors"):
        LocalTrainer(run, peer_index=0)


def test_a_balanced_commit_merges_exactly_the_fragments_elements():
    run = RUN.replace(
        rounds=dataclasses.replace(
            RUN.rounds, inner_steps=4, fragments=2, overlap_steps=2, mixing_alpha=0.25, fragment_pattern="balanced"
        )
    ).validate()
    trainer = LocalTrainer(run, peer_index=0)
    group = trainer.fragment_spans[0]
    assert any(not spans.is_whole(s, trainer.global_params[s.param]) for s in group)
    trainer.train(2)
    contribution = trainer.take_contribution(0)
    assert contribution.delta.numel() == trainer.fragment_numel(0)
    assert abs(trainer.fragment_numel(0) - trainer.fragment_numel(1)) <= BLOCK
    trainer.train(2)
    local = [p.detach().clone().reshape(-1) for p in trainer.model.parameters()]
    old_global = [g.clone().reshape(-1) for g in trainer.global_params]
    tentative = trainer.apply(contribution.delta, 0, 1)
    trainer.commit(tentative, fragment=0)
    inside = [torch.zeros(g.numel(), dtype=torch.bool) for g in old_global]
    for s in group:
        inside[s.param][s.start : s.stop] = True
    for p, new_g, l, old, mask in zip(trainer.model.parameters(), trainer.global_params, local, old_global, inside):
        p, new_g = p.detach().reshape(-1), new_g.reshape(-1)
        assert torch.equal(p[~mask], l[~mask]) and torch.equal(new_g[~mask], old[~mask])  # fragment 1: untouched
        ref = l[mask].numpy() * np.float32(0.25) + new_g[mask].numpy() * np.float32(0.75)
        assert torch.equal(p[mask], torch.from_numpy(ref))
    assert all(
        not torch.equal(g.reshape(-1)[m], o[m]) for g, o, m in zip(trainer.global_params, old_global, inside) if m.any()
    )


def test_a_balanced_streaming_simulation_sends_equal_fragments_and_stays_consistent():
    run = RUN.replace(
        rounds=dataclasses.replace(RUN.rounds, inner_steps=4, fragments=2, codec="int4", fragment_pattern="balanced")
    ).validate()
    result = simulate(run, peers=2, rounds=4)
    assert result.consistent and [r.fragment for r in result.rounds] == [0, 1, 0, 1]
    assert result.rounds[-1].eval_loss < result.initial_eval_loss
    sent = [r.bytes_sent[0] for r in result.rounds]
    assert abs(sent[0] - sent[1]) <= 64 and result.peak_bytes_per_sync == max(sent)
