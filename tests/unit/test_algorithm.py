"""The DiLoCo math: bit-exact averaging on any slice, the outer step against torch's SGD, hashes, the
butterfly reference the simulator shares with the network, and outer optimizers by name."""

import math

import numpy as np
import pytest
import torch

from swarm.config import ConfigError, OuterOptConfig, RunConfig, outer_optimizer_names
from swarm.core.average import (
    butterfly_bytes_sent,
    butterfly_reference,
    flat_pseudo_gradient,
    flatten,
    part_bounds,
    pseudo_gradient,
    unflatten,
    weighted_average,
)
from swarm.core.codecs.codec import CODECS
from swarm.core.outer import OuterOptimizer, outer_step
from swarm.core.state import state_hash

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


def test_the_flat_pseudo_gradient_is_the_flattened_one_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    g = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    l = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    assert torch.equal(flat_pseudo_gradient(g, l), flatten(pseudo_gradient(g, l)))


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
    momentum = [torch.zeros_like(p) for p in params]
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
    flat_p, flat_m = outer_step(
        [flatten(params)], [flatten(grads)], [flatten(momentum)], lr=0.7, momentum_coef=0.9, nesterov=True
    )
    assert torch.equal(flat_p[0], flatten(new_p)) and torch.equal(flat_m[0], flatten(new_m))


def test_outer_step_matches_a_plain_float32_reference_bit_for_bit():
    p, g, m = (_randn(1001, seed=s).numpy() for s in (1, 2, 3))
    mu, lr = np.float32(0.9), np.float32(0.7)
    m_ref = m * mu + g
    p_ref = p - (g + m_ref * mu) * lr
    new_p, new_m = outer_step(
        [torch.from_numpy(p)], [torch.from_numpy(g)], [torch.from_numpy(m)], lr=0.7, momentum_coef=0.9, nesterov=True
    )
    assert torch.equal(new_p[0], torch.from_numpy(p_ref)) and torch.equal(new_m[0], torch.from_numpy(m_ref))


def test_state_hash_is_short_stable_and_sees_every_bit_and_shape():
    params, outer_state = [_randn(4, 5, seed=1), _randn(3, seed=2)], [torch.zeros(4, 5), torch.zeros(3)]
    h = state_hash(params, outer_state)
    assert len(h) == 16 and int(h, 16) >= 0
    assert state_hash([t.clone() for t in params], [t.clone() for t in outer_state]) == h
    nudged = params[1].clone()
    nudged[2] = torch.nextafter(nudged[2], torch.tensor(math.inf))  # one ulp
    assert state_hash([params[0], nudged], outer_state) != h
    nudged_state = [outer_state[0], torch.tensor([0.0, 0.0, 1e-30])]
    assert state_hash(params, nudged_state) != h
    assert state_hash([params[0].reshape(5, 4), params[1]], outer_state) != h
    assert state_hash(params + outer_state, []) != h  # where params end and the outer state begins matters


# ---- slicing and the butterfly reference ---------------------------------------------------------


def _unaligned_part_bounds(numel, parts):
    """Nearly equal, unaligned slices, written out independently: part_bounds with align=1 (the float
    codecs) must give exactly these."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@pytest.mark.parametrize("numel", [0, 1, 5, 63, 64, 65, 1000, 100_003])
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_part_bounds_cover_the_vector_in_aligned_nearly_equal_slices(numel, parts):
    assert part_bounds(numel, parts) == _unaligned_part_bounds(numel, parts)
    for align in (1, 64):
        bounds = part_bounds(numel, parts, align)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert all(start % align == 0 or start == numel for start, _ in bounds)
        sizes = [math.ceil((e - s) / align) for s, e in bounds]  # in blocks
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError):
        part_bounds(10, 0)


def _butterfly_by_hand(contributions, weights, codec, parts):
    """What swarm.net.exchange.allreduce does, written out: slice, encode/decode each slice, reduce, encode/decode once more."""
    n = contributions[0].numel()
    blocks = -(-n // codec.block)
    base, extra = divmod(blocks, parts)
    out, start = [], 0
    for i in range(parts):
        end = min(n, start + (base + (i < extra)) * codec.block)
        decoded = [codec.decode(codec.encode(c[start:end].clone()), end - start) for c in contributions]
        acc = decoded[0] * torch.tensor(weights[0], dtype=torch.float32)
        for d, w in zip(decoded[1:], weights[1:]):
            acc = acc + d * torch.tensor(w, dtype=torch.float32)
        mean = acc / torch.tensor(sum(weights), dtype=torch.float32)
        out.append(codec.decode(codec.encode(mean), end - start))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_butterfly_reference_is_the_sliced_encode_reduce_encode_of_the_network(codec):
    cs = _contributions(64 * 9 + 7)
    got = butterfly_reference(cs, WEIGHTS, codec)
    assert got.shape == cs[0].shape and got.dtype == torch.float32
    assert torch.equal(got, _butterfly_by_hand(cs, WEIGHTS, CODECS[codec], len(cs)))
    # With slices aligned to the codec's blocks, the group size does not change a single bit.
    for parts in (1, 2, 5):
        assert torch.equal(butterfly_reference(cs, WEIGHTS, codec, parts=parts), got)


def test_butterfly_reference_with_fp32_is_the_weighted_average():
    cs = _contributions()
    assert torch.equal(butterfly_reference(cs, WEIGHTS, "fp32"), weighted_average(cs, WEIGHTS))


def test_unaligned_slices_would_change_the_bits_of_a_block_codec():
    # Why part_bounds aligns: int8 slices cut mid-block get different scales, so a swarm whose slices
    # are not aligned would not match the simulator (nor a swarm of another size).
    cs = _contributions(64 * 9 + 7)
    codec = CODECS["int8"]
    unaligned = torch.cat(
        [
            codec.decode(codec.encode(c[s:e].clone()), e - s)
            for c in cs[:1]
            for s, e in _unaligned_part_bounds(c.numel(), 3)
        ]
    )
    aligned = codec.decode(codec.encode(cs[0]), cs[0].numel())
    assert not torch.equal(unaligned, aligned)


def test_butterfly_bytes_count_every_encoded_slice_a_member_sends():
    # 1000 elements in 3 fp16 slices of 334, 333, 333: member 0 sends 333+333 contributions and its
    # 334-element average twice.
    assert butterfly_bytes_sent(1000, 3, "fp16") == [2 * (666 + 2 * 334), 2 * (667 + 2 * 333), 2 * (667 + 2 * 333)]
    # int8: 130 elements in 2 aligned slices of 128 (2 blocks) and 2 (1 block); scales included.
    big, small = 2 * 4 + 128, 1 * 4 + 2
    assert butterfly_bytes_sent(130, 2, "int8") == [small + big, big + small]
    assert butterfly_bytes_sent(1000, 1, "int4") == [0]


# ---- outer optimizers ------------------------------------------------------------------------------


def _shapes_params_grads(steps=3):
    shapes = [torch.Size([5, 7]), torch.Size([13]), torch.Size([])]
    params = [_randn(*s, seed=1 + i) for i, s in enumerate(shapes)]
    grads = [[_randn(*s, seed=10 * k + i, scale=0.01) for i, s in enumerate(shapes)] for k in range(steps)]
    return shapes, params, grads


def test_nesterov_outer_optimizer_is_outer_step_and_its_state_is_the_momentum():
    shapes, params, grads = _shapes_params_grads()
    opt = OuterOptimizer(OuterOptConfig(), shapes)
    assert all(torch.equal(m, torch.zeros(s)) for m, s in zip(opt.state_tensors(), shapes))
    ours, momentum = params, [torch.zeros_like(p) for p in params]
    p = params
    for g in grads:
        p = opt.step(p, g)
        ours, momentum = outer_step(ours, g, momentum, lr=0.7, momentum_coef=0.9, nesterov=True)
    assert all(torch.equal(a, b) for a, b in zip(p + opt.state_tensors(), ours + momentum))


def test_a_step_of_some_parameters_leaves_the_others_and_their_state_alone():
    shapes, params, grads = _shapes_params_grads()
    for config in (OuterOptConfig(), OuterOptConfig(name="Adam", lr=0.01)):
        opt = OuterOptimizer(config, shapes)
        before = opt.state_tensors()
        new_params, new_state = opt.tentative_step(params, [grads[0][1]], indices=[1])
        assert new_params[0] is params[0] and new_params[2] is params[2]
        assert not torch.equal(new_params[1], params[1])
        assert opt.state_tensors() == before  # tentative: the held state is not changed
        changed = [i for i, (a, b) in enumerate(zip(new_state, before)) if not torch.equal(a, b)]
        assert changed and all(opt._layout[i][0] == 1 for i in changed), config.name


@pytest.mark.parametrize(
    "name, options",
    [
        ("SGD", {"momentum": 0.9, "nesterov": True}),
        ("Adam", {"betas": [0.9, 0.95]}),
        ("AdamW", {"weight_decay": 0.1}),
    ],
)
def test_torch_optimizer_by_name_steps_exactly_like_torch(name, options):
    shapes, params, grads = _shapes_params_grads()
    opt = OuterOptimizer(OuterOptConfig(name=name, lr=0.05, options=options), shapes)
    ref_params = [torch.nn.Parameter(p.clone()) for p in params]
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    ref = getattr(torch.optim, name)(ref_params, lr=0.05, foreach=False, **kwargs)
    p = params
    for g in grads:
        p = opt.step(p, g)
        for rp, rg in zip(ref_params, g):
            rp.grad = rg.clone()
        ref.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(p, ref_params))
    # The held state is torch's state, behind one "initialized" flag per parameter.
    flat_ref = []
    for rp in ref_params:
        flat_ref.append(torch.tensor(1.0))
        flat_ref.extend(v for _, v in sorted(ref.state[rp].items()))
    assert len(opt.state_tensors()) == len(flat_ref)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(opt.state_tensors(), flat_ref))


def test_torch_sgd_by_name_matches_the_explicit_nesterov_step_up_to_rounding():
    shapes, params, grads = _shapes_params_grads()
    explicit = OuterOptimizer(OuterOptConfig(), shapes)
    torch_sgd = OuterOptimizer(OuterOptConfig(name="SGD", lr=0.7, options={"momentum": 0.9, "nesterov": True}), shapes)
    a = b = params
    for g in grads:
        a, b = explicit.step(a, g), torch_sgd.step(b, g)
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))


def test_per_fragment_steps_of_one_adam_equal_separate_optimizers_per_fragment():
    # Fragment {0} steps twice while fragment {1, 2} steps once: Adam's step counts are per parameter.
    shapes, params, grads = _shapes_params_grads()
    opt = OuterOptimizer(OuterOptConfig(name="Adam", lr=0.01), shapes)
    p = opt.step(params, [grads[0][0]], indices=[0])
    p = opt.step(p, [grads[1][1], grads[1][2]], indices=[1, 2])
    p = opt.step(p, [grads[2][0]], indices=[0])
    first = [torch.nn.Parameter(params[0].clone())]
    rest = [torch.nn.Parameter(params[i].clone()) for i in (1, 2)]
    opt_a, opt_b = torch.optim.Adam(first, lr=0.01, foreach=False), torch.optim.Adam(rest, lr=0.01, foreach=False)
    for k in (0, 2):
        first[0].grad = grads[k][0].clone()
        opt_a.step()
    rest[0].grad, rest[1].grad = grads[1][1].clone(), grads[1][2].clone()
    opt_b.step()
    assert all(torch.equal(x, y.detach()) for x, y in zip(p, first + rest))


def test_the_outer_state_is_in_the_hash_and_loads_back():
    shapes, params, grads = _shapes_params_grads()
    opt = OuterOptimizer(OuterOptConfig(name="Adam", lr=0.01), shapes)
    start = state_hash(params, opt.state_tensors())
    new_params, new_state = opt.tentative_step(params, grads[0])
    other = OuterOptimizer(OuterOptConfig(name="Adam", lr=0.01), shapes)
    other.load_state_tensors(new_state)
    assert state_hash(new_params, other.state_tensors()) == state_hash(new_params, new_state) != start
    nudged = list(new_state)
    nudged[2] = nudged[2].clone()
    nudged[2].view(-1)[0] += 1e-3  # an optimizer moment, not a parameter
    assert state_hash(new_params, nudged) != state_hash(new_params, new_state)
    with pytest.raises(ValueError, match="state tensors"):
        other.load_state_tensors(new_state[:-1])
    with pytest.raises(ValueError, match="shape"):
        other.load_state_tensors([t.reshape(-1, 1) if t.dim() == 1 else t for t in new_state])


def test_outer_optimizer_names_and_config_errors():
    assert outer_optimizer_names()[0] == "nesterov" and {"SGD", "Adam", "AdamW"} <= set(outer_optimizer_names())
    with pytest.raises(ConfigError, match="nesterov.*Adam"):
        RunConfig.from_dict({"outer": {"name": "Adamm"}})
    with pytest.raises(ConfigError, match="options"):
        RunConfig.from_dict({"outer": {"name": "nesterov", "options": {"eps": 1e-8}}})
    with pytest.raises(ConfigError, match="torch.optim.Adam"):
        RunConfig.from_dict({"outer": {"name": "Adam", "options": {"momentum": 0.9}}})
    with pytest.raises(ConfigError, match="number, a boolean or a list"):
        RunConfig.from_dict({"outer": {"name": "Adam", "options": {"betas": "0.9"}}})
    run = RunConfig.from_dict(
        {"outer": {"name": "Adam", "lr": 0.001, "options": {"betas": [0.9, 0.95], "amsgrad": True}}}
    )
    assert run.outer.options == {"betas": [0.9, 0.95], "amsgrad": True}
    assert RunConfig.from_json(run.to_json()) == run
    assert RunConfig().outer.name == "nesterov" and RunConfig().outer.options == {}
