"""Stragglers on loopback: a real coordinator and 4 real peers, one of them 3x slower
(``--faults slow@1:compute=3``: each inner step takes 3x its compute), then the same run with 4 equal peers.

    .venv/bin/python scripts/bench_straggler.py --json      # ~10-15 min on 2 shared cores
    .venv/bin/python scripts/bench_straggler.py --quick     # a smoke run (~2 min)

Measured from the coordinator's history (``swarm history STATE_DIR``), over the rounds after the first (a peer
whose step-time probe did not show it >= 5x slower trains round 1's full steps):

- ``straggler_throughput_ratio``: the swarm's tokens per wall second (every token its peers trained, over
  the time from round 1's decision to the last one's) over the sum of the peers' standalone tokens per
  second (each peer's own training speed in those rounds as its heartbeats report it: what it would do
  alone on this machine, throttle included). Target >= 0.95. ``..._without_last_round``: the same without
  the last round, whose exchange no next round can hide (every peer waits for it).
- ``straggler_eval_loss_ratio``: the straggler run's last evaluated loss over the equal-speed run's at the
  same number of tokens (linear between its rounds). Target <= 1.01.

``--overlap-steps 20 --controller auto`` runs both with overlap, the peers training on while they exchange.

The last stdout line (with --json) is one JSON object with both and the numbers behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.app.history import history_from_state_dir, history_to_dict  # noqa: E402

PEERS = 4
SLOW = "slow@1:compute=3"

CONFIG = """
[model]
preset = "tiny"

[data]
batch_size = 4
seq_len = 32
max_bytes = 2000000
num_shards = 4
eval_batches = {eval_batches}

[rounds]
inner_steps = {inner_steps}
max_rounds = {rounds}
min_peers = {peers}
eval_every_rounds = 1
straggler_slack_s = 1.0
matchmaking_window_s = 15.0
exchange_timeout_s = 30.0
round_timeout_s = 600.0
overlap_steps = {overlap_steps}
controller = "{controller}"
"""


def run_swarm(workdir: Path, config: str, faults: dict[str, str], timeout_s: float) -> dict:
    """One run: a coordinator and PEERS peers (``faults``: name -> --faults plan); its history as a dict."""
    workdir.mkdir(parents=True)
    (workdir / "run.toml").write_text(config)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    cli = [sys.executable, "-m", "swarm.app.cli"]
    coordinator = subprocess.Popen(
        [
            *cli,
            "coordinator",
            "--config",
            str(workdir / "run.toml"),
            "--state-dir",
            str(workdir / "coordinator"),
            "--exit-grace-s",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=open(workdir / "coordinator.log", "ab"),
        env=env,
        cwd=ROOT,
    )
    procs = [coordinator]
    try:
        join = _join_string(coordinator)
        for i in range(PEERS):
            name = f"peer-{i}"
            extra = ["--faults", faults[name]] if name in faults else []
            procs.append(
                subprocess.Popen(
                    [
                        *cli,
                        "peer",
                        "--join",
                        join,
                        "--state-dir",
                        str(workdir / name),
                        "--threads",
                        "1",
                        "--name",
                        name,
                        *extra,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(workdir / f"{name}.log", "ab"),
                    env=env,
                    cwd=ROOT,
                )
            )
        deadline = time.monotonic() + timeout_s
        for proc in procs[1:]:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"a peer exited with {code}; see the logs in {workdir}")
        coordinator.wait(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    history = history_to_dict(history_from_state_dir(workdir / "coordinator"))
    history["steps"] = steps_per_round(workdir / "coordinator")
    return history


def _join_string(coordinator: subprocess.Popen) -> str:
    for raw in coordinator.stdout:
        line = raw.decode()
        if line.startswith("join: "):
            return line.split(" ", 1)[1].strip()
    raise RuntimeError("the coordinator printed no join string")


def throughput(history: dict, *, last_round: bool = True) -> dict:
    """Swarm tokens/s in the steady rounds against the sum of each peer's own training speed in them. The
    steady rounds start at the first round after round 1 that every peer reported (round 1 has no decided round
    before it to time from; since the step-time probe it is budgeted too, before it the slow peer did the full
    steps, missed its group and resynced: the rounds a peer spends out are counted in ``rounds_before_steady``,
    not in the ratio). ``last_round=False`` leaves the last round out too: its exchange has no next round to
    overlap with, so every peer waits for it (the window ``utilization_under_wan`` measures)."""
    rounds = [r for r in history["rounds"] if r["outcome"] == "committed"]
    if not last_round:
        rounds = rounds[:-1]
    reporters = {i + 1: len(steps) for i, steps in enumerate(history["steps"])}  # round -> peers that reported
    first = next((r["round"] for r in rounds if r["round"] >= 2 and reporters.get(r["round"], 0) >= PEERS), None)
    if first is None:
        raise RuntimeError("no round after the first had every peer: no steady state to measure")
    steady = [r for r in rounds if r["round"] >= first]
    before = [r for r in rounds if r["round"] < first]
    wall_s = steady[-1]["decided_at"] - before[-1]["decided_at"]
    swarm_tps = sum(r["tokens"] for r in steady) / wall_s
    speeds: dict[str, list[float]] = {}
    for p in history["peer_rounds"]:
        if first <= p["round"] <= steady[-1]["round"] and p["tokens_per_s"]:
            speeds.setdefault(p["peer_id"], []).append(p["tokens_per_s"])
    standalone = {peer: statistics.median(v) for peer, v in speeds.items()}
    return {
        "swarm_tokens_per_s": swarm_tps,
        "standalone_tokens_per_s": sorted(standalone.values()),
        "standalone_sum_tokens_per_s": sum(standalone.values()),
        "steady_wall_s": wall_s,
        "steady_rounds": [r["round"] for r in steady],
        "ratio": swarm_tps / sum(standalone.values()),
    }


def _ratio_without_last_round(history: dict) -> Optional[float]:
    """``throughput(..., last_round=False)``'s ratio; None when the last round is the only steady one."""
    try:
        return throughput(history, last_round=False)["ratio"]
    except RuntimeError:
        return None


def eval_curve(history: dict) -> list[tuple[int, float]]:
    """(cumulative tokens, eval loss) after each committed round that was evaluated."""
    curve, tokens = [], 0
    for r in history["rounds"]:
        if r["outcome"] != "committed":
            continue
        tokens += r["tokens"]
        if r["eval_loss"] is not None:
            curve.append((tokens, r["eval_loss"]))
    return curve


def loss_at(curve: list[tuple[int, float]], tokens: int) -> Optional[float]:
    """The curve's loss at ``tokens``, linear between its points (None: outside it)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return None


def steps_per_round(state_dir: Path) -> list[dict[str, int]]:
    """Each round's reported inner steps by peer name, from the coordinator's store."""
    from coordinator.store.database import STORE_FILE, Store

    store = Store(state_dir / STORE_FILE, read_only=True)
    try:
        names = {p.peer_id: p.name for p in store.peers()}
        out, n = [], 1
        while store.get_round(n) is not None:
            out.append({names.get(r.peer_id, r.peer_id): r.inner_steps for r in store.reports(n)})
            n += 1
        return out
    finally:
        store.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (numbers not meaningful)")
    parser.add_argument("--inner-steps", type=int, default=400, help="H of both runs")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of both runs")
    parser.add_argument(
        "--overlap-steps",
        type=int,
        default=0,
        help="[rounds] overlap_steps of both runs (0: a peer waits for its exchange)",
    )
    parser.add_argument(
        "--controller",
        choices=("off", "auto"),
        default="off",
        help="[rounds] controller of both runs (auto: with overlap, a peer merges when its exchange"
        " ends and trains on meanwhile)",
    )
    parser.add_argument("--keep", help="keep both runs' state dirs and logs under this directory")
    args = parser.parse_args(argv)
    inner_steps, rounds = (40, 3) if args.quick else (args.inner_steps, args.rounds)
    config = CONFIG.format(
        inner_steps=inner_steps,
        rounds=rounds,
        peers=PEERS,
        eval_batches=4 if args.quick else 16,
        overlap_steps=args.overlap_steps,
        controller=args.controller,
    )
    timeout_s = 60 + rounds * inner_steps * 0.5
    with tempfile.TemporaryDirectory(prefix="bench_straggler_") as scratch:
        tmp = args.keep or scratch
        started = time.monotonic()
        straggler = run_swarm(Path(tmp) / "straggler", config, {f"peer-{PEERS - 1}": SLOW}, timeout_s)
        equal = run_swarm(Path(tmp) / "equal", config, {}, timeout_s)
        elapsed_s = time.monotonic() - started
    speed = throughput(straggler)
    slow_curve, equal_curve = eval_curve(straggler), eval_curve(equal)
    tokens, loss = slow_curve[-1]
    equal_loss = loss_at(equal_curve, tokens)
    result = {
        "straggler_throughput_ratio": speed["ratio"],
        "straggler_eval_loss_ratio": loss / equal_loss if equal_loss else None,
        **{k: v for k, v in speed.items() if k != "ratio"},
        "equal_throughput_ratio": throughput(equal)["ratio"],
        "straggler_throughput_ratio_without_last_round": _ratio_without_last_round(straggler),
        "equal_throughput_ratio_without_last_round": _ratio_without_last_round(equal),
        "eval_tokens": tokens,
        "straggler_eval_loss": loss,
        "equal_eval_loss_at_tokens": equal_loss,
        "straggler_rounds": [(r["round"], r["outcome"], r["tokens"]) for r in straggler["rounds"]],
        "equal_rounds": [(r["round"], r["outcome"], r["tokens"]) for r in equal["rounds"]],
        "straggler_steps": straggler["steps"],
        "equal_steps": equal["steps"],
        "config": {
            "peers": PEERS,
            "slow": SLOW,
            "inner_steps": inner_steps,
            "rounds": rounds,
            "model": "tiny",
            "batch_size": 4,
            "seq_len": 32,
            "overlap_steps": args.overlap_steps,
            "controller": args.controller,
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "elapsed_s": elapsed_s,
    }
    for key in (
        "straggler_throughput_ratio",
        "straggler_eval_loss_ratio",
        "swarm_tokens_per_s",
        "standalone_sum_tokens_per_s",
        "equal_throughput_ratio",
        "straggler_throughput_ratio_without_last_round",
        "equal_throughput_ratio_without_last_round",
    ):
        value = result[key]
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
