"""Quality against bytes: held-out loss and bytes sent per worker for one worker, synchronous
data-parallel training, DiLoCo (fp32, fp16, int8, int4 + error feedback), Streaming DiLoCo,
heterogeneous peers and torchft's DiLoCo: same model, data, seeds and inner steps per worker, on CPU.

    scripts/bench_setup.sh                                # optional: torchft, the external reference
    .venv/bin/python scripts/bench_quality.py --json      # the documented rows; --quick: a smoke run
    .venv/bin/python scripts/bench_quality.py --full      # + fp16/int8, sparse codecs, from scratch
    .venv/bin/python scripts/bench_quality.py --check     # do the documented rows still reproduce?

As in the DiLoCo paper, every method continues from one checkpoint trained by a single worker
(cached under .bench_cache/); with --full a second table repeats the fp32 rows from scratch. Swarm's
rows run in its simulator (swarm.train.simulator.sim), which calls the peer daemon's functions.
docs/BENCHMARKS.md has the results and how to read them; docs/bench_quality.json pins them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import inspect
import json
import logging
import multiprocessing
import os
import queue
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import bench_quality_record as bench_record
import torch
from rich.console import Console

from swarm.app.run_progress import RunProgress
from swarm.config import FRAGMENT_PATTERNS, MODEL_PRESETS, DataConfig, ModelConfig, RoundConfig, RunConfig
from swarm.core import average
from swarm.core.fragments import fragments as split_fragments
from swarm.core.state import GlobalState, state_hash
from swarm.train.data.data import eval_loss
from swarm.train.model import model as swarm_model
from swarm.train.model.final_model import load_into_model
from swarm.train.simulator import sim as swarm_sim
from swarm.train.trainer import LocalTrainer

log = logging.getLogger("bench_quality")

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("single", "ddp", "diloco", "streaming", "heterogeneous", "torchft_diloco")
ROW_KEYS = (
    "method",
    "codec",
    "H",
    "fragments",
    "overlap",
    "eval_loss",
    "bytes_per_worker",
    "reduction_vs_ddp",
    "peak_bytes_per_sync",
    "wall_s",
    "cpu_s",
)

# ~0.22M parameters in 4 blocks of width 64 ("tiny" is 0.44M in 2 blocks): Streaming DiLoCo with
# F = 4 needs at least 4 layer units.
BENCH_PRESET = "bench"


class RowSkipped(Exception):
    """A row this checkout cannot run (a feature or an optional package is missing)."""


@dataclass(frozen=True, kw_only=True)
class Grid:
    """Which rows run, and at which H (inner steps per full sync)."""

    h_values: tuple[int, ...] = (10, 50, 100, 200)  # fp32 DiLoCo, warm and from scratch
    codecs: tuple[str, ...] = ("int4",)  # with error feedback (fp16 and int8 land within 0.03% of fp32)
    codec_h: tuple[int, ...] = (50, 100, 200)
    # (lr, momentum) of the codec rows' outer Nesterov step, one row each (None: the run's)
    codec_outers: tuple[Optional[tuple[float, float]], ...] = (None,)
    ef_decays: tuple[float, ...] = (1.0,)  # error-feedback decay β of the codec rows, one row each
    codec_error_feedback: bool = True  # False: the codec rows send without error feedback (an ablation)
    keep_unsent_locally: bool = False  # the codec rows' [rounds] keep_unsent_locally
    codec_fragments: int = 1  # > 1: the codec rows are Streaming DiLoCo with this many fragments, no overlap
    # Sparse codecs with SparseLoCo's settings: error feedback decayed by β and a plain outer step
    # (lr 1, no momentum: with momentum they end worse than they started).
    sparse_codecs: tuple[str, ...] = ()
    sparse_h: tuple[int, ...] = (25, 50, 100)
    sparse_outer: tuple[float, float] = (1.0, 0.0)
    sparse_ef_decay: float = 0.95
    scratch: bool = False  # the from-scratch table
    reference_h: int = 50  # heterogeneous, torchft DiLoCo, and the DDP target
    stream_h: int = 100  # Streaming DiLoCo (F divides it) and torchft's streaming row
    fragments: int = 4
    overlap: int = 5  # tau of the overlapped streaming row
    fragment_pattern: str = "strided"  # [rounds] fragment_pattern of the streaming rows
    torchft_streaming: bool = True
    eval_batches: int = 32  # 32 x 8 windows of 128 bytes from the held-out split


FULL_GRID = Grid(
    codecs=("fp16", "int8", "int4"), sparse_codecs=("topk-int4@0.01", "topk-int4@0.03", "topk-int4@0.1"), scratch=True
)
QUICK_GRID = Grid(
    h_values=(10,),
    codecs=("int4",),
    codec_h=(10,),
    reference_h=10,
    stream_h=20,
    overlap=2,
    sparse_codecs=("topk-int4@0.1",),
    sparse_h=(10,),
    torchft_streaming=False,
    eval_batches=4,
    scratch=True,
)
QUICK_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class Bench:
    workers: int
    steps: int  # inner steps per worker (the slow heterogeneous worker does fewer)
    warm_steps: int
    seed: int
    threads: int
    cache_dir: Path
    grid: Grid

    def run_config(self) -> RunConfig:
        return RunConfig(
            seed=self.seed,
            model=ModelConfig(preset=BENCH_PRESET),
            data=DataConfig(batch_size=8, seq_len=128, eval_batches=self.grid.eval_batches),
            # One evaluation, at the end: simulate() also evaluates on the last round.
            rounds=RoundConfig(eval_every_rounds=10**9),
        ).validate()


@dataclass(frozen=True, kw_only=True)
class Job:
    method: str
    init: str  # "warm" (from the cached checkpoint) or "scratch"
    codec: str = "fp32"
    H: Optional[int] = None
    fragments: int = 1
    overlap: int = 0
    error_feedback: bool = False
    ef_decay: float = 1.0
    outer: Optional[tuple[float, float]] = None  # (lr, momentum) of the outer step (None: the run's)
    slow_factor: int = 1  # heterogeneous: the last worker runs this many times slower
    keep_unsent: bool = False  # [rounds] keep_unsent_locally: θl restarts from θg − the EF residual

    @property
    def label(self) -> str:
        ef = ("+EF" + (f" decay {self.ef_decay:g}" if self.ef_decay != 1.0 else "")) if self.error_feedback else ""
        parts = [self.method, self.codec + ef]
        if self.H:
            parts.append(f"H={self.H}")
        if self.outer:
            parts.append(f"outer {self.outer[0]:g},{self.outer[1]:g}")
        if self.keep_unsent:
            parts.append("unsent kept locally")
        if self.fragments > 1:
            parts.append(f"F={self.fragments} tau={self.overlap}")
        return " ".join(parts) + f" ({self.init})"


def plan(bench: Bench, methods: Sequence[str], *, init: str) -> list[Job]:
    """The rows of one table. From scratch only the fp32 single / DDP / DiLoCo rows run."""
    g = bench.grid
    jobs: list[Job] = []
    if "single" in methods:
        jobs.append(Job(method="single", init=init))
    if "ddp" in methods:
        jobs.append(Job(method="ddp", init=init))
    if "diloco" in methods:
        jobs += [Job(method="diloco", init=init, H=h) for h in g.h_values]
        if init == "warm":
            jobs += [
                Job(
                    method="diloco" if g.codec_fragments == 1 else "streaming",
                    init=init,
                    codec=codec,
                    H=h,
                    error_feedback=g.codec_error_feedback,
                    ef_decay=beta,
                    outer=outer,
                    keep_unsent=g.keep_unsent_locally,
                    fragments=g.codec_fragments,
                )
                for codec in g.codecs
                for h in g.codec_h
                for beta in g.ef_decays
                for outer in g.codec_outers
            ]
            jobs += [
                Job(
                    method="diloco",
                    init=init,
                    codec=codec,
                    H=h,
                    error_feedback=True,
                    ef_decay=g.sparse_ef_decay,
                    outer=g.sparse_outer,
                )
                for codec in g.sparse_codecs
                for h in g.sparse_h
            ]
    if init == "warm":
        if "streaming" in methods:
            jobs += [
                Job(method="streaming", init=init, H=g.stream_h, fragments=g.fragments, overlap=tau)
                for tau in (0, g.overlap)
            ]
        if "heterogeneous" in methods:
            jobs.append(Job(method="heterogeneous", init=init, H=g.reference_h, slow_factor=3))
        if "torchft_diloco" in methods:
            jobs.append(Job(method="torchft_diloco", init=init, H=g.reference_h))
            if g.torchft_streaming:
                jobs.append(Job(method="torchft_diloco", init=init, H=g.stream_h, fragments=g.fragments))
    for job in jobs:
        if job.H is not None and bench.steps % job.H:
            raise ValueError(f"--steps {bench.steps} is not a multiple of H={job.H}; use a multiple of 200.")
    return list(dict.fromkeys(jobs))  # a row asked for twice (e.g. by --codecs and the sparse sweep) runs once


# ---- the shared starting point ----------------------------------------------------------------


def warm_checkpoint(bench: Bench) -> Path:
    """The single-worker checkpoint every warm row starts from; trained once, then read from disk.

    It is trained on the last data shard, which no benchmark worker uses (workers 0..N-1 train on
    shards 0..N-1). Only the weights are kept: every method starts with a fresh AdamW and warmup.
    """
    from safetensors.torch import save_file

    run = bench.run_config()
    if bench.workers >= run.data.num_shards:
        raise ValueError(f"--workers must be below {run.data.num_shards} (the last shard is the warm-up's).")
    # Everything the checkpoint's bits depend on: a cached one made by other code, another Python's
    # standard library (the corpus), other CPU kernels or thread counts is not reused.
    env = bench_record.environment(run.data, bench.threads, with_scripts=False)
    spec = {
        "run": run.to_dict(),
        "shape": MODEL_PRESETS[BENCH_PRESET],
        "warm_steps": bench.warm_steps,
        "env": env,
        "version": 2,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    weights_path = bench.cache_dir / f"warm-{key}.safetensors"
    meta_path = weights_path.with_suffix(".json")
    if weights_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        log.info(
            "warm start: cached %s (%d steps, eval loss %.4f)", weights_path.name, meta["warm_steps"], meta["eval_loss"]
        )
        return weights_path
    bench.cache_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(bench.threads)
    log.info("warm start: training one worker for %d steps (cached afterwards)", bench.warm_steps)
    start, cpu_start = time.perf_counter(), time.process_time()
    trainer = LocalTrainer(run, peer_index=run.data.num_shards - 1)
    stats = trainer.train(bench.warm_steps)
    weights = {name: p.detach().clone().contiguous() for name, p in trainer.model.named_parameters()}
    loss = _model_eval_loss(trainer)
    tmp = weights_path.with_suffix(".tmp")
    save_file(weights, str(tmp))
    os.replace(tmp, weights_path)  # a run killed mid-write leaves no half checkpoint behind
    meta = spec | {
        "eval_loss": loss,
        "train_loss": stats.mean_loss,
        "shard": trainer.shard_index,
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_s": round(time.process_time() - cpu_start, 1),
    }
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log.info("warm start: eval loss %.4f after %d steps (%.0f s)", loss, bench.warm_steps, meta["seconds"])
    return weights_path


def load_weights(path: Optional[Path], run: RunConfig) -> Optional[list[torch.Tensor]]:
    """The checkpoint's tensors in the model's parameter order (None: start from scratch)."""
    if path is None:
        return None
    return [p.detach() for p in load_into_model(path, run).parameters()]


def start_from(trainer: LocalTrainer, weights: Optional[list[torch.Tensor]]) -> None:
    """Make ``weights`` the trainer's committed θg (and θl), with zero outer momentum."""
    if weights is None:
        return
    # outer state: still zeros; θl ← θg
    trainer.commit(GlobalState(0, [w.clone() for w in weights], trainer.state.outer_state))


def _model_eval_loss(trainer: LocalTrainer) -> float:
    """Held-out loss of the trainer's model as it is now (θl; ``trainer.eval_loss`` reads θg)."""
    d = trainer.run.data
    return eval_loss(
        trainer.model, trainer.corpus, batch_size=d.batch_size, seq_len=d.seq_len, num_batches=d.eval_batches
    )


def ring_bytes(payload_bytes: float, workers: int) -> float:
    """Bytes one worker sends in a ring (or butterfly) all-reduce of ``payload_bytes``."""
    return 2 * (workers - 1) / workers * payload_bytes


# ---- the methods ------------------------------------------------------------------------------


def run_single(bench: Bench, job: Job, ckpt: Optional[Path]) -> dict[str, Any]:
    trainer = LocalTrainer(bench.run_config(), peer_index=0)
    start_from(trainer, load_weights(ckpt, trainer.run))
    trainer.train(bench.steps)
    return {"eval_loss": _model_eval_loss(trainer), "bytes_per_worker": 0.0, "peak_bytes_per_sync": 0.0}


def run_ddp(bench: Bench, job: Job, ckpt: Optional[Path]) -> dict[str, Any]:
    """N workers' gradients averaged every step, one AdamW step on the shared weights.

    Worker 0's trainer holds the shared model and optimizer; the others lend their data shards.
    Each worker's mean loss is back-propagated scaled by 1/N, so the accumulated gradient is
    exactly the average of the N workers' gradients. Warmup, clipping and AdamW are LocalTrainer's.
    """
    run = bench.run_config()
    trainers = [LocalTrainer(run, peer_index=i) for i in range(bench.workers)]
    shared = trainers[0]
    start_from(shared, load_weights(ckpt, shared.run))
    params = list(shared.model.parameters())
    shared.model.train()
    for step in range(bench.steps):
        shared.optimizer.zero_grad(set_to_none=True)
        for worker in trainers:
            x, y = worker.sampler.next_batch()
            _, loss = shared.model(x, y)
            (loss / bench.workers).backward()
        if run.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, run.inner.grad_clip)
        for group in shared.optimizer.param_groups:
            group["lr"] = shared.lr_at(step)
        shared.optimizer.step()
    per_step = ring_bytes(4 * shared.param_count, bench.workers)
    return {
        "eval_loss": _model_eval_loss(shared),
        "bytes_per_worker": per_step * bench.steps,
        "peak_bytes_per_sync": per_step,
    }


def run_sim(bench: Bench, job: Job, ckpt: Optional[Path]) -> dict[str, Any]:
    """DiLoCo, its codecs, Streaming DiLoCo and heterogeneous peers, all through swarm.train.simulator.sim."""
    base = bench.run_config()
    run = base.replace(rounds=dataclasses.replace(base.rounds, inner_steps=job.H)).validate()
    if job.outer:
        lr, momentum = job.outer
        run = run.replace(outer=dataclasses.replace(run.outer, lr=lr, momentum=momentum)).validate()
    if job.ef_decay != 1.0:
        run = run.replace(rounds=dataclasses.replace(run.rounds, error_feedback_decay=job.ef_decay)).validate()
    if job.keep_unsent:
        run = run.replace(
            rounds=dataclasses.replace(run.rounds, keep_unsent_locally=True, error_feedback=job.error_feedback)
        ).validate()
    if job.fragments > 1:
        run = run.replace(
            rounds=dataclasses.replace(run.rounds, fragment_pattern=bench.grid.fragment_pattern)
        ).validate()
    kwargs: dict[str, Any] = dict(
        codec=job.codec, error_feedback=job.error_feedback, fragments=job.fragments, overlap_steps=job.overlap
    )
    if job.slow_factor > 1:
        # Rounds are time budgets: the slow worker manages a third of the fast ones' steps, and the
        # average weighs every contribution by its samples.
        kwargs["speeds"] = [1.0] * (bench.workers - 1) + [1.0 / job.slow_factor]
    # A round syncs one fragment: F rounds per H steps.
    result = swarm_sim.simulate(
        run,
        peers=bench.workers,
        rounds=bench.steps // job.H * job.fragments,
        initial_params=load_weights(ckpt, run),
        **kwargs,
    )
    if not result.consistent:
        raise RuntimeError(f"{job.label}: the simulated peers ended with different global states")
    sent = result.bytes_sent_per_peer
    row = {
        "eval_loss": result.final_eval_loss,
        "bytes_per_worker": sum(sent) / len(sent),
        "peak_bytes_per_sync": float(result.peak_bytes_per_sync),
    }
    if job.outer or job.ef_decay != 1.0:
        row["note"] = f"outer lr {run.outer.lr:g}, momentum {run.outer.momentum:g}" + (
            f", EF decay {job.ef_decay:g}" if job.ef_decay != 1.0 else ""
        )
    if job.fragments > 1:
        row["note"] = f"{run.rounds.fragment_pattern} fragments"
    if job.slow_factor > 1:
        steps = [sum(r.steps[i] for r in result.rounds) for i in range(bench.workers)]
        row["note"] = f"inner steps per worker {steps}, weighted by samples"
    return row


# ---- torchft's DiLoCo, the external reference -------------------------------------------------


def run_torchft(bench: Bench, job: Job, ckpt: Optional[Path]) -> dict[str, Any]:
    """torchft 0.2.0's DiLoCo: a Lighthouse here, one replica group (one process) per worker.

    Fairness (shared/notes/torchft-diloco-facts.md): init_sync=False with the shared seed (the
    default would make the replicas copy one replica's weights at the first quorum), one outer
    optimizer per fragment, the same Nesterov lr / momentum and the same inner loop as LocalTrainer.
    """
    os.environ.setdefault("RUST_LOG", "error")  # read at import: torchft's Rust side logs every quorum
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        raise RowSkipped(f"torchft is not installed ({e}); run scripts/bench_setup.sh") from None
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=bench.workers)
    ctx = multiprocessing.get_context("spawn")
    results: "multiprocessing.Queue[tuple]" = ctx.Queue()
    procs = [
        ctx.Process(target=_torchft_replica, daemon=True, args=(i, bench, job, ckpt, lighthouse.address(), results))
        for i in range(bench.workers)
    ]
    try:
        for p in procs:
            p.start()
        done: dict[int, tuple] = {}
        deadline = time.monotonic() + 3600
        while len(done) < len(procs):
            try:
                item = results.get(timeout=5)
                done[item[0]] = item
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"torchft replica(s) {dead} exited with an error; its traceback is above.")
                if time.monotonic() > deadline:
                    raise RuntimeError("the torchft replicas did not finish within an hour.")
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    hashes = {item[2] for item in done.values()}
    full_syncs = bench.steps // job.H  # each fragment syncs once per H steps
    sizes = done[0][3]
    return {
        "eval_loss": done[0][1],
        "bytes_per_worker": full_syncs * ring_bytes(4 * sum(sizes), bench.workers),
        "peak_bytes_per_sync": ring_bytes(4 * max(sizes), bench.workers),
        "note": ("replicas agree" if len(hashes) == 1 else "replicas DISAGREE on θg") + "; bytes as a ring all-reduce",
    }


def _torchft_replica(
    index: int,
    bench: Bench,
    job: Job,
    ckpt: Optional[Path],
    lighthouse_addr: str,
    results: "multiprocessing.Queue[tuple]",
) -> None:
    torch.set_num_threads(bench.threads)
    logging.getLogger("torchft").setLevel(logging.ERROR)
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    run = bench.run_config()
    trainer = LocalTrainer(run, peer_index=index)  # the same model, shard, AdamW and warmup as Swarm's
    start_from(trainer, load_weights(ckpt, trainer.run))
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=bench.workers,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"bench{index}",
        lighthouse_addr=lighthouse_addr,
        hostname="127.0.0.1",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=900),
        connect_timeout=timedelta(seconds=60),
    )
    params = list(trainer.model.parameters())
    # torchft's model fragments are modules: one per Swarm "contiguous" fragment (for this model the
    # same blocks as the "strided" pattern the streaming rows use), holding the same Parameters.
    names = [(name, p.shape) for name, p in trainer.model.named_parameters()]
    fragments = []
    for indices in split_fragments(names, job.fragments, "contiguous"):
        holder = torch.nn.Module()
        for k, i in enumerate(indices):
            holder.register_parameter(f"p{k}", params[i])
        fragments.append(holder)
    # One outer optimizer per fragment: a shared one would also step the other fragments, whose
    # parameters still hold inner gradients.
    outer = [
        torch.optim.SGD(f.parameters(), lr=run.outer.lr, momentum=run.outer.momentum, nesterov=run.outer.nesterov)
        for f in fragments
    ]
    diloco = DiLoCo(
        manager,
        fragments,
        trainer.optimizer,
        outer,
        sync_every=job.H,
        backup_device=torch.device("cpu"),
        pin_memory=False,
    )
    with diloco:
        for _ in range(bench.steps):  # Swarm's own inner step; DiLoCo syncs in its optimizer hook
            trainer.train(1)
    # Evaluate θg, as the simulator does: with F > 1 the fragments synced before the last one hold
    # local progress; torchft keeps their global values in its backup copy and has no public
    # accessor for it (with F = 1 this restores what the model already holds).
    diloco._restore_parameters()
    final = [average.as_cpu_f32(p).clone() for p in params]
    sizes = [sum(params[i].numel() for i in idx) for idx in split_fragments(names, job.fragments, "contiguous")]
    results.put((index, _model_eval_loss(trainer), state_hash(final, []), sizes))
    manager.shutdown(wait=False)


# ---- running the rows -------------------------------------------------------------------------

RUNNERS = {
    "single": run_single,
    "ddp": run_ddp,
    "diloco": run_sim,
    "streaming": run_sim,
    "heterogeneous": run_sim,
    "torchft_diloco": run_torchft,
}


def run_job(bench: Bench, job: Job, ckpt: Optional[Path]) -> dict[str, Any]:
    """One row as a plain dict (dicts, not classes, cross the process pool)."""
    torch.set_num_threads(bench.threads)
    start, cpu_start = time.perf_counter(), time.process_time()
    row: dict[str, Any] = {
        "method": job.method,
        "codec": job.codec,
        "H": job.H,
        "fragments": job.fragments,
        "overlap": job.overlap,
        "error_feedback": job.error_feedback,
        "init": job.init,
        "label": job.label,
        "job": dataclasses.asdict(job),
    }
    try:
        row |= RUNNERS[job.method](bench, job, ckpt if job.init == "warm" else None)
    except RowSkipped as e:
        row |= {"eval_loss": None, "bytes_per_worker": None, "peak_bytes_per_sync": None, "note": f"skipped: {e}"}
    row["wall_s"] = round(time.perf_counter() - start, 1)
    # This process's CPU seconds: what the row costs on an idle core, whatever else shares the machine
    # (torchft's rows run in child processes, which this does not count).
    row["cpu_s"] = None if job.method == "torchft_diloco" else round(time.process_time() - cpu_start, 1)
    return row


def _pool_init(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)


def row_cache(bench: Bench) -> bench_record.RowCache:
    """The finished rows of runs with these settings, this code, corpus, torch, CPU kernels and threads.
    The code is swarm's layers and this script's functions that compute a row (edits elsewhere in the
    script, to its flags or tables, do not throw the cached rows away)."""
    env = bench_record.environment(bench.run_config().data, bench.threads, with_scripts=False)
    row_code = [
        Bench.run_config,
        load_weights,
        start_from,
        _model_eval_loss,
        ring_bytes,
        *RUNNERS.values(),
        _torchft_replica,
    ]
    env["row_code"] = hashlib.sha256("".join(inspect.getsource(f) for f in row_code).encode()).hexdigest()[:16]
    key = {"settings": _settings(bench), "env": env}
    if bench.grid.fragment_pattern != "strided":  # the streaming rows' split (strided: the keys made before it)
        key["fragment_pattern"] = bench.grid.fragment_pattern
    return bench_record.RowCache(bench.cache_dir, key)


def run_rows(
    bench: Bench, jobs: list[Job], *, parallel: int, verbose: bool, cache: Optional[bench_record.RowCache] = None
) -> tuple[list[dict], Optional[Path]]:
    """Runs ``jobs`` and returns their rows in ``jobs`` order, and the warm-start checkpoint.

    The simulator's rows run in a pool of ``parallel`` one-thread processes: the from-scratch rows
    start at once while the warm-start checkpoint trains (when it is not cached yet), the warm rows
    once it exists. torchft's rows run alone afterwards: each starts one process per worker.
    A row ``cache`` holds is not run again; each row finished is stored there at once.
    """
    rows: dict[Job, dict] = {}
    if cache is not None:
        _reuse_cached(rows, cache, [j for j in jobs if j.init == "scratch"], None)
    warm = [j for j in jobs if j.init == "warm"]
    with (
        RunProgress(len(jobs), what="rows", console=Console(stderr=True)) as progress,
        concurrent.futures.ProcessPoolExecutor(
            max_workers=max(1, parallel),
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_pool_init,
            initargs=(verbose,),
        ) as pool,
    ):
        ckpt: Optional[Path] = None
        ckpt_future = pool.submit(warm_checkpoint, bench) if warm else None
        pending = {pool.submit(run_job, bench, j, None): j for j in _pool_order(jobs, "scratch") if j not in rows}
        while pending or ckpt_future is not None:
            waiting = [*pending] + ([ckpt_future] if ckpt_future is not None else [])
            done, _ = concurrent.futures.wait(waiting, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                if fut is ckpt_future:
                    ckpt, ckpt_future = fut.result(), None
                    if cache is not None:
                        _reuse_cached(rows, cache, warm, ckpt)
                    pending |= {
                        pool.submit(run_job, bench, j, ckpt): j for j in _pool_order(jobs, "warm") if j not in rows
                    }
                else:
                    job = pending.pop(fut)
                    rows[job] = fut.result()
                    _finished(progress, rows, job, cache, ckpt)
        for job in jobs:
            if job.method == "torchft_diloco" and job not in rows:
                rows[job] = run_job(bench, job, ckpt if job.init == "warm" else None)
                _finished(progress, rows, job, cache, ckpt)
    return [rows[j] for j in jobs], ckpt


def _start(job: Job, ckpt: Optional[Path]) -> Optional[str]:
    """What a row starts from, for the row cache: the warm checkpoint's name (its key) or None."""
    return ckpt.name if job.init == "warm" and ckpt is not None else None


def _reuse_cached(rows: dict[Job, dict], cache: bench_record.RowCache, jobs: list[Job], ckpt: Optional[Path]) -> None:
    for job in jobs:
        row = cache.get(dataclasses.asdict(job), _start(job, ckpt))
        if row is not None:
            rows[job] = row | {"cached": True}


def _finished(
    progress: RunProgress, rows: dict[Job, dict], job: Job, cache: Optional[bench_record.RowCache], ckpt: Optional[Path]
) -> None:
    if cache is not None and rows[job]["eval_loss"] is not None:
        cache.put(dataclasses.asdict(job), _start(job, ckpt), rows[job])
    _show_row(progress, rows, job)


def _pool_order(jobs: list[Job], init: str) -> list[Job]:
    """The pool's jobs of one table, the single-worker rows (a quarter of the work) last."""
    pooled = [j for j in jobs if j.init == init and j.method != "torchft_diloco"]
    return sorted(pooled, key=lambda j: j.method == "single")


def _show_row(progress: RunProgress, rows: dict[Job, dict], job: Job) -> None:
    """A finished row: its line, and the progress over the rows (a bar on a terminal)."""
    row = rows[job]
    line = (
        f"{job.label}: {row.get('note')}"
        if row["eval_loss"] is None
        else f"{job.label}: eval loss {row['eval_loss']:.4f}, {row['wall_s']:.0f} s"
        + (" (cached)" if row.get("cached") else "")
    )
    if progress.live:
        progress.note(line)  # kept above the bar
    progress.update(len(rows), last=line)


def add_reductions(rows: list[dict], bench: Bench, param_count: int) -> None:
    """reduction_vs_ddp = DDP's bytes per worker (analytic, the same steps) / the row's."""
    ddp_bytes = ring_bytes(4 * param_count, bench.workers) * bench.steps
    for row in rows:
        sent = row["bytes_per_worker"]
        row["reduction_vs_ddp"] = round(ddp_bytes / sent, 1) if sent else None


# ---- the report -------------------------------------------------------------------------------


def _find(rows: list[dict], **match: Any) -> Optional[dict]:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()) and row["eval_loss"] is not None:
            return row
    return None


def _gap(row: dict, ref: dict) -> float:
    return (row["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]


def targets(rows: list[dict], bench: Bench) -> list[tuple[str, Optional[bool], str]]:
    """(target, met (None: not measured), the measured numbers) for the warm-start table."""
    out: list[tuple[str, Optional[bool], str]] = []
    h = bench.grid.reference_h
    ddp = _find(rows, method="ddp")
    diloco = _find(rows, method="diloco", codec="fp32", H=h, fragments=1)
    if ddp and diloco:
        gap = _gap(diloco, ddp)
        out.append(
            (
                f"DiLoCo H={h} fp32 within 2% of DDP at {h}x fewer bytes",
                gap <= 0.02,
                f"{gap:+.2%} at {diloco['reduction_vs_ddp']:.0f}x fewer bytes",
            )
        )
    else:
        out.append((f"DiLoCo H={h} fp32 within 2% of DDP", None, "DDP or DiLoCo row missing"))
    for row in rows:
        if row["method"] == "diloco" and row["codec"] == "int4" and row["eval_loss"] is not None:
            ref = _find(rows, method="diloco", codec="fp32", H=row["H"], fragments=1)
            if ref:
                gap, ratio = _gap(row, ref), ref["bytes_per_worker"] / row["bytes_per_worker"]
                out.append(
                    (
                        f"int4+EF H={row['H']} within 0.5% of fp32, 7-8x fewer bytes",
                        gap <= 0.005 and 7 <= ratio <= 8.01,
                        f"{gap:+.2%}, {ratio:.2f}x fewer bytes",
                    )
                )
    if ddp:
        far = [r for r in rows if r["reduction_vs_ddp"] and r["reduction_vs_ddp"] >= 1000 and r["method"] != "single"]
        if far:
            best = min(far, key=lambda r: r["eval_loss"])
            gap = _gap(best, ddp)
            out.append(
                (
                    ">=1000x fewer bytes than DDP at <=5% loss gap",
                    gap <= 0.05,
                    f"best: {best['method']} {best['codec']} H={best['H']}: {best['reduction_vs_ddp']:.0f}x, {gap:+.2%}",
                )
            )
        else:
            out.append((">=1000x fewer bytes than DDP at <=5% loss gap", None, "no row reaches 1000x"))
    plain_stream_h = _find(rows, method="streaming")
    if plain_stream_h:
        plain = _find(rows, method="diloco", codec="fp32", H=plain_stream_h["H"], fragments=1)
        for row in rows:
            if row["method"] == "streaming" and row["eval_loss"] is not None and plain:
                peak_ratio = plain["peak_bytes_per_sync"] / row["peak_bytes_per_sync"]
                gap = _gap(row, plain)
                out.append(
                    (
                        f"Streaming F={row['fragments']} tau={row['overlap']}: peak <= 1/3.5, loss <= +1%",
                        peak_ratio >= 3.5 and gap <= 0.01,
                        f"peak 1/{peak_ratio:.2f}, {gap:+.2%} vs DiLoCo H={row['H']}",
                    )
                )
    for ref in rows:
        if ref["method"] != "torchft_diloco" or ref["eval_loss"] is None:
            continue
        kind = "diloco" if ref["fragments"] == 1 else "streaming"
        ours = _find(rows, method=kind, codec="fp32", H=ref["H"], fragments=ref["fragments"], overlap=0)
        if ours:
            gap = _gap(ours, ref)
            out.append(
                (
                    f"our {kind} vs torchft (H={ref['H']}, F={ref['fragments']}) within 1%",
                    abs(gap) <= 0.01,
                    f"{gap:+.3%}",
                )
            )
    return out


def _fmt_bytes(n: Optional[float]) -> str:
    from swarm.app.status import format_bytes

    return "—" if n is None else format_bytes(n)


def print_tables(
    tables: list[tuple[str, list[dict]]], goals: list[tuple[str, Optional[bool], str]], *, stderr: bool
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=stderr)
    if not console.is_terminal:
        console.width = 170  # a log file: keep every column readable
    for title, rows in tables:
        ddp = _find(rows, method="ddp")
        table = Table(title=title)
        for col in (
            "method",
            "codec",
            "H",
            "F",
            "τ",
            "eval loss",
            "vs DDP",
            "bytes/worker",
            "reduction vs DDP",
            "peak bytes/sync",
            "wall s",
            "note",
        ):
            table.add_column(col, justify="left" if col in ("method", "codec", "note") else "right")
        for r in rows:
            loss = r["eval_loss"]
            table.add_row(
                r["method"],
                r["codec"] + ("+EF" if r["error_feedback"] else ""),
                str(r["H"] or "—"),
                str(r["fragments"]),
                str(r["overlap"]),
                "—" if loss is None else f"{loss:.4f}",
                "—" if loss is None or ddp is None else f"{_gap(r, ddp):+.2%}",
                _fmt_bytes(r["bytes_per_worker"]),
                "—" if r["reduction_vs_ddp"] is None else f"{r['reduction_vs_ddp']:,.0f}×",
                _fmt_bytes(r["peak_bytes_per_sync"]),
                f"{r['wall_s']:.0f}",
                r.get("note", ""),
            )
        console.print(table)
    goal_table = Table(title="Targets (warm start)")
    for col in ("target", "met", "measured"):
        goal_table.add_column(col)
    for name, met, measured in goals:
        goal_table.add_row(name, {True: "yes", False: "NO", None: "not measured"}[met], measured)
    console.print(goal_table)


# ---- the documented rows: recorded, pinned, checked -----------------------------------------

# A row short enough for a unit test (a few CPU seconds), pinned bit for bit in docs/bench_quality.json.
PINNED_JOB = Job(method="diloco", init="warm", H=5)


def pinned_row(cache_dir: Path) -> dict[str, Any]:
    """The pinned short row: 10 warm-up steps, then 2 workers x 10 steps of DiLoCo at H = 5 (2 syncs)."""
    bench = Bench(workers=2, steps=10, warm_steps=10, seed=0, threads=1, cache_dir=cache_dir, grid=Grid(eval_batches=2))
    ckpt = warm_checkpoint(bench)
    row = run_job(bench, PINNED_JOB, ckpt)
    return {
        "label": row["label"],
        "warm_eval_loss": json.loads(ckpt.with_suffix(".json").read_text())["eval_loss"],
        "eval_loss": row["eval_loss"],
        "bytes_per_worker": row["bytes_per_worker"],
    }


def _settings(bench: Bench) -> dict[str, Any]:
    return {
        "workers": bench.workers,
        "steps": bench.steps,
        "warm_steps": bench.warm_steps,
        "seed": bench.seed,
        "threads": bench.threads,
        "eval_batches": bench.grid.eval_batches,
    }


def record_rows(bench: Bench, rows: list[dict], ckpt: Path, *, command: str) -> None:
    """docs/bench_quality.json from this run's warm rows, and the docs table regenerated from it."""
    import tempfile

    meta = json.loads(ckpt.with_suffix(".json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        pinned = pinned_row(Path(tmp))
    keep = (*ROW_KEYS, "label", "job", "error_feedback", "note")
    env = bench_record.environment(bench.run_config().data, bench.threads)
    record = {
        "command": command,
        "settings": _settings(bench),
        "environment": env,
        "warm_start": {"eval_loss": meta["eval_loss"], "cpu_s": meta.get("cpu_s")},
        "rows": [{k: r.get(k) for k in keep} for r in rows],
        "pinned": pinned,
    }
    bench_record.write(bench_record.RECORD_PATH, record)
    if not bench_record.update_docs(record):
        log.warning("docs/BENCHMARKS.md has no generated-table markers; the table was not updated")
    log.warning("recorded %d rows in %s", len(rows), bench_record.RECORD_PATH)


def check_documented(
    *, parallel: int, verbose: bool, cache_dir: Path, record_path: Path = bench_record.RECORD_PATH
) -> int:
    """Re-run the documented warm-start rows; 0 when every one reproduces bit for bit, 1 when not."""
    record = bench_record.load(record_path)
    s = record["settings"]
    bench = Bench(
        workers=s["workers"],
        steps=s["steps"],
        warm_steps=s["warm_steps"],
        seed=s["seed"],
        threads=s["threads"],
        cache_dir=cache_dir,
        grid=Grid(eval_batches=s["eval_batches"]),
    )
    torch.set_num_threads(bench.threads)
    here = bench_record.environment(bench.run_config().data, bench.threads)
    differ = bench_record.bits_differ(record["environment"], here)
    if differ:
        sys.stderr.write(
            "cannot compare bit for bit on this machine (" + "; ".join(differ) + "): run"
            " scripts/bench_quality.py --record here to make its own reference.\n"
        )
        return 2
    jobs = [
        Job(**(r["job"] | {"outer": tuple(r["job"]["outer"]) if r["job"]["outer"] else None})) for r in record["rows"]
    ]
    rows, ckpt = run_rows(bench, jobs, parallel=parallel, verbose=verbose)  # no row cache: run them all
    bad, unchecked = bench_record.compare(record["rows"], rows)
    warm = json.loads(ckpt.with_suffix(".json").read_text())["eval_loss"] if ckpt else None
    if warm != record["warm_start"]["eval_loss"]:
        bad.insert(0, f"warm start: eval loss {warm!r} (documented {record['warm_start']['eval_loss']!r})")
    for line in bad:
        sys.stderr.write(f"DIFFERS: {line}\n")
    for label in unchecked:
        sys.stderr.write(f"not compared: {label}\n")
    sys.stderr.write(
        f"{len(rows) - len(unchecked) - len(bad)} of {len(record['rows'])} documented rows reproduce"
        " bit for bit" + ("" if not bad else "; the docs or the code need updating") + ".\n"
    )
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Held-out loss against bytes sent: DDP, DiLoCo, codecs,"
        " Streaming DiLoCo, heterogeneous workers, torchft.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--workers", type=int, default=4, help="N: workers (simulated peers, replica groups)")
    parser.add_argument("--steps", type=int, default=800, help="inner steps per worker and method (a multiple of 200)")
    parser.add_argument(
        "--warm-steps",
        type=int,
        default=1000,
        help="single-worker steps of the shared warm-start checkpoint (0: only from scratch)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument(
        "--codecs",
        help="comma-separated codecs of the DiLoCo codec sweep, with error feedback"
        " (default int4; with --full fp16,int8,int4; 'none' skips the sweep)",
    )
    parser.add_argument("--codec-h", help="comma-separated H of the codec sweep (default 50,100,200)")
    parser.add_argument(
        "--h-values", help="comma-separated H of the fp32 DiLoCo rows (default 10,50,100,200; 'none' skips them)"
    )
    parser.add_argument(
        "--codec-outer",
        help="LR,MOMENTUM of the codec rows' outer step (default: the run's 0.7,0.9);"
        " several separated by '/' (e.g. 0.7,0/1.0,0) make one row each",
    )
    parser.add_argument(
        "--ef-decay",
        help="comma-separated error-feedback decays β in (0, 1] of the codec rows (default 1: no decay), one row each",
    )
    parser.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="send the codec rows without error feedback (an ablation; the default keeps it on)",
    )
    parser.add_argument(
        "--keep-unsent-locally",
        action="store_true",
        help="codec rows: a peer restarts from θg minus its error-feedback residual instead of adding"
        " the residual to its next pseudo-gradient ([rounds] keep_unsent_locally)",
    )
    parser.add_argument(
        "--codec-fragments",
        type=int,
        default=1,
        help="codec rows: Streaming DiLoCo with this many fragments (no overlap; the pattern of"
        " --fragment-pattern); default 1, plain DiLoCo",
    )
    parser.add_argument(
        "--fragment-pattern",
        default="strided",
        choices=FRAGMENT_PATTERNS,
        help="[rounds] fragment_pattern of the streaming rows (default strided)",
    )
    parser.add_argument("--no-scratch", action="store_true", help="skip the from-scratch table (of --full, --quick)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="every row: also fp16 and int8, the sparse codecs"
        " (topk-int4 at 1/3/10%% density, H = 25/50/100) and the from-scratch table",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="re-run the rows docs/bench_quality.json documents and"
        " compare their eval loss bit for bit (exit 1 when one differs); other row flags are ignored",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="run every row, also those an earlier run with this code and these settings left in the cache",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="write this run's warm-start rows to"
        " docs/bench_quality.json and regenerate docs/BENCHMARKS.md's table from it",
    )
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run of every row kind")
    parser.add_argument("--jobs", type=int, default=2, help="rows run at once, one process each (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="run seed: initial weights and data order")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".bench_cache", help="warm-start checkpoint cache")
    parser.add_argument("--json", action="store_true", help="last stdout line: the warm-start rows as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every simulator round")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}.")
    if args.record and (args.quick or args.warm_steps <= 0):
        parser.error(
            "--record writes the documented warm-start rows: run it without --quick and with --warm-steps > 0."
        )
    if args.check:
        return check_documented(parallel=args.jobs, verbose=args.verbose, cache_dir=args.cache_dir)
    steps, warm_steps, grid = args.steps, args.warm_steps, FULL_GRID if args.full else Grid()
    if args.quick:
        steps, warm_steps, grid = QUICK_STEPS, min(warm_steps, QUICK_STEPS), QUICK_GRID
    if args.codecs is not None:
        from swarm.core.codecs.codec import get_codec

        codecs = tuple(c.strip() for c in args.codecs.split(",") if c.strip() and c.strip() != "none")
        for codec in codecs:
            try:
                get_codec(codec)
            except ValueError as e:
                parser.error(str(e))
        grid = dataclasses.replace(grid, codecs=codecs)
    for flag, field_name in (("codec_h", "codec_h"), ("h_values", "h_values")):
        value = getattr(args, flag)
        if value is not None:
            try:
                hs = tuple(int(h) for h in value.split(",") if h.strip() and h.strip() != "none")
            except ValueError:
                parser.error(f"--{flag.replace('_', '-')} takes comma-separated inner step counts, got {value!r}.")
            grid = dataclasses.replace(grid, **{field_name: hs})
    if args.codec_outer:
        try:
            outers = tuple(tuple(float(v) for v in pair.split(",")) for pair in args.codec_outer.split("/"))
            if any(len(pair) != 2 for pair in outers):
                raise ValueError
        except ValueError:
            parser.error(
                f"--codec-outer takes LR,MOMENTUM (several separated by '/'), e.g. 1.0,0, got {args.codec_outer!r}."
            )
        grid = dataclasses.replace(grid, codec_outers=outers)
    if args.ef_decay:
        try:
            decays = tuple(float(v) for v in args.ef_decay.split(","))
            if not all(0.0 < d <= 1.0 for d in decays):
                raise ValueError
        except ValueError:
            parser.error(f"--ef-decay takes comma-separated decays in (0, 1], e.g. 0.9,0.95, got {args.ef_decay!r}.")
        grid = dataclasses.replace(grid, ef_decays=decays)
    grid = dataclasses.replace(
        grid,
        fragment_pattern=args.fragment_pattern,
        codec_error_feedback=not args.no_error_feedback,
        keep_unsent_locally=args.keep_unsent_locally,
        codec_fragments=args.codec_fragments,
    )
    if args.codec_fragments < 1:
        parser.error(f"--codec-fragments must be at least 1 (1: plain DiLoCo), got {args.codec_fragments}.")
    if args.workers < 2:
        parser.error("--workers must be at least 2: the methods differ only with several workers.")
    bench = Bench(
        workers=args.workers,
        steps=steps,
        warm_steps=warm_steps,
        seed=args.seed,
        threads=args.threads,
        cache_dir=args.cache_dir,
        grid=grid,
    )
    torch.set_num_threads(bench.threads)
    started = time.perf_counter()
    scratch = warm_steps == 0 or (grid.scratch and not args.no_scratch)
    inits = (["warm"] if warm_steps > 0 else []) + (["scratch"] if scratch else [])
    try:
        jobs = [job for init in inits for job in plan(bench, methods, init=init)]
        rows, ckpt = run_rows(
            bench, jobs, parallel=args.jobs, verbose=args.verbose, cache=None if args.fresh else row_cache(bench)
        )
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    param_count = swarm_model.build_model(bench.run_config().model, seed=0).param_count()
    add_reductions(rows, bench, param_count)
    tables: list[tuple[str, list[dict]]] = []
    for init in inits:
        title = (
            f"{'Warm start' if init == 'warm' else 'From scratch'}: {bench.workers} workers x "
            f"{bench.steps} steps, batch 8x128, {param_count:,} parameters"
            + (f", after {warm_steps} single-worker steps" if init == "warm" else "")
        )
        tables.append((title, [r for r in rows if r["init"] == init]))
    goals = targets(tables[0][1], bench) if tables and inits[0] == "warm" else []
    print_tables(tables, goals, stderr=args.json)
    log.warning("total %.0f s", time.perf_counter() - started)
    if args.record and ckpt is not None:
        args_given = list(sys.argv[1:] if argv is None else argv)
        if "--cache-dir" in args_given:  # a local path: not part of what the rows depend on
            at = args_given.index("--cache-dir")
            del args_given[at : at + 2]
        record_rows(
            bench,
            [r for r in rows if r["init"] == "warm"],
            ckpt,
            command="scripts/bench_quality.py " + " ".join(args_given),
        )
    if args.json:
        sys.stdout.write(
            json.dumps([{k: r.get(k) for k in (*ROW_KEYS, "label", "error_feedback", "note")} for r in tables[0][1]])
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
