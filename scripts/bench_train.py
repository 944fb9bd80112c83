#!/usr/bin/env python3
"""What Swarm's inner loop costs against a plain PyTorch loop: ``LocalTrainer.train`` and a hand-written loop of
the same model, batch, AdamW, gradient clipping and precision, timed alternately in one run (swarm, plain,
plain, swarm, ...) so that drift in the machine's load hits both alike and neither always runs first.

    .venv/bin/python scripts/bench_train.py --json                      # CPU: preset, HF Llama, 2-rank gloo
    .venv/bin/python scripts/bench_train.py --device cuda --json        # GPU: bf16, with MFU

Cases: the built-in preset (``--preset``), a small Hugging Face Llama-style config (when transformers is
installed), and a 2-rank peer (``swarm.train.multi_gpu.ranks``, gloo on the CPU; NCCL with two GPUs) against a plain 2-rank
DDP loop. The last stdout line (with --json) is a JSON list of rows: model, device, precision, nproc,
swarm_tokens_per_s, plain_tokens_per_s, ratio (swarm / plain; the target is >= 0.98), and on CUDA mfu (from
6 × parameters + 12 × layers × width × seq_len FLOPs per token against ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm.config import RunConfig  # noqa: E402
from swarm.train.data.data import load_corpus  # noqa: E402
from swarm.train.inner_step import AUTOCAST_DTYPES  # noqa: E402
from swarm.train.model.run_model import build_run_model  # noqa: E402
from swarm.train.trainer import LocalTrainer  # noqa: E402

LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
}
# Dense bf16 peak of the GPUs people use, TFLOP/s (their data sheets); --peak-tflops for others.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}


@dataclass(frozen=True)
class Case:
    name: str
    model: dict
    nproc: int = 1

    @property
    def label(self) -> str:
        """What --only calls it: the model, with "-ranks" for the multi-rank row."""
        return self.name if self.nproc == 1 else f"{self.name}-ranks"


def run_config(case: Case, args: argparse.Namespace) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": case.model,
            "data": {"seq_len": args.seq_len, "batch_size": args.batch_size, "max_bytes": 2_000_000, "num_shards": 1},
            "inner": {"precision": args.precision, "micro_batches": 1, "prefetch": True, "compile": args.compile},
        }
    )


# ---- the plain loop ---------------------------------------------------------------------------------------


class PlainLoop:
    """nanoGPT's loop: random windows of the training tokens, autocast, backward, clip, AdamW."""

    def __init__(self, run: RunConfig, device: torch.device, wrap=None) -> None:
        built = build_run_model(run.model, seed=run.seed)
        self.model, self.loss = built.module.to(device), built.loss
        self.forward = wrap(self.model) if wrap is not None else self.model
        if run.inner.compile:
            self.forward = torch.compile(self.forward)
        params = list(self.model.parameters())
        inner = run.inner
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=inner.lr,
            betas=(inner.beta1, inner.beta2),
        )
        self.params, self.run, self.device = params, run, device
        self.data = load_corpus(run.data).train
        dtype = AUTOCAST_DTYPES.get(inner.precision)
        self.autocast_dtype = dtype
        self.scaler = torch.amp.GradScaler(device.type) if inner.precision == "fp16" else None
        self.window = torch.arange(run.data.seq_len + 1)
        self.steps_done = 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.run.data
        starts = torch.randint(0, self.data.numel() - d.seq_len, (d.batch_size, 1))
        w = self.data[starts + self.window].long()
        x, y = w[:, :-1], w[:, 1:]
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def train(self, steps: int) -> None:
        inner = self.run.inner
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(steps):
            x, y = self.batch()
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                loss = self.loss(self.forward, (x, y))
            self.optimizer.zero_grad(set_to_none=True)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, inner.grad_clip)
            lr = inner.lr * min(1.0, (self.steps_done + 1) / max(1, inner.warmup_steps))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            loss_sum += loss.detach()
            self.steps_done += 1
        loss_sum.item()


def _plain_rank(rank: int, world_size: int, run_json: str, device: str, store_path: str, conn) -> None:
    """A rank of the plain DDP loop: trains as many steps as the pipe says; rank 0 answers with the seconds."""
    from swarm.train.multi_gpu.ranks import join_ranks

    torch.set_num_threads(1)
    ranks = join_ranks(rank=rank, world_size=world_size, device=device, store_path=store_path)
    loop = PlainLoop(RunConfig.from_json(run_json), ranks.device, wrap=ranks.wrap)
    while (steps := conn.recv()) is not None:
        torch.distributed.barrier()
        start = time.perf_counter()
        loop.train(steps)
        _sync(ranks.device)
        conn.send(time.perf_counter() - start)
    ranks.close()


class PlainDDP:
    """The plain loop in ``nproc`` spawned processes (their own process group), driven over pipes."""

    def __init__(self, run: RunConfig, device: str, nproc: int) -> None:
        self.store_dir = tempfile.mkdtemp(prefix="bench-train-ddp-")
        context = multiprocessing.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(nproc):
            mine, theirs = context.Pipe()
            proc = context.Process(
                target=_plain_rank,
                args=(rank, nproc, run.to_json(), device, os.path.join(self.store_dir, "store"), theirs),
            )
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    def train(self, steps: int) -> float:
        for pipe in self.pipes:
            pipe.send(steps)
        times = [pipe.recv() for pipe in self.pipes]
        return times[0]

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(timeout=30)


# ---- measuring --------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flops_per_token(module: torch.nn.Module, seq_len: int) -> float:
    """6 N for the matmuls forward and backward plus the attention scores (nanoGPT's estimate)."""
    n = sum(p.numel() for p in module.parameters())
    cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    layers = getattr(cfg, "n_layer", None) or getattr(cfg, "num_hidden_layers", 0)
    width = getattr(cfg, "d_model", None) or getattr(cfg, "hidden_size", 0)
    return 6.0 * n + 12.0 * layers * width * seq_len


def peak_flops(device: torch.device, given: Optional[float]) -> Optional[float]:
    if given:
        return given * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def measure(case: Case, args: argparse.Namespace) -> dict:
    run = run_config(case, args)
    device = torch.device(args.device)
    peer_ranks = plain_ddp = None
    if case.nproc > 1:
        from peer.ranks import start_ranks

        peer_ranks = start_ranks(case.nproc, device=args.device, threads=1)
        trainer = LocalTrainer(run, peer_index=0, ranks=peer_ranks.ranks)
        device = peer_ranks.ranks.device
        plain_ddp = PlainDDP(run, args.device, case.nproc)
        plain_train = plain_ddp.train
    else:
        trainer = LocalTrainer(run, peer_index=0, device=args.device)
        plain = PlainLoop(run, device)

        def plain_train(steps: int) -> float:
            start = time.perf_counter()
            plain.train(steps)
            _sync(device)
            return time.perf_counter() - start

    def swarm_train(steps: int) -> float:
        start = time.perf_counter()
        trainer.train(steps)
        _sync(device)
        return time.perf_counter() - start

    try:
        swarm_train(args.warmup_steps), plain_train(args.warmup_steps)  # allocator, autotuning, compile
        swarm_s = plain_s = 0.0
        for rep in range(args.reps):  # swarm, plain, plain, swarm, ...: neither always runs first
            if rep % 2 == 0:
                swarm_s += swarm_train(args.steps)
            plain_s += plain_train(args.steps)
            if rep % 2 == 1:
                swarm_s += swarm_train(args.steps)
    finally:
        if peer_ranks is not None:
            peer_ranks.close()
        if plain_ddp is not None:
            plain_ddp.close()
    tokens = args.reps * args.steps * args.batch_size * args.seq_len * case.nproc
    row = {
        "model": case.name,
        "device": str(device.type),
        "precision": args.precision,
        "nproc": case.nproc,
        "params": trainer.param_count,
        "swarm_tokens_per_s": round(tokens / swarm_s, 1),
        "plain_tokens_per_s": round(tokens / plain_s, 1),
        "ratio": round(plain_s / swarm_s, 4),
    }
    peak = peak_flops(device, args.peak_tflops)
    if peak is not None:
        per_gpu = tokens / swarm_s / case.nproc
        row["mfu"] = round(per_gpu * flops_per_token(trainer.model, args.seq_len) / peak, 4)
    print(
        f"{case.name:>8} {row['device']} {args.precision} nproc={case.nproc}: swarm {row['swarm_tokens_per_s']:,.0f}"
        f" tok/s, plain {row['plain_tokens_per_s']:,.0f} tok/s, ratio {row['ratio']:.3f}",
        flush=True,
    )
    return row


def cases(args: argparse.Namespace) -> list[Case]:
    found = [Case(args.preset, {"preset": args.preset})]
    try:
        import transformers  # noqa: F401

        found.append(Case("llama", {"hf_config": LLAMA}))
    except ImportError:
        print("transformers is not installed: no HF Llama row (pip install -e '.[hf]')", file=sys.stderr)
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.device == "cpu" or gpus >= 2:
        found.append(Case(f"{args.preset}", {"preset": args.preset}, nproc=2))
    return [c for c in found if not args.only or c.label in args.only.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", help="fp32, bf16 or fp16 (default: fp32 on the CPU, bf16 on CUDA)")
    parser.add_argument("--preset", help="the built-in model (default: tiny on the CPU, gpt2 on CUDA)")
    parser.add_argument("--batch-size", type=int, help="sequences per step and rank (default: 8 CPU, 16 CUDA)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128 CPU, 1024 CUDA)")
    parser.add_argument("--steps", type=int, help="steps per timed stretch (default: 20 CPU, 50 CUDA)")
    parser.add_argument("--reps", type=int, default=6, help="timed stretches of each loop, alternating (ABBA)")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile both loops")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (CPU)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: known GPUs' bf16)")
    parser.add_argument(
        "--only", help="comma-separated rows: the preset (tiny), llama, the preset's 2-rank row (tiny-ranks)"
    )
    parser.add_argument("--json", action="store_true", help="end with one JSON line: the rows")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.preset = args.preset or ("gpt2" if cuda else "tiny")
    args.batch_size = args.batch_size or (16 if cuda else 8)
    args.seq_len = args.seq_len or (1024 if cuda else 128)
    args.steps = args.steps or (50 if cuda else 20)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(
        f"machine: {platform.machine()} {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(0)}" if cuda else ""),
        flush=True,
    )
    rows = [measure(case, args) for case in cases(args)]
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
