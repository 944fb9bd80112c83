"""Held-out loss under Byzantine peers: 4 and 8 simulated workers, 1 and 2 of them attackers, each attack
against each aggregation rule (``[rounds] aggregation``), next to the honest run, on CPU; and a malicious
slice owner (1 of 4, 2 of 8) against the butterfly and against the all-gather of a run that admits strangers.

    .venv/bin/python scripts/bench_byzantine.py --json       # the full grid (~15-20 min on 2 cores)
    .venv/bin/python scripts/bench_byzantine.py --quick      # a smoke run (~1-2 min)
    .venv/bin/python scripts/bench_byzantine.py --slice-owner --json   # only the slice owner's rows
    .venv/bin/python scripts/bench_byzantine.py --bytes      # the all-gather's bytes per round, no training

Rows run in the simulator (swarm.train.simulator.sim), which calls the peer daemon's functions; an attacker is a
virtual peer whose contribution is replaced before the exchange (its own training stays honest). The
attacks:

- sign_flip: sends -100 x its pseudo-gradient;
- noise: sends Gaussian noise 10 x as long as its pseudo-gradient;
- constant: sends one fixed direction (the same every round, for every attacker), 10 x as long;
- inflated_weight: declares 10^30 samples and sends -1 x its pseudo-gradient (a norm check cannot see
  it; the weight cap can);
- slice_owner: contributes honestly, but as the owner of a butterfly slice sends -100 x that slice's
  average instead of it (no aggregation rule sees an owner's output); under the all-gather
  (``[rounds] admits_strangers = true``) no member owns a slice, so it has nothing to send.

The last stdout line (with --json) is a JSON list of rows: workers, attackers, attack, aggregation,
exchange ("auto": the butterfly), eval_loss (None: the run diverged to non-finite values), honest_eval_loss
(the same workers, no attacker, the mean rule), max_shift (the slice owner's rows: the largest change of any
coordinate of θg against the honest run with the same exchange and rule).
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
from swarm.core.all_gather import gather_bytes_by_site
from swarm.core.average import butterfly_bytes_sent
from swarm.core.codecs.codec import get_codec
from swarm.train.contribution import Contribution
from swarm.train.simulator.sim import simulate

log = logging.getLogger("bench_byzantine")

ATTACKS = ("sign_flip", "noise", "constant", "inflated_weight")
ROW_KEYS = ("workers", "attackers", "attack", "aggregation", "exchange", "eval_loss", "honest_eval_loss", "max_shift")
# The malicious slice owner's rows: (workers, attackers), under the run's robust rule, with either exchange.
SLICE_OWNER_GROUPS = ((4, 1), (8, 2))
SLICE_OWNER_RULE = "clipped_mean"
EXCHANGES = ("butterfly", "all_gather")


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
    attack: str  # one of ATTACKS, "slice_owner", or "none"
    aggregation: str
    exchange: str = "auto"  # [rounds] exchange: "auto" (the butterfly here), "butterfly" or "all_gather"


def run_config(grid: Grid, workers: int, aggregation: str, seed: int, exchange: str = "auto") -> RunConfig:
    return RunConfig(
        seed=seed,
        model=ModelConfig(preset="bench"),
        data=DataConfig(
            max_bytes=2_000_000, num_shards=max(8, workers), batch_size=8, seq_len=64, eval_batches=grid.eval_batches
        ),
        inner=InnerOptConfig(warmup_steps=5),
        # One evaluation, at the end: simulate() evaluates the last round.
        rounds=RoundConfig(
            inner_steps=grid.inner_steps, eval_every_rounds=10**9, aggregation=aggregation, exchange=exchange
        ),
    ).validate()


class Attacker:
    """The tamper hook of the simulator: what workers ``first..`` send instead of their contribution."""

    def __init__(self, attack: str, first: int, seed: int) -> None:
        self.attack, self.first, self.seed = attack, first, seed

    def owned(self, owner: int, round_no: int, average: torch.Tensor) -> Optional[torch.Tensor]:
        """The simulator's owner_tamper: what a malicious owner sends instead of its butterfly slice's average."""
        return -100.0 * average if self.attack == "slice_owner" and owner >= self.first else None

    def __call__(self, index: int, round_no: int, contribution: Contribution) -> Contribution:
        if index < self.first or self.attack == "slice_owner":
            return contribution
        delta, length = contribution.delta, float(contribution.delta.norm())
        if self.attack == "sign_flip":
            return dataclasses.replace(contribution, delta=-100.0 * delta)
        if self.attack == "inflated_weight":
            return dataclasses.replace(contribution, delta=-delta, samples=10**30)
        if self.attack == "noise":
            direction = torch.randn(
                delta.numel(), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + round_no * 101 + index)
            )
        elif self.attack == "constant":
            direction = torch.randn(delta.numel(), generator=torch.Generator().manual_seed(self.seed + 7))
        else:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {ATTACKS}.")
        return dataclasses.replace(contribution, delta=direction * (10.0 * length / float(direction.norm())))


def run_job(grid: Grid, job: Job, seed: int) -> dict:
    torch.set_num_threads(1)
    started = time.perf_counter()
    run = run_config(grid, job.workers, job.aggregation, seed, job.exchange)
    tamper = None if job.attackers == 0 else Attacker(job.attack, job.workers - job.attackers, seed)
    row = {
        "workers": job.workers,
        "attackers": job.attackers,
        "attack": job.attack,
        "aggregation": job.aggregation,
        "exchange": job.exchange,
    }
    try:
        result = simulate(
            run,
            peers=job.workers,
            rounds=grid.rounds,
            tamper=tamper,
            owner_tamper=tamper.owned if tamper is not None else None,
        )
        loss = result.final_eval_loss
        row["eval_loss"] = loss if math.isfinite(loss) else None
        row["note"] = "" if result.consistent else "peers disagree"
        if job.exchange != "auto":  # the slice owner's rows: θg, to measure how far the attack moved it
            row["params"] = torch.cat([p.detach().reshape(-1) for p in result.final_params])
    except (ValueError, RuntimeError) as e:  # the average went non-finite: the codec refuses to send it
        row["eval_loss"], row["note"] = None, f"diverged: {e}"
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def plan(grid: Grid, *, slice_owner_only: bool = False) -> list[Job]:
    jobs = []
    for workers in () if slice_owner_only else grid.workers:
        jobs += [Job(workers, 0, "none", rule) for rule in AGGREGATIONS]
        jobs += [Job(workers, a, attack, rule) for a in grid.attackers for attack in ATTACKS for rule in AGGREGATIONS]
    return jobs + slice_owner_plan(grid)


def slice_owner_plan(grid: Grid) -> list[Job]:
    """Each exchange honest and with malicious slice owners, and the all-gather with the owners sending -100 x
    their Δ instead (what is left to them there: a contribution the rule judges)."""
    jobs = []
    for workers, attackers in SLICE_OWNER_GROUPS:
        if workers not in grid.workers or attackers not in grid.attackers:
            continue
        jobs += [Job(workers, 0, "none", SLICE_OWNER_RULE, exchange) for exchange in EXCHANGES]
        jobs += [Job(workers, attackers, "slice_owner", SLICE_OWNER_RULE, exchange) for exchange in EXCHANGES]
        jobs.append(Job(workers, attackers, "sign_flip", SLICE_OWNER_RULE, "all_gather"))
    return jobs


def run_all(grid: Grid, jobs: list[Job], seed: int, parallel: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # each row in a fresh process: no shared torch state
    with concurrent.futures.ProcessPoolExecutor(max_workers=parallel, mp_context=context) as pool:
        futures = [pool.submit(run_job, grid, job, seed) for job in jobs]
        rows = []
        for job, future in zip(jobs, futures):
            row = future.result()
            log.warning(
                "%d workers, %d x %s, %s, exchange %s: eval loss %s (%.0f s)",
                job.workers,
                job.attackers,
                job.attack,
                job.aggregation,
                job.exchange,
                "-" if row["eval_loss"] is None else f"{row['eval_loss']:.4f}",
                row["wall_s"],
            )
            rows.append(row)
    honest = {r["workers"]: r["eval_loss"] for r in rows if r["attackers"] == 0 and r["aggregation"] == "mean"}
    same = {(r["workers"], r["exchange"]): r.get("params") for r in rows if r["attackers"] == 0 and "params" in r}
    honest_same = {(r["workers"], r["exchange"]): r["eval_loss"] for r in rows if r["attackers"] == 0}
    for row in rows:
        row["honest_eval_loss"] = (
            honest.get(row["workers"])
            if row["exchange"] == "auto"
            else honest_same.get((row["workers"], row["exchange"]))
        )
        reference = same.get((row["workers"], row["exchange"]))
        if row.get("params") is not None and reference is not None:
            row["max_shift"] = float((row["params"] - reference).abs().max())
    return rows


def _gap(loss: Optional[float], ref: Optional[float]) -> Optional[float]:
    return None if loss is None or ref is None else (loss - ref) / ref


def targets(rows: list[dict]) -> list[tuple[str, Optional[bool], str]]:
    """(target, met (None: not measured), measured) for the brief's goals."""
    out: list[tuple[str, Optional[bool], str]] = []
    for r in rows:
        if r["attack"] == "slice_owner" and r["exchange"] == "all_gather":
            shift = r.get("max_shift")
            out.append(
                (
                    f"slice_owner, {r['attackers']} of {r['workers']}, all_gather: θg the honest run's",
                    None if shift is None else shift == 0.0,
                    "-" if shift is None else f"max shift {shift:.3g}",
                )
            )
    for workers in sorted({r["workers"] for r in rows if r["exchange"] == "all_gather"}):
        loss = {
            r["exchange"]: r["eval_loss"]
            for r in rows
            if r["workers"] == workers and r["attackers"] == 0 and r["exchange"] != "auto"
        }
        gap = _gap(loss.get("all_gather"), loss.get("butterfly"))
        out.append(
            (
                f"honest {workers} workers: all_gather within 0.5% of butterfly ({SLICE_OWNER_RULE})",
                None if gap is None else gap <= 0.005,
                "-" if gap is None else f"{gap:+.2%}",
            )
        )
    attacked = [
        r
        for r in rows
        if r["workers"] == 4 and r["attackers"] == 1 and r["aggregation"] == "clipped_mean" and r["exchange"] == "auto"
    ]
    for r in attacked:
        gap = _gap(r["eval_loss"], r["honest_eval_loss"])
        out.append(
            (
                f"clipped_mean, 1 of 4 {r['attack']}: within 5% of honest",
                None if gap is None else gap <= 0.05,
                "diverged" if gap is None else f"{gap:+.2%}",
            )
        )
    for workers in sorted({r["workers"] for r in rows if r["exchange"] == "auto"}):
        clipped = next(
            (
                r
                for r in rows
                if r["workers"] == workers
                and r["attackers"] == 0
                and r["aggregation"] == "clipped_mean"
                and r["exchange"] == "auto"
            ),
            None,
        )
        gap = _gap(clipped["eval_loss"], clipped["honest_eval_loss"]) if clipped else None
        out.append(
            (
                f"honest {workers} workers: clipped_mean within 0.5% of mean",
                None if gap is None else abs(gap) <= 0.005,
                "-" if gap is None else f"{gap:+.2%}",
            )
        )
    return out


def print_table(rows: list[dict], goals: list[tuple[str, Optional[bool], str]], out) -> None:
    out.write(
        f"{'workers':>7} {'attackers':>9} {'attack':<16} {'aggregation':<13} {'exchange':<10} {'eval loss':>9}"
        f" {'vs honest':>9} {'max shift':>9}\n"
    )
    for r in rows:
        gap = _gap(r["eval_loss"], r["honest_eval_loss"])
        shift = r.get("max_shift")
        out.write(
            f"{r['workers']:>7} {r['attackers']:>9} {r['attack']:<16} {r['aggregation']:<13} {r['exchange']:<10} "
            f"{'-' if r['eval_loss'] is None else format(r['eval_loss'], '.4f'):>9} "
            f"{'-' if gap is None else format(gap, '+.2%'):>9} {'-' if shift is None else format(shift, '.3g'):>9}\n"
        )
    for name, met, measured in goals:
        out.write(f"{ {True: 'yes', False: 'NO', None: 'n/a'}[met]:>3}  {name}: {measured}\n")


def byte_rows(
    numel: int, codecs: Sequence[str] = ("fp32", "int8", "int4"), group_sizes: Sequence[int] = (4, 8)
) -> list[dict]:
    """Payload bytes each member sends per round (one exchange of ``numel`` elements), butterfly against all-gather:
    the counts the simulator records, which the real exchange's tests match within 1%."""
    rows = []
    for codec in codecs:
        for k in group_sizes:
            butterfly = sum(butterfly_bytes_sent(numel, k, codec)) / k
            gather = sum(sum(pair) for pair in gather_bytes_by_site(numel, [""] * k, codec)) / k
            rows.append(
                {
                    "codec": codec,
                    "workers": k,
                    "numel": numel,
                    "encoded_bytes": get_codec(codec).encoded_size(numel),
                    "butterfly_bytes": round(butterfly),
                    "all_gather_bytes": round(gather),
                    "ratio": round(gather / butterfly, 3),
                }
            )
    return rows


def print_bytes(rows: list[dict], out) -> None:
    out.write(
        f"{'codec':<6} {'workers':>7} {'encoded MB':>10} {'butterfly MB':>12} {'all-gather MB':>13} {'ratio':>6}\n"
    )
    for r in rows:
        out.write(
            f"{r['codec']:<6} {r['workers']:>7} {r['encoded_bytes'] / 1e6:>10.2f} {r['butterfly_bytes'] / 1e6:>12.2f} "
            f"{r['all_gather_bytes'] / 1e6:>13.2f} {r['ratio']:>6.2f}\n"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--quick", action="store_true", help="4 workers, 1 attacker, few steps: a smoke run")
    parser.add_argument("--jobs", type=int, default=2, help="rows run at once, one process each (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="run seed: initial weights, data order, attack noise")
    parser.add_argument(
        "--slice-owner",
        action="store_true",
        help="only the malicious slice owner's rows (butterfly against all-gather)",
    )
    parser.add_argument(
        "--bytes",
        type=int,
        nargs="?",
        const=100_000_000,
        metavar="PARAMS",
        help="print the bytes per member and round of both exchanges for a model of PARAMS parameters"
        " (default 100,000,000) and exit",
    )
    parser.add_argument("--json", action="store_true", help="last stdout line: the rows as JSON")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1.")
    if args.bytes is not None:
        if args.bytes < 1:
            parser.error("--bytes needs a positive number of parameters.")
        table = byte_rows(args.bytes)
        print_bytes(table, sys.stderr if args.json else sys.stdout)
        if args.json:
            sys.stdout.write(json.dumps(table) + "\n")
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    grid = QUICK if args.quick else Grid()
    started = time.perf_counter()
    rows = run_all(grid, plan(grid, slice_owner_only=args.slice_owner), args.seed, args.jobs)
    print_table(rows, targets(rows), sys.stderr if args.json else sys.stdout)
    log.warning("total %.0f s (H=%d, %d rounds per run)", time.perf_counter() - started, grid.inner_steps, grid.rounds)
    if args.json:
        sys.stdout.write(json.dumps([{k: r.get(k) for k in (*ROW_KEYS, "note")} for r in rows]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
