"""The model one peer trains: the run's model (``swarm.train.model.run_model``) placed on the peer's device, or with
FSDP kept whole on the CPU beside the shards its ranks train (``swarm.train.multi_gpu.sharding``), and checked against the
run's sequence length."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from swarm.config import RunConfig
from swarm.train.model.run_model import RunModel, build_run_model

if TYPE_CHECKING:
    from swarm.train.multi_gpu.sharding import ShardedModel


def build_peer_model(
    run: RunConfig, device: torch.device, *, fsdp: bool, draw: bool
) -> tuple[RunModel, Optional[ShardedModel]]:
    """The run's model (θ0 drawn when ``draw``, the same on every peer) on ``device`` and, with ``fsdp``, the
    shards the ranks train (the model itself then stays on the CPU). ValueError when the data's sequences are
    longer than the model's context."""
    built = build_run_model(run.model, seed=run.seed, draw=draw)
    built = dataclasses.replace(built, module=built.module.to("cpu" if fsdp else device))
    sharded: Optional[ShardedModel] = None
    if fsdp:  # torch.distributed.fsdp costs every peer ~2 CPU-s of imports: only the FSDP ones pay it
        from swarm.train.multi_gpu import sharding

        sharded = sharding.ShardedModel(built.module, device)
    if built.context is not None and run.data.seq_len > built.context:
        raise ValueError(
            f"[data] seq_len {run.data.seq_len} exceeds the model context {built.context};"
            " lower seq_len or set [model] context."
        )
    return built, sharded
