"""Held-out loss under Byzantine peers: 4 and 8 simulated workers, 1 and 2 of them attackers, each attack
against each aggregation rule (``[rounds] aggregation``), next to the honest run, on CPU.

    .venv/bin/python scripts/bench_byzantine.py --json       # the full grid (~10-15 min on 2 cores)
    .venv/bin/python scripts/bench_byzantine.py --quick      # a smoke run (~1-2 min)

Rows run in the simulator (swarm.train.sim), which calls the peer daemon's functions; an attacker is a
virtual peer whose contribution is replaced before the exchange (its own training stays honest). The
attacks:

- sign_flip: sends -100 x its pseudo-gradient;
- noise: sends Gaussian noise 10 x as long as its pseudo-gradient;
- constant: sends one fixed direction (the same every round, for every attacker), 10 x as long;
- inflated_weight: declares 10^30 samples and sends -1 x its pseudo-gradient (a norm check cannot see
  it; the weight cap can).

The last stdout line (with --json) is a JSON list of rows: workers, attackers, attack, aggregation,
eval_loss (None: the run diverged to non-finite values), honest_eval_loss (the same workers, no
attacker, the mean rule).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import math
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from swarm.config import AGGREGATIONS, DataConfig, InnerOptConfig, ModelConfig, RoundConfig, RunConfig
from swarm.train.sim import simulate
from swarm.train.trainer import Contribution

log = logging.getLogger("bench_byzantine")

ATTACKS = ("sign_flip", "noise", "constant", "inflated_weight")
ROW_KEYS = ("workers", "attackers", "attack", "aggregation", "eval_loss", "honest_eval_loss")


@dataclass(frozen=True, kw_only=True)
class Grid:
    workers: tuple[int, ...] = (4, 8)
    attackers: tuple[int, ...] = (1, 2)
    inner_steps: int = 10  # H
    rounds: int = 12
    eval_batches: int = 8


QUICK = Grid(workers=(4,), attackers=(1,), inner_steps=5, rounds=4, eval_batches=2)


@dataclass(frozen=True)
class Job:
    workers: int
    attackers: int  # the last `attackers` workers attack
    attack: str  # one of ATTACKS, or "none"
    aggregation: str


def run_config(grid: Grid, workers: int, aggregation: str, seed: int) -> RunConfig:
    return RunConfig(
        seed=seed,
        model=ModelConfig(preset="bench"),
        data=DataConfig(max_bytes=2_000_000, num_shards=max(8, workers), batch_size=8, seq_len=64,
                        eval_batches=grid.eval_batches),
        inner=InnerOptConfig(warmup_steps=5),
        # One evaluation, at the end: simulate() evaluates the last round.
        rounds=RoundConfig(inner_steps=grid.inner_steps, eval_every_rounds=10**9, aggregation=aggregation),
    ).validate()


class Attacker:
    """The tamper hook of the simulator: what workers ``first..`` send instead of their contribution."""

    def __init__(self, attack: str, first: int, seed: int) -> None:
        self.attack, self.first, self.seed = attack, first, seed

    def __call__(self, index: int, round_no: int, contribution: Contribution) -> Contribution:
        if index < self.first:
            return contribution
        delta, length = contribution.delta, float(contribution.delta.norm())
        if self.attack == "sign_flip":
            return dataclasses.replace(contribution, delta=-100.0 * delta)
        if self.attack == "inflated_weight":
            return dataclasses.replace(contribution, delta=-delta, samples=10**30)
        if self.attack == "noise":
            direction = torch.randn(delta.numel(), generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + round_no * 101 + index))
        elif self.attack == "constant":
            direction = torch.randn(delta.numel(), generator=torch.Generator().manual_seed(self.seed + 7))
        else:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}.")
        return dataclasses.replace(contribution, delta=direction * (10.0 * length / float(direction.norm())))


def run_job(grid: Grid, job: Job, seed: int) -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    run = run_config(grid, job.workers, job.aggregation, seed)
    tamper = None if job.attackers == 0 else Attacker(job.attack, job.workers - job.attackers, seed)
    row = {"workers": job.workers, "attackers": job.attackers, "attack": job.attack, "aggregation": job.aggregation}
    try:
        result = simulate(run, peers=job.workers, rounds=grid.rounds, tamper=tamper)
        loss = result.final_eval_loss
        row["eval_loss"] = loss if math.isfinite(loss) else None
        row["note"] = "" if result.consistent else "peers disagree"
    except (ValueError, RuntimeError) as e:  # the average went non-finite: the codec refuses to send it
        row["eval_loss"], row["note"] = None, f"diverged: {e}"
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def plan(grid: Grid) -> list[Job]:
    jobs = []
    for workers in grid.workers:
        jobs += [Job(workers, 0, "none", rule) for rule in AGGREGATIONS]
        jobs += [Job(workers, a, attack, rule) for a in grid.attackers for attack in ATTACKS for rule in AGGREGATIONS]
    return jobs


def run_all(grid: Grid, jobs: list[Job], seed: int, parallel: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # each row in a fresh process: no shared torch state
    with concurrent.futures.ProcessPoolExecutor(max_workers=parallel, mp_context=context) as pool:
        futures = [pool.submit(run_job, grid, job, seed) for job in jobs]
        rows = []
        for job, future in zip(jobs, futures):
            row = future.result()
            log.warning("%d workers, %d x %s, %s: eval loss %s (%.0f s)", job.workers, job.attackers, job.attack,
                        job.aggregation, "-" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}", row["wall_s"])
            rows.append(row)
    honest = {r["workers"]: r["eval_loss"] for r in rows if r["attackers"] == 0 and r["aggregation"] == "mean"}
    for row in rows:
        row["honest_eval_loss"] = honest.get(row["workers"])
    return rows


def _gap(loss: Optional[float], ref: Optional[float]) -> Optional[float]:
    return None if loss is None or ref is None else (loss - ref) / ref


def targets(rows: list[dict]) -> list[tuple[str, Optional[bool], str]]:
    """(target, met (None: not measured), measured) for the brief's two goals."""
    out: list[tuple[str, Optional[bool], str]] = []
    attacked = [r for r in rows if r["workers"] == 4 and r["attackers"] == 1 and r["aggregation"] == "clipped_mean"]
    for r in attacked:
        gap = _gap(r["eval_loss"], r["honest_eval_loss"])
        out.append((f"clipped_mean, 1 of 4 {r['attack']}: within 5% of honest", None if gap is None else gap <= 0.05,
                    "diverged" if gap is None else f"{gap:+.2%}"))
    for workers in sorted({r["workers"] for r in rows}):
        clipped = next((r for r in rows if r["workers"] == workers and r["attackers"] == 0
                        and r["aggregation"] == "clipped_mean"), None)
        gap = _gap(clipped["eval_loss"], clipped["honest_eval_loss"]) if clipped else None
        out.append((f"honest {workers} workers: clipped_mean within 0.5% of mean", None if gap is None else abs(gap) <= 0.005,
                    "-" if gap is None else f"{gap:+.2%}"))
    return out


def print_table(rows: list[dict], goals: list[tuple[str, Optional[bool], str]], out) -> None:
    out.write(f"{'workers':>7} {'attackers':>9} {'attack':<16} {'aggregation':<13} {'eval loss':>9} {'vs honest':>9}\n")
    for r in rows:
        gap = _gap(r["eval_loss"], r["honest_eval_loss"])
        out.write(f"{r['workers']:>7} {r['attackers']:>9} {r['attack']:<16} {r['aggregation']:<13} "
                  f"{'-' if r['eval_loss'] is None else format(r['eval_loss'], '.4f'):>9} "
                  f"{'-' if gap is None else format(gap, '+.2%'):>9}\n")
    for name, met, measured in goals:
        out.write(f"{ {True: 'yes', False: 'NO', None: 'n/a'}[met]:>3}  {name}: {measured}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 workers, 1 attacker, few steps: a smoke run")
    parser.add_argument("--jobs", type=int, default=2, help="rows run at once, one process each (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="run seed: initial weights, data order, attack noise")
    parser.add_argument("--json", action="store_true", help="last stdout line: the rows as JSON")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1.")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    grid = QUICK if args.quick else Grid()
    started = time.perf_counter()
    rows = run_all(grid, plan(grid), args.seed, args.jobs)
    print_table(rows, targets(rows), sys.stderr if args.json else sys.stdout)
    log.warning("total %.0f s (H=%d, %d rounds per run)", time.perf_counter() - started, grid.inner_steps, grid.rounds)
    if args.json:
        sys.stdout.write(json.dumps([{k: r.get(k) for k in (*ROW_KEYS, "note")} for r in rows]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
