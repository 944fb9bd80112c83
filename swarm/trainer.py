"""One peer's local training state: the model and inner AdamW (θl), the committed global state (θg
and outer momentum), and the DiLoCo steps on them.  The simulator and the peer daemon both use it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from swarm import algorithm
from swarm.config import RunConfig
from swarm.data import BatchSampler, ByteCorpus, eval_loss, shard_index_for_peer
from swarm.model import build_model, model_fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainStats:
    steps: int
    samples: int  # sequences processed: the weight of this peer's pseudo-gradient
    tokens: int
    mean_loss: float  # nats per byte, averaged over the steps; nan for zero steps
    inner_time_s: float


class LocalTrainer:
    """θl (model + AdamW, never reset or averaged) and the committed θg, momentum and round."""

    def __init__(self, run: RunConfig, *, peer_index: int, device: str = "cpu") -> None:
        self.run = run
        self.peer_index = peer_index
        self.device = torch.device(device)
        data = run.data
        self.model = build_model(run.model, seed=run.seed).to(self.device)  # same θ0 on every peer
        if data.seq_len > self.model.cfg.context:
            raise ValueError(
                f"[data] seq_len {data.seq_len} exceeds the model context {self.model.cfg.context};"
                " lower seq_len or set [model] context."
            )
        self.corpus = ByteCorpus.load(data)
        self.shard_index = shard_index_for_peer(peer_index, data.num_shards)
        self.sampler = BatchSampler(
            self.corpus.train,
            shard_index=self.shard_index,
            num_shards=data.num_shards,
            batch_size=data.batch_size,
            seq_len=data.seq_len,
            seed=run.seed,
        )
        self._params = list(self.model.parameters())
        # nanoGPT's grouping: decay matrices and embeddings, not LayerNorm gains.
        decay = [p for p in self._params if p.dim() >= 2]
        no_decay = [p for p in self._params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": run.inner.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=run.inner.lr,
            betas=(run.inner.beta1, run.inner.beta2),
        )
        self.inner_steps_done = 0  # counts toward the warmup across rounds
        self.global_params: list[torch.Tensor] = [algorithm.as_cpu_f32(p).clone() for p in self._params]
        self.momentum: list[torch.Tensor] = algorithm.OuterState.zeros_like(self.global_params).momentum
        self.round = 0  # the committed round the global state belongs to
        self._step_time_ema_s: float | None = None

    # ---- inner loop ---------------------------------------------------------------------------

    def lr_at(self, step: int) -> float:
        """Linear warmup over the first ``warmup_steps`` inner steps of this peer, then constant."""
        warmup = self.run.inner.warmup_steps
        if warmup > 0 and step < warmup:
            return self.run.inner.lr * (step + 1) / warmup
        return self.run.inner.lr

    def train(self, steps: int) -> TrainStats:
        """θl ← θg, then ``steps`` AdamW steps on this peer's shard."""
        if steps < 0:
            raise ValueError(f"steps must be non-negative, got {steps}.")
        self.load_global_into_model()
        self.model.train()
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(steps):
            x, y = self.sampler.next_batch()
            _, loss = self.model(x.to(self.device), y.to(self.device))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.run.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self._params, self.run.inner.grad_clip)
            lr = self.lr_at(self.inner_steps_done)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.inner_steps_done += 1
            loss_sum += loss.detach()  # no per-step .item(): it would stall a GPU every step
        mean_loss = loss_sum.item() / steps if steps else float("nan")
        elapsed = time.perf_counter() - start
        if steps:
            per_step = elapsed / steps
            ema = self._step_time_ema_s
            self._step_time_ema_s = per_step if ema is None else 0.7 * ema + 0.3 * per_step
        samples = steps * self.run.data.batch_size
        log.debug("peer %d round %d: %d steps, loss %.4f, %.2fs", self.peer_index, self.round + 1, steps, mean_loss, elapsed)
        return TrainStats(steps=steps, samples=samples, tokens=samples * self.run.data.seq_len,
                          mean_loss=mean_loss, inner_time_s=elapsed)

    @torch.no_grad()
    def load_global_into_model(self) -> None:
        for p, g in zip(self._params, self.global_params):
            p.copy_(g)

    # ---- outer step ---------------------------------------------------------------------------

    def local_params(self) -> list[torch.Tensor]:
        return [algorithm.as_cpu_f32(p) for p in self._params]

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θg − θl, flattened to one fp32 CPU vector."""
        return algorithm.flatten(algorithm.pseudo_gradient(self.global_params, self.local_params()))

    def apply(self, avg_delta_flat: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The tentative (θg, momentum) after an outer step with Δ̄; the trainer is not changed, so a
        round that is not committed leaves no trace."""
        outer = self.run.outer
        deltas = algorithm.unflatten(avg_delta_flat, self.global_params)
        return algorithm.outer_step(self.global_params, deltas, self.momentum,
                                    lr=outer.lr, momentum_coef=outer.momentum, nesterov=outer.nesterov)

    def commit(self, params: list[torch.Tensor], momentum: list[torch.Tensor], round: int) -> None:
        """Install (θg, momentum) as the committed global state of ``round``; the trainer keeps the
        tensors, so the caller must not modify them afterwards."""
        if len(params) != len(self.global_params) or len(momentum) != len(self.global_params):
            raise ValueError("committed state has the wrong number of tensors.")
        for new, m, old in zip(params, momentum, self.global_params):
            if new.shape != old.shape or m.shape != old.shape:
                raise ValueError(f"committed tensor shape {tuple(new.shape)} does not match {tuple(old.shape)}.")
        self.global_params = [algorithm.as_cpu_f32(t).contiguous() for t in params]
        self.momentum = [algorithm.as_cpu_f32(t).contiguous() for t in momentum]
        self.round = round

    # ---- reporting ----------------------------------------------------------------------------

    def state_hash(self) -> str:
        return algorithm.state_hash(self.global_params, self.momentum)

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.global_params)

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.run.data.batch_size * self.run.data.seq_len

    @property
    def local_step_time_s(self) -> float | None:
        """Smoothed seconds per inner step (None before the first step): for step budgets."""
        return self._step_time_ema_s

    @property
    def tokens_per_second(self) -> float | None:
        t = self._step_time_ema_s
        return None if not t else self.tokens_per_step / t

    def eval_loss(self) -> float:
        """Held-out loss of θg (not θl); the model's local parameters are restored afterwards."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self._params]
            self.load_global_into_model()
            try:
                d = self.run.data
                return eval_loss(self.model, self.corpus, batch_size=d.batch_size,
                                 seq_len=d.seq_len, num_batches=d.eval_batches)
            finally:
                for p, s in zip(self._params, saved):
                    p.copy_(s)
