"""The sync side of a trainer (``swarm.train.trainer.LocalTrainer``): θl's fragments, the pseudo-gradient and
contribution each round sends, the outer step that makes the round's tentative global state, and the commit that
installs a global state and carries it into θl (replaced, or mixed with what θl trained meanwhile)."""

from __future__ import annotations

from typing import Optional

import torch

from swarm.config import NESTEROV, RunConfig
from swarm.core import average, fragments, spans
from swarm.core.codecs.codec import Codec
from swarm.core.codecs.error_feedback import ErrorFeedback
from swarm.core.codecs.lowrank import LowRankState
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState
from swarm.core.tentative import TentativeState
from swarm.train.contribution import Contribution
from swarm.train.first_passes import FirstPasses, check_same_shapes
from swarm.train.fragment_layout import FragmentLayout
from swarm.train.multi_gpu.rank_lockstep import RankLockstep
from swarm.train.multi_gpu.ranks import Ranks
from swarm.train.sent_feedback import SentFeedback


class OuterSync:
    """θl's sync with the committed θg, for the trainer that builds the fields below and trains θl."""

    run: RunConfig
    state: GlobalState  # the committed global state
    outer: OuterOptimizer
    layout: FragmentLayout
    fragments: list[list[int]]
    feedback: SentFeedback  # error feedback, the slice owners' residuals and low-rank warm starts of each fragment
    mixing_alpha: float
    lockstep: RankLockstep
    ranks: Optional[Ranks]
    first_passes: Optional[FirstPasses]
    _params: list[torch.Tensor]  # θl
    _global_versions: Optional[tuple[int, ...]]  # θl's versions while it holds θg's bits
    _steps_since_commit: int
    _samples_since_sync: list[int]

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

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
