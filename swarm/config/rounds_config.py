"""[rounds]: how a round runs: its length, the codec, fragments and overlap, the aggregation, the controller, the
timeouts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from swarm.config.checks import MAX_PEERS, MAX_ROUNDS, MAX_STEPS, MAX_TIMEOUT_S, ConfigError, check_range

# Valid names, listed here so that the config stays a leaf: swarm.core.codecs.codec.CODECS and
# swarm.core.fragments.PATTERNS implement exactly these (tests/unit/test_config.py checks they agree).
CODEC_NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "sign", "ternary", "topk-fp16", "topk-int8", "topk-int4")
# lowrank<r>-<values> (swarm.core.codecs.lowrank): the codecs its two factors may go over the wire in
LOWRANK_VALUES = ("fp32", "fp16", "bf16", "int8", "int4")
FRAGMENT_PATTERNS = ("strided", "contiguous", "balanced")
# swarm.core.aggregation.RULES implements exactly these: how a slice's owner combines the group's slices.
AGGREGATIONS = ("mean", "clipped_mean", "trimmed_mean")
# coordinator.rounds.controller: "off" keeps [rounds] codec and equal slices; "auto" adapts them to measured links.
CONTROLLERS = ("off", "auto")
# How a group averages (swarm.net.exchange.allreduce): "auto" is "all_gather" when the run admits strangers, else "butterfly".
EXCHANGES = ("auto", "butterfly", "all_gather")


def check_codec_name(name: str) -> None:
    """ConfigError unless ``name`` is a codec: one of CODEC_NAMES, a topk one with its density
    (``topk-int4@0.003``: the fraction of each chunk's values sent; the plain name sends 1%), or a sparse
    ternary one, which always names it (``ternary@0.1``)."""
    if name in CODEC_NAMES:
        return
    if name.startswith("lowrank"):
        _check_lowrank_name(name)
        return
    base, at, density = name.partition("@")
    if not (at and (base.startswith("topk-") or base == "ternary") and base in CODEC_NAMES):
        raise ConfigError(
            f"[rounds] codec {name!r} is unknown; choose one of {sorted(CODEC_NAMES)}"
            " (a topk codec may name its density: topk-int4@0.003; a sparse ternary one must: ternary@0.1)."
        )
    try:
        fraction = float(density)
    except ValueError:
        fraction = math.nan
    if not (math.isfinite(fraction) and 0 < fraction <= 1):
        raise ConfigError(
            f"[rounds] codec {name!r}: the density after '@' must be a fraction in (0, 1], e.g. {base}@0.01."
        )


def _check_lowrank_name(name: str) -> None:
    """ConfigError unless ``name`` is ``lowrank{r}-{values}``: rank r in 1..64, values a dense
    butterfly codec (``lowrank4-fp16``, ``lowrank8-int8``)."""
    rank, _, values = name[len("lowrank") :].partition("-")
    if not (rank.isdigit() and 1 <= int(rank) <= 64 and values in LOWRANK_VALUES):
        raise ConfigError(
            f"[rounds] codec {name!r}: a low-rank codec is lowrank<rank>-<values> with a rank from 1"
            f" to 64 and values one of {list(LOWRANK_VALUES)}, e.g. lowrank4-fp16."
        )


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    inner_steps: int = 50  # H: inner steps per round
    max_rounds: Optional[int] = None  # the run finishes after this many committed rounds
    min_peers: int = 1  # round 1 opens once this many peers are ready
    codec: str = "fp32"  # wire format of pseudo-gradients
    eval_every_rounds: int = 1
    matchmaking_window_s: float = 15.0  # how long a peer waits for missing groupmates (longer while still planned)
    exchange_timeout_s: float = 60.0  # bound on moving the tensors once a group formed
    round_timeout_s: float = 900.0  # a round undecided this long after it opened is decided as is
    report_grace_s: float = 10.0  # once a hash has its group's quorum, how long the round waits for the rest
    # A round is a time budget (coordinator.rounds.budgets): a peer finishing inner_steps at most this much after the
    # fastest does them all, a slower one what fits the fastest's time; one not ready to exchange this plus
    # report_grace_s after that time is left out of the round (the others go on; it resyncs).
    straggler_slack_s: float = 5.0
    # Lossy codecs only: a peer adds what the codec dropped last time to its next pseudo-gradient.
    error_feedback: bool = True
    # SparseLoCo's decay β of the error-feedback residual: a peer sends Δ + β·residual. 1 keeps every dropped
    # value at full weight; β < 1 (e.g. 0.95) makes the residual the outer momentum (pair it with an outer
    # step without momentum).
    error_feedback_decay: float = 1.0
    # A lossy codec without overlap: instead of adding what the codec dropped to the next pseudo-gradient, a
    # peer restarts its inner steps from θg minus it (θl ← θg − residual, per fragment as it merges), so the next
    # Δ carries it and the inner steps do not learn it a second time. Lets error feedback work with the outer momentum.
    keep_unsent_locally: bool = False
    # Streaming DiLoCo (see swarm.core.fragments): the parameters are split into `fragments` groups of layers
    # that sync one per round, staggered, each once every inner_steps steps; 1 is plain DiLoCo.
    fragments: int = 1
    # "strided" (whole blocks dealt round-robin, Streaming DiLoCo), "contiguous" (runs of whole blocks,
    # torchft) or "balanced" (equal element counts, cut across tensors on codec blocks: the lowest peak
    # bytes per sync; needs the nesterov outer optimizer)
    fragment_pattern: str = "strided"
    # A fragment's exchange runs during the next overlap_steps inner steps and is merged after them
    # (0: the peer waits for it). With controller = "auto" overlap_steps is a minimum: a peer whose exchange
    # has not ended by then keeps training and merges at the first step after it ends (within the round).
    overlap_steps: int = 0
    # With overlap: local ← alpha·local + (1−alpha)·global for the merged fragment (the paper's 0.5).
    mixing_alpha: float = 0.5
    # A group smaller than the run's live peers takes a smaller outer step: the average counts the live
    # peers that did not contribute (joining, syncing, restarting) as a zero Δ. A round of one peer out
    # of five, on its own data shard, otherwise moves θg as far as a round of all five.
    scale_by_participation: bool = True
    # How the owner of a slice combines the group's slices (swarm.core.aggregation): "mean" (the
    # sample-weighted mean), "clipped_mean" (in a group of 3 or more, each slice clipped to clip_factor x the
    # group's median slice norm first) or "trimmed_mean" (per coordinate, the trim_fraction largest and
    # smallest values dropped, at least one of each in a group of 3 or more). Under every rule a slice whose
    # norm exceeds reject_factor x the group's median slice norm is left out of that slice's average (0:
    # never). "auto": "clipped_mean" (bit for bit the mean while no slice is clipped, as in an honest run of
    # peers alike), but "mean" for the lowrank codecs, which average their factors linearly.
    aggregation: str = "auto"
    clip_factor: float = 2.0
    trim_fraction: float = 0.25
    reject_factor: float = 100.0
    # Two-level averaging (swarm.core.site_plan): the peers of a site (the coordinator-signed site of their
    # credential) first average among themselves in sub-groups of at most group_size peers (0: no cap), and
    # one representative per sub-group takes the sub-group's average across sites; off: one flat group.
    hierarchical: bool = False
    group_size: int = 0
    # The adaptive controller (coordinator.rounds.controller). "auto": as it opens each round the coordinator picks
    # the least lossy of controller_codecs whose predicted exchange stays hidden behind computation (within
    # the overlap window, or without overlap within controller_exchange_fraction of the round), and each
    # member's share of the reduction in proportion to its measured uplink; every member applies the same
    # choice; with overlap a peer merges when its exchange has ended (overlap_steps is a minimum), so a
    # prediction that was short does not stall training. "off": every round uses codec and equal slices, as
    # without a controller, and the merge is at exactly overlap_steps (which the simulator reproduces).
    controller: str = "off"
    controller_codecs: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
    controller_exchange_fraction: float = 0.1
    controller_max_inner_steps: Optional[int] = None  # cap on the H it recommends (None: 4 x inner_steps)
    # Whether anyone the operator does not vouch for may hold a peer token (volunteers, a public join string).
    # true: no member is trusted to average a slice for the others, so exchange "auto" is the all-gather.
    admits_strangers: bool = False
    # How a group averages a round's pseudo-gradients. "butterfly": each member owns one slice, averages it
    # and sends it back (2 (K - 1) / K of the encoded vector sent per member; a malicious owner sets its
    # slice's average). "all_gather": each member sends its whole encoded vector to every groupmate and
    # averages all K itself ((K - 1) x the encoded vector sent per member; no member's average is trusted).
    # "auto": "all_gather" when admits_strangers, else "butterfly". Sparse (topk) codecs are always all-gathered.
    exchange: str = "auto"

    def check_real_swarm(self) -> None:
        """ConfigError unless a real swarm (a coordinator and peers over the network) can run these rounds; the
        simulator runs every valid config. The one place that decides it: the coordinator checks its config with
        it before it starts, and a peer's exchange the run it joined (a hand-made spec)."""
        if self.codec.startswith("lowrank"):  # a two-phase exchange, not built in swarm.net
            raise ConfigError(
                f"[rounds] codec {self.codec} runs only in the simulator so far (python -m"
                " swarm.train.simulator.sim, scripts/bench_quality.py); a real swarm cannot exchange it"
                " yet: choose int4 or sign."
            )

    def all_gathered(self) -> bool:
        """Whether every codec's exchange is the all-gather (sparse codecs' always is)."""
        return self.exchange == "all_gather" or (self.exchange == "auto" and self.admits_strangers)

    def validate(self) -> None:
        if self.inner_steps < 1:
            raise ConfigError(f"[rounds] inner_steps must be at least 1, got {self.inner_steps}.")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise ConfigError(f"[rounds] max_rounds must be at least 1, got {self.max_rounds}.")
        if self.min_peers < 1:
            raise ConfigError(f"[rounds] min_peers must be at least 1, got {self.min_peers}.")
        self._validate_codec()
        if self.eval_every_rounds < 1:
            raise ConfigError("[rounds] eval_every_rounds must be at least 1.")
        for name in ("matchmaking_window_s", "exchange_timeout_s", "round_timeout_s", "report_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"[rounds] {name} must be positive, got {getattr(self, name)}.")
            check_range("rounds", name, getattr(self, name), 0, MAX_TIMEOUT_S)
        if not (math.isfinite(self.straggler_slack_s) and 0 <= self.straggler_slack_s <= MAX_TIMEOUT_S):
            raise ConfigError(
                f"[rounds] straggler_slack_s must be a number of seconds between 0 and {MAX_TIMEOUT_S:g},"
                f" got {self.straggler_slack_s}."
            )
        if not 1 <= self.fragments <= self.inner_steps:
            raise ConfigError(
                f"[rounds] fragments must be between 1 and inner_steps ({self.inner_steps}), got {self.fragments}."
            )
        if self.fragment_pattern not in FRAGMENT_PATTERNS:
            raise ConfigError(
                f"[rounds] fragment_pattern {self.fragment_pattern!r} is unknown; choose one of {list(FRAGMENT_PATTERNS)}."
            )
        gap = self.inner_steps // self.fragments
        if not 0 <= self.overlap_steps <= gap:
            raise ConfigError(
                f"[rounds] overlap_steps must be between 0 and inner_steps // fragments ({gap}),"
                f" got {self.overlap_steps}; an exchange must land before the next sync."
            )
        if not 0.0 < self.error_feedback_decay <= 1.0:
            raise ConfigError(
                f"[rounds] error_feedback_decay must be in (0, 1] (1: no decay), got {self.error_feedback_decay}."
            )
        if self.keep_unsent_locally and (
            self.overlap_steps > 0 or not self.error_feedback or self.error_feedback_decay != 1.0
        ):
            raise ConfigError(
                "[rounds] keep_unsent_locally needs θl to restart from θg when a fragment merges, with"
                " error feedback: overlap_steps = 0, error_feedback = true and error_feedback_decay = 1."
            )
        if not 0.0 <= self.mixing_alpha < 1.0:
            raise ConfigError(f"[rounds] mixing_alpha must be in [0, 1), got {self.mixing_alpha}.")
        check_range("rounds", "inner_steps", self.inner_steps, 1, MAX_STEPS)
        check_range("rounds", "min_peers", self.min_peers, 1, MAX_PEERS)
        check_range("rounds", "eval_every_rounds", self.eval_every_rounds, 1, MAX_ROUNDS)
        if self.max_rounds is not None:
            check_range("rounds", "max_rounds", self.max_rounds, 1, MAX_ROUNDS)
        self._validate_aggregation()
        self._validate_controller()
        self._validate_hierarchy()
        self._validate_exchange()

    def _validate_codec(self) -> None:
        """The codec exists and can run with the run's hierarchy and aggregation."""
        check_codec_name(self.codec)
        if self.hierarchical and self.codec.startswith("topk-"):
            raise ConfigError(
                f"[rounds] codec {self.codec} is exchanged by a flat all-gather; set hierarchical = false"
                " or choose a dense codec."
            )
        if self.codec.startswith("lowrank") and (self.hierarchical or self.aggregation_rule() != "mean"):
            raise ConfigError(
                f"[rounds] codec {self.codec} averages its factors linearly in one flat group; set"
                ' hierarchical = false and aggregation = "mean", or choose a dense codec.'
            )
        if self.hierarchical and (self.codec == "sign" or self.codec.startswith("ternary")):
            raise ConfigError(
                f"[rounds] codec {self.codec} needs its slice owners' error feedback, which only the flat butterfly"
                " keeps; set hierarchical = false or choose int4."
            )

    def _validate_exchange(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ConfigError(f"[rounds] exchange {self.exchange!r} is unknown; choose one of {list(EXCHANGES)}.")
        if self.exchange == "butterfly" and self.codec.startswith("topk-"):
            raise ConfigError(
                f'[rounds] codec {self.codec} is sparse and always all-gathered; set exchange = "auto"'
                " or choose a dense codec."
            )
        if not self.all_gathered():
            return
        why = (
            "admits_strangers = true makes the exchange an all-gather"
            if self.exchange == "auto"
            else 'exchange = "all_gather"'
        )
        if self.hierarchical:
            raise ConfigError(
                f"[rounds] {why}, which averages in one flat group; set hierarchical = false"
                ' (or exchange = "butterfly", which trusts each slice\'s owner).'
            )
        if self.codec.startswith("lowrank"):
            raise ConfigError(
                f"[rounds] {why}, which low-rank codecs do not support; choose a dense codec"
                ' (or exchange = "butterfly", which trusts each slice\'s owner).'
            )

    def _validate_controller(self) -> None:
        if self.controller not in CONTROLLERS:
            raise ConfigError(f"[rounds] controller {self.controller!r} is unknown; choose one of {list(CONTROLLERS)}.")
        dense = [c for c in CODEC_NAMES if not c.startswith("topk-")]
        unknown = [c for c in self.controller_codecs if c not in dense]
        if unknown or not self.controller_codecs:
            raise ConfigError(
                f"[rounds] controller_codecs must list codecs among {dense}, got {list(self.controller_codecs)}."
            )
        if self.controller != "off" and self.codec.startswith(("topk-", "lowrank", "ternary@")):
            raise ConfigError(
                f"[rounds] codec {self.codec} is not one the controller chooses among; set"
                ' controller = "off" to send it every round.'
            )
        if not (math.isfinite(self.controller_exchange_fraction) and 0 < self.controller_exchange_fraction <= 1):
            raise ConfigError(
                f"[rounds] controller_exchange_fraction must be in (0, 1], got {self.controller_exchange_fraction}."
            )
        cap = self.controller_max_inner_steps
        if cap is not None:
            check_range("rounds", "controller_max_inner_steps", cap, self.inner_steps, MAX_STEPS)

    def _validate_hierarchy(self) -> None:
        if self.group_size and not self.hierarchical:
            raise ConfigError(
                "[rounds] group_size applies only to two-level averaging; set hierarchical = true or remove group_size."
            )
        if not 0 <= self.group_size <= MAX_PEERS:
            raise ConfigError(
                f"[rounds] group_size must be 0 (no cap) or a number of peers from 1 to {MAX_PEERS},"
                f" got {self.group_size}."
            )

    def aggregation_rule(self) -> str:
        """The rule ``aggregation`` names, "auto" resolved: one of AGGREGATIONS."""
        if self.aggregation != "auto":
            return self.aggregation
        return "mean" if self.codec.startswith("lowrank") else "clipped_mean"

    def _validate_aggregation(self) -> None:
        if self.aggregation not in ("auto", *AGGREGATIONS):
            raise ConfigError(
                f"[rounds] aggregation {self.aggregation!r} is unknown; choose one of {['auto', *AGGREGATIONS]}."
            )
        if not (math.isfinite(self.clip_factor) and self.clip_factor >= 1.0):
            raise ConfigError(f"[rounds] clip_factor must be a finite number of at least 1, got {self.clip_factor}.")
        if not 0.0 <= self.trim_fraction < 0.5:
            raise ConfigError(f"[rounds] trim_fraction must be in [0, 0.5), got {self.trim_fraction}.")
        if not (math.isfinite(self.reject_factor) and (self.reject_factor == 0 or self.reject_factor >= 1.0)):
            raise ConfigError(
                f"[rounds] reject_factor must be 0 (off) or a finite number of at least 1, got {self.reject_factor}."
            )
