"""The exchange's result vectors: memory handed out again only once nothing shares it."""

import pytest
import torch

from swarm.net.exchange.result_vectors import ResultVectors

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("hold", ["tensor", "view", "numpy", "storage", "reshaped"])
def test_a_vector_anything_still_shares_is_never_handed_out_again(hold: str) -> None:
    pool = ResultVectors()
    first = pool.take(1000)
    first.fill_(7.0)
    address = first.data_ptr()
    keep = {
        "tensor": lambda t: t,
        "view": lambda t: t[10:20],
        "numpy": lambda t: t.numpy(),
        "storage": lambda t: t.untyped_storage(),
        "reshaped": lambda t: t.view(10, 100),
    }[hold](first)
    del first
    second = pool.take(1000)
    assert second.data_ptr() != address and pool.reused == 0
    second.fill_(-1.0)  # the caller writes its vector: what is held must not see it
    held = torch.tensor([], dtype=torch.float32).set_(keep) if hold == "storage" else torch.as_tensor(keep)
    assert bool((held == 7.0).all())


def test_a_released_vector_is_handed_out_again_and_the_pool_keeps_at_most_keep() -> None:
    pool = ResultVectors(keep=1)
    first = pool.take(1000)
    address = first.data_ptr()
    del first
    again = pool.take(1000)
    assert again.data_ptr() == address and pool.reused == 1
    other_size = pool.take(500)  # another size, while `again` is held: fresh, and it replaces the kept one
    del again, other_size
    pool.take(1000)
    assert len(pool._arrays) == 1 and pool.reused == 1  # the 1,000-element vector was no longer kept
