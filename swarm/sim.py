"""N virtual DiLoCo peers in one process, calling exactly the functions a real peer calls.

    python -m swarm.sim --peers 2 --rounds 3 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from swarm import algorithm
from swarm.codec import get_codec
from swarm.config import RunConfig, load_run_config
from swarm.trainer import LocalTrainer

log = logging.getLogger(__name__)


@dataclass
class SimRound:
    round: int  # the committed round number (1-based; round 0 is the initial state)
    state_hash: str  # peer 0's hash of (θg, momentum)
    peer_hashes: list[str]
    train_loss: float  # peers' mean inner loss, weighted by samples
    eval_loss: Optional[float]  # held-out loss of θg; None on rounds without evaluation
    samples: int
    tokens: int
    inner_time_s: float  # the slowest peer's inner time: the round's wall time if peers ran in parallel

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
    # Estimate of bytes each peer sends per round in a K-peer butterfly all-reduce of the encoded
    # pseudo-gradient: 2 (K-1)/K x payload (reduce-scatter, then all-gather); headers not counted.
    bytes_per_peer_per_round: float
    rounds: list[SimRound] = field(default_factory=list)
    final_params: list[torch.Tensor] = field(default_factory=list, repr=False)
    final_momentum: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def final_hash(self) -> str:
        return self.rounds[-1].state_hash if self.rounds else self.initial_hash

    @property
    def consistent(self) -> bool:
        return all(r.consistent for r in self.rounds)

    def to_dict(self) -> dict:
        """JSON-ready summary (no tensors)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in
               ("rounds", "final_params", "final_momentum")}
        out["final_hash"] = self.final_hash
        out["consistent"] = self.consistent
        out["rounds"] = [dataclasses.asdict(r) | {"consistent": r.consistent} for r in self.rounds]
        return out


def simulate(
    run: RunConfig,
    *,
    peers: int,
    rounds: int,
    steps_per_peer: Sequence[int] | None = None,
    codec: str | None = None,
) -> SimResult:
    """Run ``rounds`` DiLoCo rounds with ``peers`` virtual peers; ``codec`` defaults to the run's."""
    if peers < 1 or rounds < 0:
        raise ValueError(f"need at least one peer and a non-negative number of rounds, got {peers} and {rounds}.")
    if steps_per_peer is None:
        steps_per_peer = [run.rounds.inner_steps] * peers
    if len(steps_per_peer) != peers or any(s < 1 for s in steps_per_peer):
        raise ValueError(f"steps_per_peer must give every one of the {peers} peers at least one step.")
    wire = get_codec(codec or run.rounds.codec)

    trainers = [LocalTrainer(run, peer_index=i) for i in range(peers)]
    numel = trainers[0].param_count
    payload = wire.encoded_size(numel)
    result = SimResult(
        peers=peers,
        codec=wire.name,
        param_count=numel,
        initial_hash=trainers[0].state_hash(),
        initial_eval_loss=trainers[0].eval_loss(),
        bytes_per_peer_per_round=2 * (peers - 1) / peers * payload,
    )
    log.info("sim: %d peers, %d parameters, codec %s, initial eval loss %.4f",
             peers, numel, wire.name, result.initial_eval_loss)

    for r in range(1, rounds + 1):
        stats = [t.train(steps) for t, steps in zip(trainers, steps_per_peer)]
        # Each contribution goes over the wire encoded; the reducer sees the decoded values.
        deltas = [wire.decode(wire.encode(t.pseudo_gradient()), numel) for t in trainers]
        avg = algorithm.weighted_average(deltas, [float(s.samples) for s in stats])
        # The reduced part is sent encoded once more and every peer decodes those same bytes.
        avg = wire.decode(wire.encode(avg), numel)
        for t in trainers:
            params, momentum = t.apply(avg)
            t.commit(params, momentum, round=r)

        hashes = [t.state_hash() for t in trainers]
        if len(set(hashes)) != 1:
            log.error("sim round %d: peers disagree on the global state: %s", r, hashes)
        samples = sum(s.samples for s in stats)
        evaluate = r % run.rounds.eval_every_rounds == 0 or r == rounds
        result.rounds.append(SimRound(
            round=r,
            state_hash=hashes[0],
            peer_hashes=hashes,
            train_loss=sum(s.mean_loss * s.samples for s in stats) / samples,
            eval_loss=trainers[0].eval_loss() if evaluate else None,
            samples=samples,
            tokens=sum(s.tokens for s in stats),
            inner_time_s=max(s.inner_time_s for s in stats),
        ))
        last = result.rounds[-1]
        log.info("sim round %d: train loss %.4f, eval loss %s, hash %s",
                 r, last.train_loss, "-" if last.eval_loss is None else f"{last.eval_loss:.4f}", last.state_hash)

    result.final_params = trainers[0].global_params
    result.final_momentum = trainers[0].momentum
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m swarm.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="run TOML file (default: the built-in defaults)")
    parser.add_argument("--peers", type=int, default=2, help="number of virtual peers")
    parser.add_argument("--rounds", type=int, default=3, help="number of outer rounds")
    parser.add_argument("--steps", type=int, help="inner steps per round (default: the run's inner_steps)")
    parser.add_argument("--preset", help="model preset, overriding the config")
    parser.add_argument("--codec", help="wire codec, overriding the config")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args(argv)

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
        result = simulate(run, peers=args.peers, rounds=args.rounds)
    except ValueError as e:  # ConfigError and the other user mistakes: one sentence, no traceback
        sys.stderr.write(f"error: {e}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(
            f"{result.peers} peers, {result.param_count} parameters, codec {result.codec}\n"
            f"round 0: eval loss {result.initial_eval_loss:.4f} hash {result.initial_hash}\n"
        )
        for r in result.rounds:
            ev = "-" if r.eval_loss is None else f"{r.eval_loss:.4f}"
            sys.stdout.write(f"round {r.round}: train loss {r.train_loss:.4f} eval loss {ev}"
                             f" hash {r.state_hash}{'' if r.consistent else ' INCONSISTENT'}\n")
    return 0 if result.consistent else 1


if __name__ == "__main__":
    sys.exit(main())
