"""FSDP for a multi-GPU peer (``[inner] sharding = "fsdp"``): each of the K ranks holds 1/K of θl, of its
gradients and of the AdamW state, through torch's FSDP2 (``torch.distributed.fsdp.fully_shard``, which runs on
gloo as on nccl).

The trainer keeps the peer's full θl in its own plain module, on the CPU (where θg lives too): the swarm's
side of a round (Δ = θg − θl, the commit's merge, checkpoints, the final model) reads and writes that, on rank 0
alone. The ranks train a sharded copy of it on their devices. Before training, when rank 0's θl changed (a
commit, a sync, a resume), ``scatter`` sends each rank its part of it; after training ``gather`` reassembles
the parts on rank 0. The AdamW state never leaves the shards except for a checkpoint (``gather_optimizer``,
``scatter_optimizer``).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from swarm.train.multi_gpu.ranks import Ranks, TrainOrder

# AdamW state by parameter index, as Optimizer.state_dict() numbers them (through its param groups, in order)
log = logging.getLogger(__name__)

OptimizerState = dict[int, dict[str, torch.Tensor]]


class ShardedModel:
    """Every rank's share of θl: a copy of the peer's model, sharded across its ranks (every rank builds it at
    the same point, as with every method here: they are collectives)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.module = copy.deepcopy(model).to(device)
        # the ranks' own device type: fully_shard's default mesh is CUDA wherever CUDA exists, even for CPU ranks
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        # One unit per block of every ModuleList (a transformer's layers), then the rest: a block's parameters
        # are gathered just before it runs and freed after, so no rank ever holds all of θl on its device.
        for holder in list(self.module.modules()):
            if isinstance(holder, nn.ModuleList):
                for block in holder:
                    fully_shard(block, mesh=mesh)
        fully_shard(self.module, mesh=mesh)
        self.params: list[DTensor] = list(self.module.parameters())  # the plain model's order
        self.pending_optimizer: Optional[OptimizerState] = None  # rank 0: a resumed state, for the next sync
        held = sum(p.to_local().numel() for p in self.params)
        log.info("FSDP: this rank holds %d of θl's %d parameters", held, sum(p.numel() for p in self.params))

    def sync(self, order: TrainOrder, ranks: Ranks, full: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Before ``order``'s steps: rank 0's θl (``full``) and a resumed AdamW state into the shards."""
        if order.params_changed or order.optimizer_changed:
            self.scatter(full)
        if order.optimizer_changed:  # a resume: rank 0 holds the whole state it loaded, if any
            pending = self.pending_optimizer
            layout = ranks.send(state_layout(pending) if pending is not None else None)
            if layout is not None:
                self.scatter_optimizer(optimizer, pending if pending is not None else empty_state(layout))
            self.pending_optimizer = None

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Rank 0: ``optimizer.state_dict()`` with the whole state (the other ranks are in ``gather_optimizer``)."""
        return {"state": self.gather_optimizer(optimizer), "param_groups": optimizer.state_dict()["param_groups"]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        """Rank 0: the hyperparameters now; the state goes to the shards at the next ``sync``."""
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.pending_optimizer = {int(i): dict(s) for i, s in state_dict["state"].items()}

    def scatter(self, full: list[torch.Tensor]) -> None:
        """Rank 0's ``full`` θl into every rank's shards (the other ranks pass same-shaped tensors; their values
        are not read)."""
        with torch.no_grad():
            for p, value in zip(self.params, full):
                p.to_local().copy_(self._part(value, p))

    def gather(self, into: Optional[list[torch.Tensor]]) -> None:
        """The shards reassembled into rank 0's ``into`` (the other ranks pass None)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                value = p.full_tensor()
                if into is not None:
                    into[i].copy_(value)

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's parts of θl (Shard(0): rows of each parameter, in rank order)."""
        return [p.to_local().detach() for p in self.params]

    def gather_optimizer(self, optimizer: torch.optim.Optimizer) -> Optional[OptimizerState]:
        """The AdamW state, whole, on rank 0 (CPU); None on the other ranks."""
        state: OptimizerState = {}
        for i, p in enumerate(_numbered(optimizer)):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    full = value.full_tensor() if isinstance(value, DTensor) else value
                    state.setdefault(i, {})[key] = full.detach().to("cpu")
        return state

    def scatter_optimizer(self, optimizer: torch.optim.Optimizer, state: OptimizerState) -> None:
        """Rank 0's whole AdamW ``state`` into every rank's shards. Only rank 0's ``state`` is read for values;
        the other ranks pass their layout of it (which tensors exist, with which shapes): ``state_layout``."""
        optimizer.state.clear()
        for i, p in enumerate(_numbered(optimizer)):
            for key, value in sorted(state.get(i, {}).items()):
                if value.shape == p.shape and value.dim() > 0:
                    local = self._part(value, p).clone()
                    optimizer.state.setdefault(p, {})[key] = DTensor.from_local(
                        local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                else:  # AdamW's step count: a plain tensor every rank holds whole
                    box = value.to(p.device).clone()
                    dist.broadcast(box, src=0)
                    optimizer.state.setdefault(p, {})[key] = box.to(value.device)

    @staticmethod
    def _part(value: torch.Tensor, like: DTensor) -> torch.Tensor:
        return distribute_tensor(
            value.detach().to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=0
        ).to_local()


def _numbered(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_layout(state: Optional[OptimizerState]) -> dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """What ``scatter_optimizer``'s other ranks need to know of rank 0's state: shapes and dtypes, no values."""
    return {i: {k: (tuple(v.shape), v.dtype) for k, v in keys.items()} for i, keys in (state or {}).items()}


def empty_state(layout: dict[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]) -> OptimizerState:
    """Placeholders of ``layout``'s shapes, for the ranks whose values ``scatter_optimizer`` does not read."""
    return {i: {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in keys.items()} for i, keys in layout.items()}
