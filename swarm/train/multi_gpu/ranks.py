"""The ranks of a multi-GPU peer: ``torch.distributed`` processes that train one peer's θl data-parallel.

Rank 0 is the peer (it alone talks to the coordinator and the other peers); the other ranks only run the
inner loop, in lockstep with it. Before each ``LocalTrainer.train`` rank 0 tells them how many steps to run
and from which step counts, and when its θl or AdamW state changed outside training (a commit, a sync, a
resume) it broadcasts them first, so every rank starts each step from the same parameters. The ranks split
the peer's stream of batches between them (``RankSampler``), so the peer's data position does not depend on
how many ranks it has. The launcher that starts the ranks is ``peer.ranks``. With ``[inner] sharding = "fsdp"``
the ranks hold shards of θl instead of copies (``swarm.train.multi_gpu.sharding``).
"""

from __future__ import annotations

import datetime
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from swarm.train.data.data import BatchSampler

# A worker waits for rank 0 as long as rank 0 waits for its round: far longer than torch's default.
WAIT_FOR_RANK0 = datetime.timedelta(days=7)


@dataclass(frozen=True)
class TrainOrder:
    """What rank 0 sends the other ranks before ``steps`` inner steps."""

    steps: int
    peer_step: int  # rank 0's inner_steps_done: the warmup position
    run_step: int  # rank 0's position in the run: the decay position
    batches_drawn: int  # rank 0's RankSampler.batches_drawn: every rank's (they draw in lockstep; a resume moves it)
    params_changed: bool  # θl follows in a broadcast
    optimizer_changed: bool  # the AdamW state follows in a broadcast


@dataclass(frozen=True)
class GatherOptimizer:
    """What rank 0 of an FSDP peer sends the other ranks to gather their AdamW shards (for a checkpoint)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a peer's process group (made by ``join_ranks``)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def send(self, message: Any) -> Any:
        """Rank 0 sends ``message`` (a small picklable value, local to this machine); the others pass None
        and get it."""
        box = [message if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP over the ranks (every rank must call it at the same point)."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel
        # buffers are synced once, at init (a model's buffers do not train); newer torch names it differently
        quiet = (
            "forward_sync_buffers"
            if "forward_sync_buffers" in inspect.signature(ddp).parameters
            else "broadcast_buffers"
        )
        return ddp(model, device_ids=ids, **{quiet: False})

    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p in params:
                self._broadcast(p.data)

    def broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Rank 0's AdamW state to every rank (a resumed rank 0 has state the others never built)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        layout = self.send(
            [
                {
                    k: (tuple(v.shape), v.dtype, v.device.type)
                    for k, v in optimizer.state[p].items()
                    if torch.is_tensor(v)
                }
                if p in optimizer.state
                else None
                for p in params
            ]
            if self.leader
            else None
        )
        for p, keys in zip(params, layout):
            if keys is None:
                optimizer.state.pop(p, None)
                continue
            state = optimizer.state[p]
            for key, (shape, dtype, kind) in keys.items():
                if key not in state:
                    state[key] = torch.zeros(shape, dtype=dtype, device=p.device if kind != "cpu" else "cpu")
                self._broadcast(state[key])

    def _broadcast(self, tensor: torch.Tensor) -> None:
        if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
            on_device = tensor.to(self.device)
            dist.broadcast(on_device, src=0)
            tensor.copy_(on_device)
        else:
            dist.broadcast(tensor, src=0)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankSampler:
    """Rank ``rank`` of ``world_size``: batches rank, world_size + rank, 2·world_size + rank, … of the peer's
    sampler, the stream a one-process peer draws in order. ``state_dict`` is the peer's position in that stream
    (the same checkpoint format as one process), so a peer restarted with another ``--nproc`` resumes from it:
    it continues at the first batch none of its ranks has drawn, skipping fewer than ``world_size``."""

    def __init__(self, peer: BatchSampler, *, rank: int, world_size: int) -> None:
        self.peer = peer
        self.rank = rank
        self.world_size = world_size
        self.batches_drawn = 0  # this rank's own batches; every rank holds the same count

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.peer.batches_drawn = self.batches_drawn * self.world_size + self.rank
        self.batches_drawn += 1
        return self.peer.next_batch()

    def state_dict(self) -> dict[str, int]:
        self.peer.batches_drawn = self.batches_drawn * self.world_size
        return self.peer.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.peer.load_state_dict(state)
        self.batches_drawn = -(-self.peer.batches_drawn // self.world_size)


def join_ranks(*, rank: int, world_size: int, device: str, store_path: Optional[str] = None) -> Ranks:
    """Join the peer's process group: through the file ``store_path`` (``swarm peer --nproc``), or through
    torchrun's environment (MASTER_ADDR, MASTER_PORT) when it is None. ``device`` is the peer's device:
    "cpu" (gloo), "cuda" or "cuda:N" (nccl; rank r takes the r-th GPU from N)."""
    if device.startswith("cuda"):
        base = torch.device(device).index or 0
        torch.cuda.set_device(base + rank)
        backend, rank_device = "nccl", torch.device("cuda", base + rank)
    else:
        backend, rank_device = "gloo", torch.device(device)
    store = dist.FileStore(store_path, world_size) if store_path is not None else None
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=WAIT_FOR_RANK0,
        **({} if store is not None else {"init_method": "env://"}),
    )
    return Ranks(rank=rank, world_size=world_size, device=rank_device)


def peer_sampler(
    split: torch.Tensor, data: Any, shard_index: int, seed: int, ranks: Optional["Ranks"]
) -> "BatchSampler | RankSampler":
    """A peer's batches (``data``: the run's DataConfig); the ranks of a multi-GPU peer take turns drawing them."""
    sampler = BatchSampler(
        split,
        shard_index=shard_index,
        num_shards=data.num_shards,
        batch_size=data.batch_size,
        seq_len=data.seq_len,
        seed=seed,
    )
    return sampler if ranks is None else RankSampler(sampler, rank=ranks.rank, world_size=ranks.world_size)
