"""How rank 0 of a multi-GPU peer keeps its other ranks in step with it (``swarm.train.multi_gpu.ranks``).

Each ``train`` on rank 0 starts every rank on the same steps (``TrainOrder``), sending θl and the inner AdamW
state along only when they changed since the ranks last trained together: θl after a commit or a load, the
AdamW state after steps the ranks did not take with it (a resume). An FSDP peer's ranks hold shards instead
(``swarm.train.multi_gpu.sharding``), synced and gathered through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from swarm.train.multi_gpu.ranks import GatherOptimizer, Ranks, TrainOrder

if TYPE_CHECKING:
    from swarm.train.multi_gpu.sharding import ShardedModel


class RankLockstep:
    """The ranks' view of one trainer's θl (``params``) and inner optimizer. A one-GPU peer's trainer uses only
    its ``optimizer_state_dict`` and ``load_optimizer_state_dict``, which are then the optimizer's own."""

    def __init__(
        self,
        ranks: Optional[Ranks],
        sharded: Optional[ShardedModel],
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
    ) -> None:
        self.ranks, self.sharded, self.params, self.optimizer = ranks, sharded, params, optimizer
        self.params_changed = False  # rank 0: θl changed outside train(); the other ranks need it
        self.peer_step = 0  # rank 0: the trainer's inner steps when the ranks last trained together

    def lead(self, steps: int, *, peer_step: int, run_step: int, batches_drawn: int) -> None:
        """Rank 0, before training ``steps`` steps from its ``peer_step``-th: start the other ranks on them."""
        order = TrainOrder(
            steps=steps,
            peer_step=peer_step,
            run_step=run_step,
            batches_drawn=batches_drawn,
            params_changed=self.params_changed,
            optimizer_changed=peer_step != self.peer_step,
        )
        self.ranks.send(order)
        self.sync(order)
        self.params_changed = False
        self.peer_step = peer_step + steps

    def sync(self, order: TrainOrder) -> None:
        """Every rank: take part in the broadcasts ``order`` announces."""
        if self.sharded is not None:
            self.sharded.sync(order, self.ranks, self.params, self.optimizer)
            return
        if order.params_changed or order.optimizer_changed:
            self.ranks.broadcast_params(self.params)
        if order.optimizer_changed:
            self.ranks.broadcast_optimizer(self.optimizer)

    def optimizer_state_dict(self) -> dict:
        """The inner AdamW state as ``Optimizer.state_dict()`` has it, whole (on rank 0 of an FSDP peer the
        ranks send their shards: every rank takes part)."""
        if self.sharded is None:
            return self.optimizer.state_dict()
        self.ranks.send(GatherOptimizer())
        return self.sharded.optimizer_state_dict(self.optimizer)

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Install an ``optimizer_state_dict`` (a resume); an FSDP peer's ranks take their shards of it when
        they next train."""
        if self.sharded is None:
            self.optimizer.load_state_dict(state_dict)
        else:
            self.sharded.load_optimizer_state_dict(self.optimizer, state_dict)
