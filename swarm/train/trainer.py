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

With F = 1 and no overlap (plain DiLoCo) every round starts from θg: the commit replaces all of θl.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from swarm.config import NESTEROV, RunConfig
from swarm.core import average, fragments, spans
from swarm.core.codecs.codec import Codec
from swarm.core.codecs.error_feedback import ErrorFeedback
from swarm.core.codecs.lowrank import LowRankState
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState
from swarm.core.tentative import TentativeState
from swarm.train import schedule
from swarm.train.contribution import Contribution, TrainStats
from swarm.train.data import prefetch
from swarm.train.data.data import check_vocab, load_corpus, shard_index_for_peer
from swarm.train.eager_optimizer import inner_adamw
from swarm.train.first_passes import FirstPasses, check_same_shapes, fitting, set_rng_states
from swarm.train.fragment_layout import FragmentLayout
from swarm.train.host_memory import release_free_memory
from swarm.train.inner_step import InnerStep
from swarm.train.model.global_eval import global_eval_loss
from swarm.train.model.initial_state import initial_state
from swarm.train.model.model import model_fingerprint
from swarm.train.model.peer_model import build_peer_model
from swarm.train.multi_gpu.rank_lockstep import RankLockstep
from swarm.train.multi_gpu.ranks import GatherOptimizer, Ranks, TrainOrder, peer_sampler
from swarm.train.sent_feedback import SentFeedback

log = logging.getLogger(__name__)


class LocalTrainer:
    """θl (model + AdamW, never reset or averaged) and the committed θg, outer state and round."""

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
        self.corpus = load_corpus(run.data)
        check_vocab(built.vocab_size, self.corpus)
        self.shard_index = shard_index_for_peer(peer_index, run.data.num_shards)
        self.sampler = peer_sampler(self.corpus.train, run.data, self.shard_index, run.seed, self.ranks)
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
        if initial is None:
            self.state = initial_state(
                self.model, self.outer
            )  # the committed global state; round 0: θ0, zero outer state
        else:
            self.state = fitting(initial, shapes, self.outer)
        self._step_time_ema_s: float | None = None
        self.first_passes: Optional[FirstPasses] = None  # the next step's passes, made ahead (``keep_passes``)
        self._global_versions: Optional[tuple[int, ...]] = None  # θl's versions while it holds θg's bits
        self.throttle: Optional[Callable[[float], None]] = None  # after each step, with its compute seconds
        self.clock: Callable[[float], None] = lambda seconds: None  # told inner seconds as they pass (live utilization)

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
        if initial is not None:
            self.commit(initial)  # θl ← θg, the outer state installed
        else:
            self._global_versions = self._versions()  # θg was cloned from θl

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

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

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

    @torch.no_grad()
    def load_global_into_model(self) -> None:
        for p, g in zip(self._params, self.global_params):
            p.copy_(g)
        self.lockstep.params_changed = True
        self._global_versions = self._versions()

    # ---- fragments ------------------------------------------------------------------------------

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_shapes(self, fragment: int | None = None) -> list[tuple[int, ...]]:
        """The shapes of ``fragment``'s flat vector in order: a whole tensor's shape, or (n,) for part of one."""
        return [
            tuple(self._params[s.param].shape) if spans.is_whole(s, self._params[s.param]) else (s.numel,)
            for s in self.layout.of(fragment)
        ]

    def fragment_numel(self, fragment: int | None = None) -> int:
        return sum(s.numel for s in self.layout.of(fragment))

    def samples_since_sync(self, fragment: int | None = None) -> int:
        """Sequences processed since ``fragment`` last contributed (or since θl was last reset)."""
        return self._samples_since_sync[self.layout.index(fragment)]

    # ---- outer step ---------------------------------------------------------------------------

    def local_params(self, fragment: int | None = None) -> list[torch.Tensor]:
        """θl over ``fragment``'s spans (default: every parameter), fp32 CPU: whole tensors, or 1-D parts."""
        return spans.gather(self._params, self.layout.of(fragment))

    def pseudo_gradient(self, fragment: int | None = None) -> torch.Tensor:
        """Δ = θg − θl over ``fragment``'s spans (default: all), flattened to one fp32 CPU vector."""
        return average.flat_pseudo_gradient(
            spans.gather(self.global_params, self.layout.of(fragment)), self.local_params(fragment)
        )

    def take_contribution(self, fragment: int | None = None) -> Contribution:
        """At a sync point: Δ of ``fragment`` (None: the only one) plus its error-feedback residual, and
        the samples behind it; the fragment's sample count restarts."""
        f = self.layout.index(fragment)
        delta = self.feedback.compensate(f, self.pseudo_gradient(f))
        samples, self._samples_since_sync[f] = self._samples_since_sync[f], 0
        return self.feedback.contribution(f, delta, samples)

    def return_contribution(self, contribution: Contribution) -> None:
        """The round ``contribution`` was taken for was voided: nothing of it was applied anywhere, and
        its work is still in θl (no commit replaced it), so the next contribution of that fragment
        carries it again, weighted by all of its samples. (Error feedback was not updated either:
        ``record_sent`` is called when the round commits.)"""
        self._samples_since_sync[contribution.fragment] += contribution.samples
        self.feedback.returned(contribution)

    def record_sent(
        self, contribution: Contribution, codec: Codec | str | None = None, parts: int | None = None
    ) -> None:
        """Error feedback: remember what the round plan's codec (``codec`` for a contribution taken by hand) dropped
        from ``contribution`` once it went out (``SentFeedback.record_sent``); a no-op when error feedback is off."""
        self.feedback.record_sent(contribution, codec, parts)

    @property
    def error_feedback(self) -> list[ErrorFeedback] | None:
        """Each fragment's error feedback (None: off)."""
        return self.feedback.error_feedback

    @property
    def lowrank(self) -> list[LowRankState] | None:
        """Each fragment's low-rank warm start (None: not a lowrank codec)."""
        return self.feedback.lowrank

    def apply(
        self, avg_delta_flat: torch.Tensor, fragment: int | None, round_no: int
    ) -> "GlobalState | TentativeState":
        """The tentative global state of round ``round_no``: an outer step of ``fragment`` (None: every
        parameter) with the averaged Δ̄ over it. The trainer is not changed, so a round that is not
        committed leaves no trace. With the Nesterov outer optimizer it is a ``TentativeState``: the step
        is made a tensor at a time (hash, vote) and in place at the commit, never as a second θg."""
        fragment_spans = self.layout.of(fragment)
        deltas = average.unflatten(avg_delta_flat, spans.gather(self.global_params, fragment_spans))
        if self.outer.name == NESTEROV:  # stepped a tensor at a time when hashed, written or committed
            return TentativeState(round_no, self.state, self.outer, deltas, fragment_spans)
        params, outer_state = spans.tentative_step(self.outer, self.global_params, deltas, fragment_spans)
        return GlobalState(round_no, params, outer_state)

    def commit(self, state: "GlobalState | TentativeState", *, fragment: int | None = None) -> None:
        """Install ``state`` as the committed global state; the trainer keeps its tensors, so the caller
        must not modify them afterwards.

        ``fragment=None`` (the initial state, a state downloaded from a peer or resumed): θl restarts
        from θg and nothing counts as trained since.  ``fragment=f`` (a round) merges only that
        fragment into θl: replaced by θg_f (plain DiLoCo: f is every parameter), or, with overlap,
        mixed as α·θl_f + (1 − α)·θg_f (``mixing_alpha``); the rest of θl keeps training.
        """
        same = state is self.state  # installed again (θ0 at a peer's start): θl may hold its bits already
        if not same:
            self.first_passes = None  # θl changes: passes made ahead on it are of no use (and their memory goes)
        keep_unsent = self.run.rounds.keep_unsent_locally and self.error_feedback is not None
        replaced = fragment is not None and self.mixing_alpha == 0.0 and not keep_unsent  # θl's spans ← θg's
        copied = False
        if isinstance(state, TentativeState):
            if state.base is not self.state:
                raise ValueError(
                    f"round {state.round_no}'s tentative state was stepped from another state than the committed one."
                )
            self.layout.of(fragment)  # checks the fragment before anything changes
            # θl's spans replaced: each stepped piece is copied into θl as it is stepped, not in a pass of its own
            copied = replaced and all(
                p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in self._params
            )
            state = state.commit_in_place(copy_into=self._params if copied else None)
        check_same_shapes(state.params, self.global_params)
        fragment_spans = self.layout.of(fragment)  # checks the fragment before anything changes
        self.outer.load_state_tensors(state.outer_state)
        self.state = state
        self._steps_since_commit = 0
        self.lockstep.params_changed = True
        if fragment is None:
            if not same or self._global_versions != self._versions() or self.ranks is not None:
                self.load_global_into_model()  # (θl still holding the committed state's bits is not copied again)
            else:
                self.lockstep.params_changed = True
            self._samples_since_sync = [0] * len(self.fragments)
            return
        if replaced:  # plain replacement: θg's bits copied straight into θl
            if not copied:
                spans.write(self._params, fragment_spans, spans.gather(self.global_params, fragment_spans))
            return
        merged = fragments.merge_fragment(
            self.local_params(fragment), spans.gather(self.global_params, fragment_spans), self.mixing_alpha
        )
        if keep_unsent:
            # θl ← θg − residual: the next Δ = θg − θl starts with what the wire has not delivered yet
            residual = average.unflatten(self.error_feedback[self.layout.index(fragment)].residual, merged)
            merged = [m - r for m, r in zip(merged, residual)]
        spans.write(self._params, fragment_spans, merged)

    @property
    def global_params(self) -> list[torch.Tensor]:
        """θg of the committed state (fp32, CPU)."""
        return self.state.params

    @property
    def round_no(self) -> int:
        """The committed round the global state belongs to (0: the initial state)."""
        return self.state.round_no

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
