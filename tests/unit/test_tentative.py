"""The tentative state stepped a tensor at a time: the same hash and the same committed bits as the outer
step of the whole state, for whole tensors and for parts of them (the balanced fragment pattern)."""

import dataclasses

import pytest
import torch

from swarm.config import RunConfig
from swarm.core import spans
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState, state_hash, state_tensors
from swarm.core.tentative import TentativeState

pytestmark = pytest.mark.timeout(60)

SHAPES = [(6, 5), (7,), (3, 4, 2), (11,)]


def _state(seed: int) -> tuple[GlobalState, OuterOptimizer]:
    g = torch.Generator().manual_seed(seed)
    outer = OuterOptimizer(RunConfig().outer, [torch.Size(s) for s in SHAPES])
    params = [torch.randn(s, generator=g) for s in SHAPES]
    momentum = [torch.randn(s, generator=g) for s in SHAPES]
    outer.load_state_tensors(momentum)
    return GlobalState(3, params, outer.state_tensors()), outer


SPAN_SETS = {
    "every tensor whole": lambda: spans.whole([torch.Size(s) for s in SHAPES], range(len(SHAPES))),
    "some tensors whole": lambda: spans.whole([torch.Size(s) for s in SHAPES], [0, 2]),
    "parts of tensors": lambda: [
        spans.Span(0, 3, 17),
        spans.Span(1, 0, 7),
        spans.Span(2, 0, 5),
        spans.Span(2, 20, 24),
        spans.Span(3, 4, 11),
    ],
}


@pytest.mark.parametrize("which", sorted(SPAN_SETS))
def test_hash_and_commit_equal_the_materialised_step(which):
    base, outer = _state(0)
    chosen = SPAN_SETS[which]()
    g = torch.Generator().manual_seed(1)
    deltas = [torch.randn(spans.gather(base.params, [s])[0].shape, generator=g) for s in chosen]
    expected_params, expected_outer = spans.tentative_step(outer, base.params, deltas, chosen)
    expected = GlobalState(4, expected_params, expected_outer)

    lazy = TentativeState(4, base, outer, deltas, chosen)
    assert lazy.state_hash == expected.state_hash
    written = dict(lazy.tensors())
    assert written.keys() == state_tensors(expected).keys()
    assert all(torch.equal(written[k], v) for k, v in state_tensors(expected).items())

    before = [p.clone() for p in base.params]
    committed = lazy.commit_in_place()
    assert committed.params[0] is base.params[0]  # stepped in place: no second θg
    assert all(torch.equal(a, b) for a, b in zip(committed.params, expected.params))
    assert all(torch.equal(a, b) for a, b in zip(committed.outer_state, expected.outer_state))
    assert committed.state_hash == state_hash(committed.params, committed.outer_state)
    untouched = {s.param for s in chosen}
    for i, (p, b) in enumerate(zip(committed.params, before)):
        if i not in untouched:
            assert torch.equal(p, b)


def test_a_torch_optimizer_is_refused():
    base, _ = _state(0)
    adam = OuterOptimizer(dataclasses.replace(RunConfig().outer, name="Adam"), [torch.Size(s) for s in SHAPES])
    with pytest.raises(ValueError, match="nesterov"):
        TentativeState(1, base, adam, [], [])


def test_pieces_smaller_than_a_tensor_step_the_same_bits(monkeypatch):
    """A tensor larger than the chunk is stepped in pieces: each element's step reads only itself."""
    monkeypatch.setattr(TentativeState, "CHUNK", 7)
    test_hash_and_commit_equal_the_materialised_step("parts of tensors")
    test_hash_and_commit_equal_the_materialised_step("every tensor whole")


def test_plain_momentum_steps_the_same_bits():
    base, _ = _state(0)
    outer = OuterOptimizer(dataclasses.replace(RunConfig().outer, nesterov=False), [torch.Size(s) for s in SHAPES])
    outer.load_state_tensors(base.outer_state)
    chosen = SPAN_SETS["every tensor whole"]()
    deltas = [torch.randn(torch.Size(s), generator=torch.Generator().manual_seed(2)) for s in SHAPES]
    expected = GlobalState(4, *spans.tentative_step(outer, base.params, deltas, chosen))
    lazy = TentativeState(4, base, outer, deltas, chosen)
    assert lazy.state_hash == expected.state_hash
    committed = lazy.commit_in_place()
    assert all(torch.equal(a, b) for a, b in zip(committed.params, expected.params))


@pytest.mark.parametrize("fragments", [1, 2])
def test_a_plain_commit_copies_each_stepped_piece_into_the_local_model_with_no_pass_of_its_own(fragments, monkeypatch):
    from swarm.config import DataConfig
    from swarm.train import outer_sync
    from swarm.train.trainer import LocalTrainer

    base = RunConfig(data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16))
    run = base.replace(
        rounds=dataclasses.replace(
            base.rounds, inner_steps=2, fragments=fragments, fragment_pattern="balanced" if fragments > 1 else "strided"
        )
    )
    trainer = LocalTrainer(run, peer_index=0)
    trainer.train(2)
    fragment = fragments - 1
    local_before = [p.detach().clone() for p in trainer.model.parameters()]
    tentative = trainer.apply(trainer.take_contribution(fragment).delta * 0.5, fragment, 1)
    stepped = GlobalState(1, tentative.params, tentative.outer_state)
    with monkeypatch.context() as m:
        m.setattr(outer_sync.spans, "write", lambda *a: pytest.fail("θl was written in a pass of its own"))
        trainer.commit(tentative, fragment=fragment)
    assert trainer.state.state_hash == stepped.state_hash
    mask = [torch.zeros(p.numel(), dtype=torch.bool) for p in local_before]
    for s in trainer.fragment_spans[fragment]:
        mask[s.param][s.start : s.stop] = True
    for p, g, before, inside in zip(trainer.model.parameters(), stepped.params, local_before, mask):
        flat, g_flat, before_flat = p.detach().reshape(-1), g.reshape(-1), before.reshape(-1)
        assert torch.equal(flat[inside], g_flat[inside])  # the round's spans: θg's bits
        assert torch.equal(flat[~inside], before_flat[~inside])  # the rest of θl keeps training
