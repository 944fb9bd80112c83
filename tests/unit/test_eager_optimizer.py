"""The inner optimizer's step without torch._dynamo (swarm.train.eager_optimizer): the same arithmetic as
``optimizer.step``, and every step hook runs, also one registered after the step function was made (torchft's
DiLoCo registers its sync that way around an existing trainer)."""

from __future__ import annotations

import pytest
import torch

from swarm.train.eager_optimizer import eager_step

pytestmark = pytest.mark.timeout(30)


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _grads(model: torch.nn.Linear, step: int) -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
    model.zero_grad()
    model(x).pow(2).mean().backward()


def test_the_eager_step_does_what_step_does_bit_for_bit() -> None:
    (plain, plain_opt), (eager, eager_opt) = _model_and_optimizer(0), _model_and_optimizer(0)
    step = eager_step(eager_opt)
    assert step != eager_opt.step  # the eager body itself, not the wrapper it falls back to
    for i in range(3):
        _grads(plain, i)
        plain_opt.step()
        _grads(eager, i)
        step()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), eager.parameters()))


def test_a_hook_registered_after_the_step_was_made_runs_at_every_step() -> None:
    model, optimizer = _model_and_optimizer(1)
    step = eager_step(optimizer)  # as a LocalTrainer makes it, before anyone wraps the optimizer
    calls: list[str] = []
    pre = optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    post = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model, 0)
    step()
    assert calls == ["pre", "post"]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # and the step was taken
    pre.remove()
    post.remove()
    _grads(model, 1)
    step()
    assert calls == ["pre", "post"]  # removed: no longer called
