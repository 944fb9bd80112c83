"""N virtual DiLoCo peers in one process, calling exactly the functions a real peer calls (the trainer,
the outer optimizer, and ``average.butterfly_reference`` for the all-reduce), so given the same run
it computes the same global parameters as a real swarm, bit for bit.

    python -m swarm.train.simulator.sim --peers 2 --rounds 3 --json
    python -m swarm.train.simulator.sim --peers 4 --rounds 12 --codec int4 --fragments 2 --overlap 2 --speeds 1,1,0.5,0.33
    python -m swarm.train.simulator.sim --peers 4 --rounds 3 --sites a,a,b,b --hierarchical --group-size 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Sequence

import torch

from swarm.config import RunConfig, load_run_config
from swarm.core.average import butterfly_bytes_sent
from swarm.core.codecs.codec import get_codec
from swarm.core.fragments import round_fragment
from swarm.core.state import GlobalState
from swarm.train.simulator.virtual_peers import OwnerTamper, Tamper, VirtualPeer, run_peers
from swarm.train.trainer import LocalTrainer

log = logging.getLogger(__name__)


@dataclass
class SimRound:
    round: int  # the committed round number (1-based; round 0 is the initial state)
    state_hash: str  # peer 0's hash of (θg, outer state)
    peer_hashes: list[str]
    train_loss: float  # peers' mean inner loss, weighted by samples
    eval_loss: Optional[float]  # held-out loss of θg; None on rounds without evaluation
    samples: int
    tokens: int
    inner_time_s: float  # the slowest peer's inner time: the round's wall time if peers ran in parallel
    fragment: int = 0  # the fragment this round synced
    steps: list[int] = field(default_factory=list)  # inner steps each peer ran in the round
    group: list[int] = field(default_factory=list)  # peers in the exchange (those with samples to send)
    bytes_sent: list[int] = field(default_factory=list)  # payload bytes each peer sent in the exchange
    cross_site_bytes: list[int] = field(default_factory=list)  # of which to peers at another site (or none)

    @property
    def consistent(self) -> bool:
        return len(set(self.peer_hashes)) == 1


@dataclass
class SimResult:
    peers: int
    codec: str
    param_count: int
    initial_hash: str
    initial_eval_loss: float
    # Payload bytes a peer sends per round in the butterfly all-reduce (its encoded slices for the
    # other owners, then its averaged slice to each of them), averaged over peers and rounds; before
    # any round, what a full group would send. Message headers are not counted.
    bytes_per_peer_per_round: float
    fragments: int = 1
    overlap_steps: int = 0
    error_feedback: bool = False  # in effect: on in the config and the codec is lossy
    outer: str = "nesterov"
    bytes_sent_per_peer: list[int] = field(default_factory=list)  # each peer's total over the run
    peak_bytes_per_sync: int = 0  # the most one peer sent in one exchange
    rounds: list[SimRound] = field(default_factory=list)
    final_params: list[torch.Tensor] = field(default_factory=list, repr=False)
    final_outer_state: list[torch.Tensor] = field(default_factory=list, repr=False)  # the outer state

    @property
    def final_hash(self) -> str:
        return self.rounds[-1].state_hash if self.rounds else self.initial_hash

    @property
    def consistent(self) -> bool:
        return all(r.consistent for r in self.rounds)

    @property
    def final_eval_loss(self) -> float:
        evaluated = [r.eval_loss for r in self.rounds if r.eval_loss is not None]
        return evaluated[-1] if evaluated else self.initial_eval_loss

    def to_dict(self) -> dict:
        """JSON-ready summary (no tensors)."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("rounds", "final_params", "final_outer_state")
        }
        out["final_hash"] = self.final_hash
        out["consistent"] = self.consistent
        out["rounds"] = [dataclasses.asdict(r) | {"consistent": r.consistent} for r in self.rounds]
        return out


def _rates(
    run: RunConfig, peers: int, steps_per_peer: Sequence[int] | None, speeds: Sequence[float] | None
) -> list[Fraction]:
    """Inner steps per nominal step for each peer (exact fractions, so step counts never drift)."""
    h = run.rounds.inner_steps
    if steps_per_peer is not None and speeds is not None:
        raise ValueError("give steps_per_peer or speeds, not both.")
    if speeds is not None:
        if len(speeds) != peers or any(not (math.isfinite(s) and s * h >= 1) for s in speeds):
            raise ValueError(
                f"speeds must give every one of the {peers} peers a finite speed of at least"
                f" 1/inner_steps = {1 / h:.4g}."
            )
        return [Fraction(s).limit_denominator(1_000_000) for s in speeds]
    if steps_per_peer is None:
        steps_per_peer = [h] * peers
    if len(steps_per_peer) != peers or any(s < 1 for s in steps_per_peer):
        raise ValueError(f"steps_per_peer must give every one of the {peers} peers at least one step.")
    return [Fraction(int(s), h) for s in steps_per_peer]


def _sites(sites: Sequence[str] | None, peers: int) -> list[str] | None:
    if sites is not None and (len(sites) != peers or not all(isinstance(s, str) for s in sites)):
        raise ValueError(f'sites must name one site (or "") for each of the {peers} peers, got {list(sites)!r}.')
    return None if sites is None else list(sites)


def _with_overrides(run: RunConfig, outer: str | None, **rounds) -> RunConfig:
    overrides = {k: v for k, v in rounds.items() if v is not None}
    if overrides:
        run = run.replace(rounds=dataclasses.replace(run.rounds, **overrides))
    if outer is not None:
        run = run.replace(outer=dataclasses.replace(run.outer, name=outer))
    if overrides or outer is not None:
        get_codec(run.rounds.codec)  # an unknown codec: its own message, not the config's
        run.validate()
    return run


def _records(peers: list[VirtualPeer], run: RunConfig, rounds: int) -> list[SimRound]:
    out = []
    for r in range(1, rounds + 1):
        per_peer = [p.trained_stats[r] for p in peers]
        samples = sum(s.samples for s in per_peer)
        hashes = [p.hashes[r] for p in peers]
        if len(set(hashes)) != 1:
            log.error("sim round %d: peers disagree on the global state: %s", r, hashes)
        out.append(
            SimRound(
                round=r,
                state_hash=hashes[0],
                peer_hashes=hashes,
                train_loss=sum(s.mean_loss * s.samples for s in per_peer if s.samples) / samples
                if samples
                else float("nan"),
                eval_loss=peers[0].evals.get(r),
                samples=samples,
                tokens=sum(s.tokens for s in per_peer),
                inner_time_s=max(s.inner_time_s for s in per_peer),
                fragment=round_fragment(r, run.rounds.fragments),
                steps=[s.steps for s in per_peer],
                group=list(range(len(peers))),
                bytes_sent=[p.bytes_sent[r] for p in peers],
                cross_site_bytes=[p.board.cross_site_bytes[r][p.index] for p in peers],
            )
        )
        last = out[-1]
        log.info(
            "sim round %d (fragment %d): train loss %.4f, eval loss %s, hash %s",
            last.round,
            last.fragment,
            last.train_loss,
            "-" if last.eval_loss is None else f"{last.eval_loss:.4f}",
            last.state_hash,
        )
    return out


def _trainers(run: RunConfig, peers: int, initial_params: Sequence[torch.Tensor] | None) -> list[LocalTrainer]:
    """One trainer per virtual peer; ``initial_params`` (a warm start) replace θ0 on each, with zero outer state."""
    trainers = [LocalTrainer(run, peer_index=i) for i in range(peers)]
    if initial_params is not None:
        for t in trainers:
            t.commit(GlobalState(0, [p.detach().clone() for p in initial_params], t.state.outer_state))
    return trainers


def _tally_bytes(result: SimResult) -> None:
    """The run's bytes from its rounds: per peer, the largest sync, and the mean per peer and round."""
    for r in result.rounds:
        result.bytes_sent_per_peer = [a + b for a, b in zip(result.bytes_sent_per_peer, r.bytes_sent)]
        result.peak_bytes_per_sync = max(result.peak_bytes_per_sync, max(r.bytes_sent))
    if result.rounds:
        result.bytes_per_peer_per_round = sum(result.bytes_sent_per_peer) / (result.peers * len(result.rounds))


def simulate(
    run: RunConfig,
    *,
    peers: int,
    rounds: int,
    steps_per_peer: Sequence[int] | None = None,
    speeds: Sequence[float] | None = None,
    codec: str | None = None,
    error_feedback: bool | None = None,
    fragments: int | None = None,
    overlap_steps: int | None = None,
    mixing_alpha: float | None = None,
    outer: str | None = None,
    initial_params: Sequence[torch.Tensor] | None = None,
    aggregation: str | None = None,
    tamper: Tamper | None = None,
    owner_tamper: OwnerTamper | None = None,
    sites: Sequence[str] | None = None,
    hierarchical: bool | None = None,
    group_size: int | None = None,
) -> SimResult:
    """Run ``rounds`` DiLoCo rounds with ``peers`` virtual peers, through the same round runner as a
    real peer, so it computes what a real swarm computes.

    Every keyword left None takes the run's value. ``steps_per_peer[i]`` is peer i's inner steps per
    ``inner_steps`` nominal steps (per round in plain DiLoCo); ``speeds[i]`` is the same as a factor
    (1/3: a third of the steps). Rounds are time budgets: a slow peer does fewer steps and its
    pseudo-gradient weighs its samples. ``initial_params`` (in the model's parameter order) replace the
    seed's θ0 on every peer, with zero outer state: a warm start. ``aggregation`` overrides the run's
    rule; ``tamper`` (benchmarks and tests only) replaces what peers send: Byzantine peers (``owner_tamper``: what
    malicious butterfly slice owners send; a run whose exchange is the all-gather has none). ``sites[i]`` is
    peer i's site ("": none), as its credential would carry it: with ``[rounds] hierarchical`` the peers
    average in two levels by site (``swarm.core.site_plan``), and each round records its cross-site bytes.
    """
    if peers < 1 or rounds < 0:
        raise ValueError(f"need at least one peer and a non-negative number of rounds, got {peers} and {rounds}.")
    run = _with_overrides(
        run,
        outer,
        codec=codec,
        error_feedback=error_feedback,
        fragments=fragments,
        overlap_steps=overlap_steps,
        mixing_alpha=mixing_alpha,
        aggregation=aggregation,
        hierarchical=hierarchical,
        group_size=group_size,
    )
    rates = _rates(run, peers, steps_per_peer, speeds)
    trainers = _trainers(run, peers, initial_params)
    result = _started(run, trainers)
    virtual = run_peers(run, trainers, rates, rounds, tamper, sites=_sites(sites, peers), owner_tamper=owner_tamper)
    result.rounds = _records(virtual, run, rounds)
    _tally_bytes(result)
    result.final_params = trainers[0].global_params
    result.final_outer_state = trainers[0].state.outer_state
    return result


def _started(run: RunConfig, trainers: list) -> SimResult:
    """The result of a run about to start: its settings, θ0's hash and eval loss, a full group's bytes a round."""
    rc, peers = run.rounds, len(trainers)
    wire = get_codec(rc.codec)
    fragment_numel = [trainers[0].fragment_numel(f) for f in range(rc.fragments)]
    full_group = [sum(butterfly_bytes_sent(n, peers, wire)) / peers for n in fragment_numel]
    result = SimResult(
        peers=peers,
        codec=wire.name,
        param_count=trainers[0].param_count,
        initial_hash=trainers[0].state.state_hash,
        initial_eval_loss=trainers[0].eval_loss(),
        bytes_per_peer_per_round=sum(full_group) / rc.fragments,
        fragments=rc.fragments,
        overlap_steps=rc.overlap_steps,
        error_feedback=rc.error_feedback and not wire.lossless,
        outer=run.outer.name,
        bytes_sent_per_peer=[0] * peers,
    )
    log.info(
        "sim: %d peers, %d parameters, codec %s, %d fragments, overlap %d, initial eval loss %.4f",
        peers,
        result.param_count,
        wire.name,
        rc.fragments,
        rc.overlap_steps,
        result.initial_eval_loss,
    )
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m swarm.train.simulator.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="run TOML file (default: the built-in defaults)")
    parser.add_argument("--peers", type=int, default=2, help="number of virtual peers")
    parser.add_argument("--rounds", type=int, default=3, help="number of outer rounds")
    parser.add_argument("--steps", type=int, help="inner steps per round (default: the run's inner_steps)")
    parser.add_argument("--preset", help="model preset, overriding the config")
    parser.add_argument(
        "--codec",
        help="wire codec (fp32, fp16, bf16, int8, int4, sign, ternary, ternary@0.5, topk-int4, topk-int4@0.003, lowrank16-int4, ...), overriding the config",
    )
    parser.add_argument("--no-error-feedback", action="store_true", help="send lossy codecs without error feedback")
    parser.add_argument("--fragments", type=int, help="Streaming DiLoCo fragments F, overriding the config")
    parser.add_argument("--overlap", type=int, help="inner steps an exchange overlaps (tau), overriding the config")
    parser.add_argument("--alpha", type=float, help="mixing factor for overlapped merges, overriding the config")
    parser.add_argument("--aggregation", help="how slices are combined: mean, clipped_mean or trimmed_mean")
    parser.add_argument("--outer", help="outer optimizer: nesterov or a torch.optim class name")
    parser.add_argument("--speeds", help="comma-separated speed factor per peer, e.g. 1,1,0.5")
    parser.add_argument("--sites", help="comma-separated site per peer, e.g. a,a,b,b (default: none)")
    parser.add_argument("--hierarchical", action="store_true", help="average in two levels by site")
    parser.add_argument("--group-size", type=int, help="with --hierarchical: at most this many peers per sub-group")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


def _print_summary(result: SimResult) -> None:
    sys.stdout.write(
        f"{result.peers} peers, {result.param_count} parameters, codec {result.codec}"
        f"{' + error feedback' if result.error_feedback else ''}, {result.fragments} fragments,"
        f" overlap {result.overlap_steps}, outer {result.outer}\n"
        f"round 0: eval loss {result.initial_eval_loss:.4f} hash {result.initial_hash}\n"
    )
    for r in result.rounds:
        ev = "-" if r.eval_loss is None else f"{r.eval_loss:.4f}"
        sys.stdout.write(
            f"round {r.round}: train loss {r.train_loss:.4f} eval loss {ev}"
            f" hash {r.state_hash}{'' if r.consistent else ' INCONSISTENT'}\n"
        )
    cross = [sum(r.cross_site_bytes[i] for r in result.rounds) for i in range(result.peers)]
    sys.stdout.write(
        f"bytes sent per peer {result.bytes_sent_per_peer} (to other sites {cross}),"
        f" peak per sync {result.peak_bytes_per_sync}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run = load_run_config(args.config) if args.config else RunConfig()
        if args.preset:
            run = run.replace(model=dataclasses.replace(run.model, preset=args.preset))
        if args.steps:
            run = run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=args.steps))
        if args.codec:
            run = run.replace(rounds=dataclasses.replace(run.rounds, codec=args.codec))
        run.validate()
        speeds = [float(x) for x in args.speeds.split(",")] if args.speeds else None
        result = simulate(
            run,
            peers=args.peers,
            rounds=args.rounds,
            speeds=speeds,
            error_feedback=False if args.no_error_feedback else None,
            fragments=args.fragments,
            overlap_steps=args.overlap,
            mixing_alpha=args.alpha,
            outer=args.outer,
            aggregation=args.aggregation,
            sites=args.sites.split(",") if args.sites else None,
            hierarchical=True if args.hierarchical else None,
            group_size=args.group_size,
        )
    except ValueError as e:  # ConfigError and the other user mistakes: one sentence, no traceback
        sys.stderr.write(f"error: {e}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        _print_summary(result)
    return 0 if result.consistent else 1


if __name__ == "__main__":
    sys.exit(main())
