"""The DiLoCo math: bit-exact averaging on any slice, the outer step against torch's SGD, hashes."""

import math

import numpy as np
import pytest
import torch

from swarm.algorithm import (
    OuterState,
    flatten,
    outer_step,
    pseudo_gradient,
    state_hash,
    unflatten,
    weighted_average,
)

pytestmark = pytest.mark.timeout(60)


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# Awkward weights: their fp32 roundings are inexact and their sum is not a power of two.
WEIGHTS = [3.0, 1.0 / 3.0, 1000.7]


def _contributions(n=10_007):
    return [_randn(n, seed=i, scale=10.0 ** (i - 1)) for i in range(len(WEIGHTS))]


def test_weighted_average_on_any_slice_is_bit_identical_to_the_slice_of_the_whole():
    cs = _contributions()
    full = weighted_average(cs, WEIGHTS)
    rng = np.random.default_rng(0)
    bounds = [(0, 1), (3, 10), (5, 37), (9_999, 10_007), (1, 10_006)]
    bounds += [tuple(sorted(rng.integers(0, 10_008, size=2))) for _ in range(30)]
    for a, b in bounds:
        part = weighted_average([c[a:b].clone() for c in cs], WEIGHTS)
        assert torch.equal(part, full[a:b]), (a, b)


def test_weighted_average_matches_a_plain_float32_reference_bit_for_bit():
    cs = _contributions()
    arrays = [c.numpy() for c in cs]
    acc = arrays[0] * np.float32(WEIGHTS[0])
    for arr, w in zip(arrays[1:], WEIGHTS[1:]):
        acc = acc + arr * np.float32(w)
    ref = acc / np.float32(sum(WEIGHTS))
    assert torch.equal(weighted_average(cs, WEIGHTS), torch.from_numpy(ref))
    exact = sum(c.double() * w for c, w in zip(cs, WEIGHTS)) / sum(WEIGHTS)
    assert torch.allclose(weighted_average(cs, WEIGHTS).double(), exact, rtol=1e-5, atol=1e-6)


def test_weighted_average_of_equal_weights_is_the_mean_and_one_contribution_is_itself():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    assert torch.equal(weighted_average([a, b], [5, 5]), torch.tensor([2.0, 4.0]))
    assert torch.equal(weighted_average([a], [7.0]), a)


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.0], [1.0, -1.0], [1.0, math.inf], [1.0, math.nan]])
def test_weighted_average_refuses_bad_weights(weights):
    cs = [torch.ones(3), torch.ones(3)]
    with pytest.raises(ValueError):
        weighted_average(cs, weights)


def test_pseudo_gradient_is_global_minus_local_in_new_tensors():
    g, l = [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, 3.0])]
    delta = pseudo_gradient(g, l)
    assert torch.equal(delta[0], torch.tensor([0.5, -1.0]))
    delta[0].zero_()
    assert torch.equal(g[0], torch.tensor([1.0, 2.0])) and torch.equal(l[0], torch.tensor([0.5, 3.0]))


def test_flatten_and_unflatten_round_trip():
    like = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(())]
    parts = [_randn(*t.shape, seed=i) for i, t in enumerate(like)]
    vec = flatten(parts)
    assert vec.shape == (11,) and vec.dtype == torch.float32
    back = unflatten(vec, like)
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
    with pytest.raises(ValueError):
        unflatten(vec[:-1], like)


def _sgd_reference(params, grads_per_step, *, lr, momentum, nesterov):
    ps = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=nesterov, foreach=False)
    for grads in grads_per_step:
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps], [opt.state[p]["momentum_buffer"] for p in ps]


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    params = [_randn(5, 7, seed=1), _randn(13, seed=2)]
    steps = [[_randn(5, 7, seed=10 + s, scale=0.01), _randn(13, seed=20 + s, scale=0.01)] for s in range(4)]
    momentum = OuterState.zeros_like(params).momentum
    ours = params
    for k, grads in enumerate(steps):
        ours, momentum = outer_step(ours, grads, momentum, lr=0.7, momentum_coef=0.9, nesterov=nesterov)
        ref_p, ref_m = _sgd_reference(params, steps[: k + 1], lr=0.7, momentum=0.9, nesterov=nesterov)
        # torch's SGD uses add_(alpha=...), which may be fused: equal up to rounding, not bit for bit.
        for a, b in zip(ours + momentum, ref_p + ref_m):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_first_outer_step_from_zero_momentum_uses_the_gradient_as_the_buffer():
    p, g = [torch.tensor([1.0, -2.0])], [torch.tensor([0.5, 0.25])]
    new_p, new_m = outer_step(p, g, [torch.zeros(2)], lr=1.0, momentum_coef=0.5, nesterov=True)
    assert torch.equal(new_m[0], g[0])
    assert torch.equal(new_p[0], torch.tensor([1.0 - 0.75, -2.0 - 0.375]))  # g + 0.5 g, exact here


def test_outer_step_is_pure_and_elementwise():
    params = [_randn(64, 3, seed=1), _randn(9, seed=2)]
    grads = [_randn(64, 3, seed=3), _randn(9, seed=4)]
    momentum = [_randn(64, 3, seed=5), _randn(9, seed=6)]
    copies = [t.clone() for t in params + grads + momentum]
    new_p, new_m = outer_step(params, grads, momentum, lr=0.7, momentum_coef=0.9, nesterov=True)
    assert all(torch.equal(a, b) for a, b in zip(params + grads + momentum, copies))
    # One flat vector gives the same bits as per-tensor steps (so fragments may be stepped apart).
    flat_p, flat_m = outer_step([flatten(params)], [flatten(grads)], [flatten(momentum)],
                                lr=0.7, momentum_coef=0.9, nesterov=True)
    assert torch.equal(flat_p[0], flatten(new_p)) and torch.equal(flat_m[0], flatten(new_m))


def test_outer_step_matches_a_plain_float32_reference_bit_for_bit():
    p, g, m = (_randn(1001, seed=s).numpy() for s in (1, 2, 3))
    mu, lr = np.float32(0.9), np.float32(0.7)
    m_ref = m * mu + g
    p_ref = p - (g + m_ref * mu) * lr
    new_p, new_m = outer_step([torch.from_numpy(p)], [torch.from_numpy(g)], [torch.from_numpy(m)],
                              lr=0.7, momentum_coef=0.9, nesterov=True)
    assert torch.equal(new_p[0], torch.from_numpy(p_ref)) and torch.equal(new_m[0], torch.from_numpy(m_ref))


def test_state_hash_is_short_stable_and_sees_every_bit_and_shape():
    params, momentum = [_randn(4, 5, seed=1), _randn(3, seed=2)], [torch.zeros(4, 5), torch.zeros(3)]
    h = state_hash(params, momentum)
    assert len(h) == 16 and int(h, 16) >= 0
    assert state_hash([t.clone() for t in params], [t.clone() for t in momentum]) == h
    nudged = params[1].clone()
    nudged[2] = torch.nextafter(nudged[2], torch.tensor(math.inf))  # one ulp
    assert state_hash([params[0], nudged], momentum) != h
    m2 = [momentum[0], torch.tensor([0.0, 0.0, 1e-30])]
    assert state_hash(params, m2) != h
    assert state_hash([params[0].reshape(5, 4), params[1]], momentum) != h
    assert state_hash(params + momentum, []) != h  # where params end and momentum begins matters
