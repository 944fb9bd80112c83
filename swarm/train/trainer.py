"""One peer's local training state: the model and inner AdamW (θl), the committed global state
(``GlobalState``: θg, the outer optimizer's state and their hash), its error feedback, and the DiLoCo /
Streaming DiLoCo steps on them. The round runner (``swarm.train.round``) drives it, in the daemon and in
the simulator alike:

    trainer.train(n)                             # n = fragments.round_steps(r, H, F) at full speed
    c = trainer.take_contribution(f)             # Δ_f (+ error-feedback residual) and its weight
    avg = <butterfly all-reduce of c.delta, weight c.samples>   (background while overlapping)
    trainer.train(τ)                             # overlap: keep training while it is in flight
    tentative = trainer.apply(avg, f, r)         # a GlobalState, hashed and voted on
    trainer.record_sent(c)                       # on commit: what the round plan's codec dropped, for the next
    trainer.commit(tentative, fragment=f)        # install θg; merge the local fragment

With F = 1 and no overlap (plain DiLoCo) every round starts from θg: the commit replaces all of θl. The sync
side (``take_contribution``, ``apply``, ``commit``) is in ``swarm.train.outer_sync``.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from swarm.config import RunConfig
from swarm.core import fragments
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState
from swarm.train import schedule
from swarm.train.contribution import TrainStats
from swarm.train.data import prefetch
from swarm.train.data.data import check_vocab, load_corpus, shard_index_for_peer
from swarm.train.eager_optimizer import inner_adamw
from swarm.train.first_passes import FirstPasses, fitting, set_rng_states
from swarm.train.fragment_layout import FragmentLayout
from swarm.train.host_memory import release_free_memory
from swarm.train.inner_step import InnerStep
from swarm.train.model.global_eval import global_eval_loss
from swarm.train.model.initial_state import initial_state
from swarm.train.model.model import model_fingerprint
from swarm.train.model.peer_model import build_peer_model
from swarm.train.multi_gpu.rank_lockstep import RankLockstep
from swarm.train.multi_gpu.ranks import GatherOptimizer, Ranks, TrainOrder, peer_sampler
from swarm.train.outer_sync import OuterSync
from swarm.train.sent_feedback import SentFeedback

log = logging.getLogger(__name__)


class LocalTrainer(OuterSync):
    """θl (model + AdamW, never reset or averaged) and the committed θg, outer state and round; its sync with θg
    (contributions, the outer step, the commit) is ``swarm.train.outer_sync.OuterSync``'s."""

    def __init__(
        self,
        run: RunConfig,
        *,
        peer_index: int,
        device: str = "cpu",
        ranks: Optional[Ranks] = None,
        initial: Optional[GlobalState] = None,
    ) -> None:
        """``ranks``: this process's place in a multi-GPU peer (``swarm.train.multi_gpu.ranks``); every rank builds
        its trainer at the same point, rank 0 first telling the others the run and the peer index.
        ``initial``: the committed state to start from (a peer's own checkpoint or vote) instead of θ0, which is
        then neither drawn nor kept; θl starts from it. ValueError when it is not a state of this model."""
        self.run = run
        self.peer_index = peer_index
        self.ranks = ranks if ranks is not None and ranks.world_size > 1 else None
        if self.ranks is not None and self.ranks.leader:
            self.ranks.send((run.to_json(), peer_index))
        self.device = self.ranks.device if self.ranks is not None else torch.device(device)
        fsdp = self.ranks is not None and run.inner.sharding == "fsdp"
        # the same θ0 on every peer; with FSDP the shards the ranks train in self.sharded (self.model: θl whole)
        built, self.sharded = build_peer_model(run, self.device, fsdp=fsdp, draw=initial is None)
        self.model, self.loss_fn = built.module, built.loss
        self._split_fragments(run)  # before loading the data: a pattern the run cannot use fails at once
        self._init_data(run, built.vocab_size)
        self._params = list(self.model.parameters())
        trained = self.sharded.params if fsdp else self._params  # with FSDP, self.model is θl whole, on the CPU
        self.optimizer = inner_adamw(trained, run.inner)
        self.inner_steps_done = 0  # counts toward the warmup across rounds
        self.inner_step = InnerStep(
            self.sharded.module if fsdp else self.model,
            self.loss_fn,
            self.optimizer,
            run.inner,
            device=self.device,
            wrap=self.ranks.wrap if self.ranks and not fsdp else None,
        )
        self.world_size = self.ranks.world_size if self.ranks is not None else 1
        self._steps_since_commit = 0  # with the committed round: the run position the lr decays over
        self.lockstep = RankLockstep(self.ranks, self.sharded, self._params, self.optimizer)
        shapes = [p.shape for p in self._params]
        self.outer = OuterOptimizer(run.outer, shapes)
        # the committed global state; round 0: θ0, zero outer state
        if initial is None:
            self.state = initial_state(self.model, self.outer)
        else:
            self.state = fitting(initial, shapes, self.outer)
        self._step_time_ema_s: float | None = None
        self.first_passes: Optional[FirstPasses] = None  # the next step's passes, made ahead (``keep_passes``)
        self._global_versions: Optional[tuple[int, ...]] = None  # θl's versions while it holds θg's bits
        self.throttle: Optional[Callable[[float], None]] = None  # after each step, with its compute seconds
        self.clock: Callable[[float], None] = lambda seconds: None  # told inner seconds as they pass (live utilization)

        self._init_streaming(run)
        if initial is not None:
            self.commit(initial)  # θl ← θg, the outer state installed
        else:
            self._global_versions = self._versions()  # θg was cloned from θl

    def _init_data(self, run: RunConfig, vocab_size: int) -> None:
        """The corpus (refused unless the model's vocabulary covers it) and this peer's shard sampler."""
        self.corpus = load_corpus(run.data)
        check_vocab(vocab_size, self.corpus)
        self.shard_index = shard_index_for_peer(self.peer_index, run.data.num_shards)
        self.sampler = peer_sampler(self.corpus.train, run.data, self.shard_index, run.seed, self.ranks)

    def _init_streaming(self, run: RunConfig) -> None:
        """How a round's global fragment meets θl, and each fragment's error feedback and samples since its sync."""
        rounds = run.rounds
        # Plain DiLoCo (one fragment, no overlap) restarts every round from θg; streaming peers keep
        # training and replace or mix one fragment at a time when its global value arrives.
        self.streaming = rounds.fragments > 1 or rounds.overlap_steps > 0
        # α only weighs the τ steps a peer trained while the exchange was in flight; without overlap the
        # local fragment is the one whose Δ was just sent, and keeping part of it would count it twice.
        self.mixing_alpha = rounds.mixing_alpha if rounds.overlap_steps > 0 else 0.0
        # error feedback, the slice owners' residuals and low-rank warm starts of each fragment
        self.feedback = SentFeedback(rounds, run.seed, [self.fragment_numel(f) for f in range(len(self.fragments))])
        self._samples_since_sync = [0] * len(self.fragments)

    def _split_fragments(self, run: RunConfig) -> None:
        rounds = run.rounds
        self.layout = FragmentLayout(
            [(name, p.shape) for name, p in self.model.named_parameters()],
            rounds.fragments,
            rounds.fragment_pattern,
            run.outer.name,
        )
        self.fragment_spans, self.fragments = self.layout.spans, self.layout.params

    # ---- inner loop ---------------------------------------------------------------------------

    @property
    def run_inner_steps(self) -> int:
        """The run's inner steps at full speed (0: no max_rounds, so no end to decay towards)."""
        rc = self.run.rounds
        return fragments.round_end_step(rc.max_rounds, rc.inner_steps, rc.fragments) if rc.max_rounds else 0

    @property
    def run_step(self) -> int:
        """Where this peer is in the run: the committed round's end step plus the steps trained since."""
        rc = self.run.rounds
        return fragments.round_end_step(self.round_no, rc.inner_steps, rc.fragments) + self._steps_since_commit

    def lr_at(self, step: int, run_step: int = 0) -> float:
        """The rate of this peer's ``step``-th inner step taken at ``run_step`` (``swarm.train.schedule``)."""
        return schedule.lr_at(self.run.inner, peer_step=step, run_step=run_step, run_steps=self.run_inner_steps)

    def train(self, steps: int) -> TrainStats:
        """``steps`` AdamW steps on this peer's shard, from θl (which a commit set to θg in plain DiLoCo,
        or which still holds a voided round's work, see ``return_contribution``). On rank 0 of a multi-GPU
        peer every rank trains them together (each on its own batches)."""
        if steps < 0:
            raise ValueError(f"steps must be non-negative, got {steps}.")
        start = time.perf_counter()
        if self.ranks is not None and steps:
            self.lockstep.lead(
                steps, peer_step=self.inner_steps_done, run_step=self.run_step, batches_drawn=self.sampler.batches_drawn
            )
        passes = self._usable_passes() if steps else None
        if passes is not None:
            log.debug("peer %d: the first step uses the passes made ahead (%.2fs)", self.peer_index, passes.seconds)
        mean_loss, clocked = self._train_steps(steps, self.run_step, passes)
        elapsed = time.perf_counter() - start
        self.clock(elapsed - clocked)
        if steps:
            per_step = (elapsed + (passes.seconds if passes is not None else 0.0)) / steps  # the passes made ahead too
            ema = self._step_time_ema_s
            self._step_time_ema_s = per_step if ema is None else 0.7 * ema + 0.3 * per_step
        samples = steps * self.run.data.batch_size * self.world_size
        self._steps_since_commit += steps
        self._samples_since_sync = [n + samples for n in self._samples_since_sync]
        log.debug(
            "peer %d round %d: %d steps, loss %.4f, %.2fs",
            self.peer_index,
            self.round_no + 1,
            steps,
            mean_loss,
            elapsed,
        )
        return TrainStats(
            steps=steps,
            samples=samples,
            tokens=samples * self.run.data.seq_len,
            mean_loss=mean_loss,
            inner_time_s=elapsed,
        )

    def _train_steps(self, steps: int, run_step: int, passes: Optional[FirstPasses] = None) -> tuple[float, float]:
        """(mean loss, the seconds already told to ``clock``). ``passes``: the first step's, made ahead."""
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        draw = prefetch.batches(self.sampler.next_batch, steps, self.device, prefetch=self.run.inner.prefetch)
        step_start = mark = time.perf_counter()
        clocked = 0.0
        for i, (x, y) in enumerate(draw):
            lr = self.lr_at(self.inner_steps_done, run_step + i)
            if i == 0 and passes is not None:  # the passes this step would make, made ahead on the same batch
                for p, g in zip(self._params, passes.grads):
                    p.grad = g
                set_rng_states(self.device, passes.rng_after)  # as if its dropout had drawn now
                self.inner_step.update(lr)
                loss_sum += passes.loss
            else:
                loss_sum += self.inner_step.step(x, y, lr)  # no per-step .item(): it would stall a GPU every step
            self.inner_steps_done += 1
            if self.throttle is not None:  # a slow device (fault injection): the measured step time includes the wait
                self.throttle(time.perf_counter() - step_start)
                step_start = time.perf_counter()
            now = time.perf_counter()
            self.clock(now - mark)
            clocked, mark = clocked + now - mark, now
        if steps:  # the gradients are not read again before the next step makes new ones: a model's worth freed
            self.optimizer.zero_grad(set_to_none=True)
            release_free_memory()
        if self.sharded is not None and steps:
            self.sharded.gather(self._params if self.ranks.leader else None)  # rank 0's θl is whole again
        return (loss_sum.item() / steps if steps else float("nan")), clocked

    def keep_passes(self, passes: FirstPasses) -> None:
        """Keep a step's passes made ahead on the next batch (``FirstPasses``) for the next step."""
        self.first_passes = passes

    def _usable_passes(self) -> Optional[FirstPasses]:
        """The kept passes when the next step would make the very same ones (then given up: used once); else None,
        and they are dropped."""
        passes, self.first_passes = self.first_passes, None
        if passes is None or not self.holds_first_passes(passes):
            return None
        return passes

    def holds_first_passes(self, passes: Optional[FirstPasses] = None) -> bool:
        """Whether the next step can use the kept passes (``passes``: these): θl, the next batch and the random
        state are the ones they were made with."""
        passes = passes if passes is not None else self.first_passes
        return (
            passes is not None
            and self.ranks is None
            and passes.usable(self._versions(), self.sampler.batches_drawn, self.device)
        )

    def follow(self, order: "TrainOrder | GatherOptimizer") -> None:
        """The other ranks: train in lockstep with rank 0 as ``order`` says (or give it their AdamW shards)."""
        if isinstance(order, GatherOptimizer):
            self.sharded.gather_optimizer(self.optimizer)
            return
        self.lockstep.sync(order)
        self.inner_steps_done = order.peer_step
        self.sampler.batches_drawn = order.batches_drawn
        self._train_steps(order.steps, order.run_step)

    def optimizer_state_dict(self) -> dict:
        return self.lockstep.optimizer_state_dict()  # whole, also from an FSDP peer's shards

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        self.lockstep.load_optimizer_state_dict(state_dict)

    # ---- reporting ----------------------------------------------------------------------------

    @property
    def param_count(self) -> int:
        return sum(p.numel() for p in self.global_params)

    @property
    def fingerprint(self) -> str:
        return model_fingerprint(self.model)

    @property
    def tokens_per_step(self) -> int:
        return self.run.data.batch_size * self.run.data.seq_len * self.world_size

    @property
    def local_step_time_s(self) -> float | None:
        """Smoothed seconds per inner step (None before the first step): for step budgets."""
        return self._step_time_ema_s

    @property
    def tokens_per_second(self) -> float | None:
        t = self._step_time_ema_s
        return None if not t else self.tokens_per_step / t

    def eval_loss(self) -> float:
        """Held-out loss of θg (not θl), in θl's model (``swarm.train.model.global_eval``)."""
        return global_eval_loss(self.model, self._params, self.global_params, self.corpus, self.run.data, self.loss_fn)
