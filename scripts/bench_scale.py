#!/usr/bin/env python3
"""Swarm at a real model size: memory, start-up, per-round overhead and a late joiner, each against plain PyTorch.

    .venv/bin/python scripts/bench_scale.py --models gpt2-124m --peers 2 --json
    .venv/bin/python scripts/bench_scale.py --models gpt2-124m,gpt2-350m --codec int4 --json
    .venv/bin/python scripts/bench_scale.py --models gpt2-124m --fragments 4 --late-joiner --json

Per model (a Hugging Face GPT-2 config built with ``from_config``: no download), in one run on this machine:

- **baseline**: a separate process builds the same model with ``AutoModelForCausalLM.from_config`` (timed) and
  trains it with ``torch.optim.AdamW`` on batches of the same shape for ``--baseline-steps`` steps; its peak
  resident memory (the kernel's high-water mark, ``VmHWM``) is plain training's peak.
- **swarm**: ``swarm coordinator`` and ``--peers`` ``swarm peer`` processes (the commands a user types) run
  ``--rounds`` rounds of ``--inner-steps`` steps. Per peer: the high-water mark of its main process (exact) and of
  its whole process tree (its DHT process and p2pd added: an upper bound, their peaks need not coincide); the
  seconds from launch to its first training step (the start of its first step's passes: the start-up probe's, when
  the step used them) and to its first round, with their breakdown (its own start-up line); and per committed
  round its *local work*: everything in the round that is neither inner steps nor the exchange (Δ, the outer
  step, the state's hash, the vote on disk, the commit), from its round lines.
- **late joiner** (``--late-joiner``): one more peer started once round 1 committed; how long its download of
  the state took, at what rate, and whether it contributed to the round after.

Targets (docs/BENCHMARKS.md, "Real model sizes"): peak ≤ baseline + 2.5 × the model's fp32 bytes; launch → first
step ≤ from_config + 10 s (waiting for other peers aside); local work ≤ 1 s per GB of fp32 parameters.
With ``--json`` the last stdout line is one JSON object. Run it on an idle machine: it reports the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]

MODELS = {  # GPT-2 small and medium: 124M and 355M parameters (the head is tied to the embedding)
    "gpt2-124m": {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
    "gpt2-350m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257},
    "gpt2-tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512},
}
FIRST_ROUND = re.compile(r"first round: training ([\d.]+)s after launch \((.*)\)")
ROUND_OPENED = re.compile(r"the round opened ([\d.]+)s after launch")  # when the probe made the first step's passes
COMMITTED = re.compile(r"\[p-[0-9a-f]+ r(\d+)\] committed, hash [0-9a-f]+: ")
EXCHANGE = re.compile(r"exchange ([\d.]+) s")
LOCAL_WORK = re.compile(r"local work ([\d.]+) s")
DOWNLOADED = re.compile(r"downloaded round (\d+) state \((\d+) bytes\) from (\d+) holder")
TIMESTAMP = re.compile(r"^(\d\d):(\d\d):(\d\d) ")
TIMELINE = False  # --rss-timeline: each peer's resident memory every 0.2 s, to read beside its log


# ---- the baseline: plain PyTorch training of the same model --------------------------------------------------
def baseline(config: dict, *, seq_len: int, batch_size: int, steps: int) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}
    )
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(hf)
    from_config_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    vocab = int(hf.vocab_size)
    step_s = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch_size, seq_len + 1))
        start = time.perf_counter()
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    return {
        "from_config_s": from_config_s,
        "peak_rss_bytes": _hwm(os.getpid()),
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": min(step_s),
    }


def _hwm(pid: int) -> int:
    """The kernel's high-water mark of a process's resident memory (bytes; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeWatch:
    """The high-water marks of a process and of every process it started, read while they live."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.hwm: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.tree_rss_max = 0  # the largest sum of the tree's resident memory seen at one moment
        self.timeline: list[tuple[str, float]] = []  # (wall clock HH:MM:SS.s, the main process's resident GB)

    def poll(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        rss = 0
        for p in procs:
            self.hwm[p.pid] = max(self.hwm.get(p.pid, 0), _hwm(p.pid))
            try:
                self.names.setdefault(p.pid, p.name())
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        self.tree_rss_max = max(self.tree_rss_max, rss)
        try:
            now = time.time()
            self.timeline.append(
                (
                    time.strftime("%H:%M:%S", time.localtime(now)) + f"{now % 1:.1f}"[1:],
                    round(root.memory_info().rss / 1e9, 3),
                )
            )
        except psutil.Error:
            pass

    def result(self) -> dict:
        return {
            "main_peak_rss_bytes": self.hwm.get(self.pid, 0),
            "tree_peak_rss_bytes": sum(self.hwm.values()),
            "tree_rss_max_sampled_bytes": self.tree_rss_max,
        }


# ---- the swarm ---------------------------------------------------------------------------------------------
def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    out = open(log, "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.app.cli", *args],
        stdout=out,
        stderr=out,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _seconds(line: str) -> Optional[int]:
    m = TIMESTAMP.match(line)
    return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) if m else None


def _write_tokens(path: Path, vocab: int, n: int = 2_000_000) -> None:
    import numpy as np

    np.random.default_rng(0).integers(0, min(vocab, 65535), size=n, dtype=np.uint16).tofile(path)


def swarm_run(name: str, config: dict, args: argparse.Namespace, work: Path) -> dict:
    tokens = work / "train.bin"
    _write_tokens(tokens, config["vocab_size"])
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in config.items())
    (work / "run.toml").write_text(
        f"seed = 0\n[model]\nhf_config = {{ {inline} }}\n"
        f'[data]\ntokens = "{tokens}"\nseq_len = {args.seq_len}\nbatch_size = {args.batch_size}\neval_batches = 2\n'
        f"[rounds]\ninner_steps = {args.inner_steps}\nmax_rounds = {args.rounds}\nmin_peers = {args.peers}\n"
        f'codec = "{args.codec}"\nfragments = {args.fragments}\n'
        + ('fragment_pattern = "balanced"\n' if args.fragments > 1 else "")
    )
    coord_log = work / "coordinator.log"
    coordinator = _spawn(
        [
            "coordinator",
            "--config",
            str(work / "run.toml"),
            "--state-dir",
            str(work / "coord"),
            "--port",
            "0",
            "--exit-grace-s",
            "5",
        ],
        coord_log,
    )
    procs = [coordinator]
    try:

        def join_string():
            if coordinator.poll() is not None:
                raise SystemExit(
                    f"bench_scale: the coordinator exited: {coord_log.read_text(errors='replace').strip()[-300:]}"
                )
            return re.search(r"swarm://\S+", coord_log.read_text(errors="replace"))

        join = _wait_for(join_string, 120, "join string")[0]
        peers: list[tuple[str, subprocess.Popen, TreeWatch, Path]] = []

        def start_peer(label: str, state_dir: Optional[str] = None) -> None:
            log = work / f"{label}.log"
            proc = _spawn(
                [
                    "peer",
                    "--join",
                    join,
                    "--state-dir",
                    str(work / (state_dir or label)),
                    "--device",
                    args.device,
                    "--name",
                    state_dir or label,
                ],
                log,
            )
            procs.append(proc)
            peers.append((label, proc, TreeWatch(proc.pid), log))

        for i in range(args.peers):
            start_peer(f"peer-{i}")
        late_started: Optional[float] = None
        restarted = False
        deadline = time.monotonic() + args.timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for _, p, _, _ in peers):
            for _, _, watch, _ in peers:
                watch.poll()
            committed_1 = "round 1: committed" in coord_log.read_text(errors="replace")
            if args.late_joiner and late_started is None and committed_1:
                late_started = time.monotonic()
                start_peer("late")
            if args.restart and not restarted and committed_1:  # kill -9 peer-0's process group, start it again
                restarted = True
                _stop(peers.pop(0)[1])
                start_peer("peer-0-restarted", state_dir="peer-0")  # its state dir: it resumes from its own disk
            time.sleep(0.2)
        timed_out = any(p.poll() is None for _, p, _, _ in peers)
        rows = [_peer_row(label, proc, watch, log) for label, proc, watch, log in peers]
        return {
            "peers": rows,
            "timed_out": timed_out,
            "coordinator_committed": len(re.findall(r"round \d+: committed", coord_log.read_text(errors="replace"))),
        }
    finally:
        for proc in procs:
            _stop(proc)


def _wait_for(find, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = find()
        if found:
            return found
        time.sleep(0.2)
    raise SystemExit(f"bench_scale: no {what} after {timeout_s:.0f} s")


def _peer_row(label: str, proc: subprocess.Popen, watch: TreeWatch, log: Path) -> dict:
    text = log.read_text(errors="replace")
    row: dict = {"label": label, "exit_code": proc.poll(), **watch.result()}
    if TIMELINE:
        row["rss_timeline"] = watch.timeline
    first = FIRST_ROUND.search(text)
    if first:
        row["launch_to_first_step_s"] = float(first[1])
        row["first_step_breakdown"] = first[2]
        opened = ROUND_OPENED.search(first[2])
        row["launch_to_first_round_s"] = float(opened[1]) if opened else float(first[1])
    rounds = []
    for line in text.splitlines():
        m = COMMITTED.search(line)
        if m:
            exchange, local = EXCHANGE.search(line), LOCAL_WORK.search(line)
            rounds.append(
                {
                    "round": int(m[1]),
                    "exchange_s": float(exchange[1]) if exchange else None,
                    "local_work_s": float(local[1]) if local else 0.0,
                }
            )
    row["rounds"] = rounds
    row["final_model"] = "wrote" in text and "final/model.safetensors" in text
    down = DOWNLOADED.search(text)
    if down:
        lines = text.splitlines()
        start = next((_seconds(x) for x in lines if "downloading from" in x), None)
        end = next((_seconds(x) for x in lines if DOWNLOADED.search(x)), None)
        row["download"] = {
            "round": int(down[1]),
            "bytes": int(down[2]),
            "holders": int(down[3]),
            "seconds_1s_resolution": (end - start) if start is not None and end is not None else None,
        }
        synced = [r["round"] for r in rounds if r["round"] > int(down[1])]
        row["contributed_next_round"] = bool(synced) and min(synced) == int(down[1]) + 1
    return row


def measure(name: str, args: argparse.Namespace) -> dict:
    config = MODELS[name]
    base = json.loads(
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--baseline-of",
                name,
                "--seq-len",
                str(args.seq_len),
                "--batch-size",
                str(args.batch_size),
                "--baseline-steps",
                str(args.baseline_steps),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    if args.work_dir:  # kept: the logs of every process
        work = Path(args.work_dir) / name
        work.mkdir(parents=True, exist_ok=True)
        swarm = swarm_run(name, config, args, work)
    else:
        with tempfile.TemporaryDirectory(prefix=f"bench-scale-{name}-") as tmp:
            swarm = swarm_run(name, config, args, Path(tmp))
    model_bytes = 4 * base["params"]
    target = base["peak_rss_bytes"] + 2.5 * model_bytes
    peers = swarm["peers"]
    local = [r["local_work_s"] for p in peers for r in p["rounds"][1:]]  # round 1 pays first-touch page faults
    per_gb = (max(local) / (model_bytes / 1e9)) if local else None
    first = [
        p["launch_to_first_step_s"]
        for p in peers
        if "launch_to_first_step_s" in p and p["label"] not in ("late", "peer-0-restarted")
    ]
    restarted = [p.get("launch_to_first_step_s") for p in peers if p["label"] == "peer-0-restarted"]
    return {
        "model": name,
        "params": base["params"],
        "fp32_bytes": model_bytes,
        "codec": args.codec,
        "fragments": args.fragments,
        "peers": args.peers,
        "baseline": base,
        **swarm,
        "peak_over_baseline_in_model_bytes": [
            round((p["main_peak_rss_bytes"] - base["peak_rss_bytes"]) / model_bytes, 2) for p in peers
        ],
        "peak_target_bytes": target,
        "peak_met": all(p["main_peak_rss_bytes"] <= target for p in peers if p["label"] != "late"),
        "first_step_target_s": base["from_config_s"] + 10,
        "first_step_s": first,
        "first_step_met": bool(first) and max(first) <= base["from_config_s"] + 10,
        "local_work_s_per_gb_max": per_gb,
        "local_work_met": per_gb is not None and per_gb <= 1.0,
        "restart_first_step_s": restarted[0] if restarted else None,
        "restart_met": bool(restarted) and restarted[0] is not None and restarted[0] <= 10,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-124m", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--codec", default="fp32")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--late-joiner", action="store_true", help="start one more peer once round 1 committed")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="once round 1 committed, kill -9 peer-0 and start it again on its state dir",
    )
    parser.add_argument("--baseline-steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--rss-timeline", action="store_true", help="add each peer's resident memory every 0.2 s")
    parser.add_argument(
        "--work-dir",
        help="keep the run's files and logs here (default: a temporary directory, removed at the end); the peers' state"
        " directories stay too: votes, checkpoints, residuals and the final model, about 8 GB per 124M peer",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline-of", help=argparse.SUPPRESS)  # the baseline's own process
    args = parser.parse_args()
    if args.baseline_of:
        print(
            json.dumps(
                baseline(
                    MODELS[args.baseline_of],
                    seq_len=args.seq_len,
                    batch_size=args.batch_size,
                    steps=args.baseline_steps,
                )
            )
        )
        return 0
    global TIMELINE
    TIMELINE = args.rss_timeline
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"bench_scale: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}.", file=sys.stderr)
        return 2
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    rows = []
    for name in names:
        row = measure(name, args)
        rows.append(row)
        gb = 1e9
        print(
            f"{name}: {row['params'] / 1e6:.0f}M params; baseline peak {row['baseline']['peak_rss_bytes'] / gb:.2f} GB,"
            f" from_config {row['baseline']['from_config_s']:.1f} s; peers' peak "
            f"{[round(p['main_peak_rss_bytes'] / gb, 2) for p in row['peers']]} GB (target "
            f"{row['peak_target_bytes'] / gb:.2f}); first step {row['first_step_s']} s (target "
            f"{row['first_step_target_s']:.1f}); local work {row['local_work_s_per_gb_max']} s/GB",
            file=sys.stderr,
        )
    out = {
        "benchmark": "scale",
        "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
