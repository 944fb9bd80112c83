"""The held-out loss of the committed θg, measured in the model that holds θl: θg's tensors stand in for θl's
while it evaluates, then θl's are put back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swarm.config import DataConfig
from swarm.train.data.byte_corpus import ByteCorpus
from swarm.train.data.data import eval_loss
from swarm.train.model.run_model import LossFn

if TYPE_CHECKING:
    from swarm.train.data.data_tokens import TokenCorpus


def global_eval_loss(
    model: nn.Module,
    params: list[torch.Tensor],
    global_params: list[torch.Tensor],
    corpus: "ByteCorpus | TokenCorpus",
    data: DataConfig,
    loss: LossFn,
) -> float:
    """Held-out loss of ``global_params`` in ``model`` (whose parameters are ``params``, θl): on the CPU θg's own
    memory, no copy; on another device a copy there."""
    local = [p.data for p in params]
    with torch.no_grad():
        try:
            for p, g in zip(params, global_params):
                p.data = g.to(p.device)
            return eval_loss(
                model,
                corpus,
                batch_size=data.batch_size,
                seq_len=data.seq_len,
                num_batches=data.eval_batches,
                loss=loss,
            )
        finally:
            for p, t in zip(params, local):
                p.data = t
