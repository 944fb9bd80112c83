"""Download rate and memory of a state transfer at a real model size, and the time to write and read a vote.

Two real hivemind transports over loopback, in two processes: this one downloads, a child it starts serves.
The state is GPT-2 small's (124M parameters, as ``transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12,
vocab_size=50257)`` makes them) plus a Nesterov momentum of the same shapes: ~1 GB of fp32. No model is built:
the tensors are random, and the downloader's ``like`` state is made of zero-strided views that take no memory.

    .venv/bin/python scripts/bench_state_transfer.py --json
    .venv/bin/python scripts/bench_state_transfer.py --scale 0.1      # a tenth of the elements per tensor

Memory is each process's peak RSS (VmHWM, reset before the measured part) minus its RSS before it: the serving
side from publish to the end of the download, the downloading side during the download (the state it returns
included: ~1 GB), the vote's write and read likewise. ``*_p2pd_rss_added`` is the same for the p2p daemons (and
the DHT processes) under each side; ``*_cpu_s`` the CPU time of each side (with its daemons) meanwhile, a
number that a loaded machine changes less than the rate. Prints one JSON object with --json, else one line per number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

RUN_ID = "bench-state"
ROUND = 3


def gpt2_small_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes in ``model.parameters()`` order (tied embeddings: wte once); ``scale``
    shrinks the first dimension of each matrix (and the vocabulary) for quick runs."""
    n_embd, n_layer, vocab, n_pos = 768, 12, 50257, 1024

    def rows(n: int) -> int:
        return max(1, int(n * scale))

    shapes: list[tuple[int, ...]] = [(rows(vocab), n_embd), (rows(n_pos), n_embd)]
    for _ in range(n_layer):
        shapes += [(n_embd,), (n_embd,), (rows(n_embd), 3 * n_embd), (3 * n_embd,), (rows(n_embd), n_embd), (n_embd,),
                   (n_embd,), (n_embd,), (rows(n_embd), 4 * n_embd), (4 * n_embd,), (rows(4 * n_embd), n_embd), (n_embd,)]
    return shapes + [(n_embd,), (n_embd,)]


def _status_kb(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        out += [int(c) for c in children]
        todo += [int(c) for c in children]
    return out


def _cpu_s(pids) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


class PeakRSS:
    """Peak RSS added by a stretch of work, in bytes: this process, and its descendants (the DHT process and its
    p2p daemon) together."""

    def __init__(self) -> None:
        self.pids = _descendants(os.getpid())
        for pid in ["self", *self.pids]:
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            except OSError:
                pass
        self.before = _status_kb("self", "VmRSS")
        self.before_children = {p: _status_kb(p, "VmRSS") for p in self.pids}
        self.cpu_before = _cpu_s(["self", *self.pids])

    def cpu_s(self) -> float:
        """CPU seconds (user + system) this process and its descendants spent since."""
        return round(_cpu_s(["self", *self.pids]) - self.cpu_before, 3)

    def added(self) -> tuple[int, int]:
        own = _status_kb("self", "VmHWM") - self.before
        children = sum(max(0, _status_kb(p, "VmHWM") - rss) for p, rss in self.before_children.items())
        return own * 1024, children * 1024


def make_state(shapes, seed: int):
    from swarm.core.state import GlobalState

    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    outer = [torch.randn(s, generator=generator) * 0.01 for s in shapes]
    return GlobalState(ROUND, params, outer)


def like_state(shapes):
    """A state of these shapes whose tensors take no memory (zero strides): enough to check a download against."""
    from swarm.core.state import GlobalState

    zero = torch.zeros(1)
    views = [zero.expand(s) for s in shapes]
    return GlobalState(0, views, list(views))


def serve(args: argparse.Namespace) -> None:
    from testbed.members import make_member

    from swarm.core.trust.credential import PeerKey
    from swarm.net.bulk.state_transfer import StateServer
    from swarm.net.bulk.transport import Transport

    coordinator = PeerKey.load_or_create(args.coordinator_key)
    state = make_state(gpt2_small_shapes(args.scale), args.seed)
    state.state_hash  # computed once, before the measurement
    transport = Transport(initial_peers=[])
    server = StateServer(transport, run_id=RUN_ID, member=make_member(coordinator, RUN_ID, transport.peer_id))
    peak = PeakRSS()
    server.publish(state)
    print(json.dumps({"peer_id": transport.peer_id, "maddrs": transport.visible_maddrs,
                      "state_hash": state.state_hash}), flush=True)
    sys.stdin.readline()  # the download is over
    own, children = peak.added()
    print(json.dumps({"serve_rss_added": own, "serve_p2pd_rss_added": children, "serve_cpu_s": peak.cpu_s()}),
          flush=True)
    transport.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink each matrix's rows by this factor")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where the vote is written (default: a temporary directory)")
    parser.add_argument("--window", type=int, default=None, help="requests in flight per holder (default: the module's)")
    parser.add_argument("--chunk-mib", type=float, default=None, help="bytes per request, MiB (default: the module's)")
    parser.add_argument("--frame-mib", type=float, default=None,
                        help="bytes per request over the bulk channel, MiB (default: the module's)")
    parser.add_argument("--no-bulk", action="store_true", help="every byte over libp2p (no bulk channel)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-key", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)

    from testbed.members import make_member

    from peer.state.checkpoint import load_checkpoint
    from peer.state.resume import save_vote, vote_dir
    from swarm.core.state import state_from_tensors
    from swarm.core.trust.credential import PeerKey
    from swarm.net.bulk import state_transfer
    from swarm.net.bulk.state_transfer import download_state
    from swarm.net.bulk.transport import Transport

    if args.window is not None:
        state_transfer.WINDOW = args.window
    if args.chunk_mib is not None:
        state_transfer.CHUNK_BYTES = int(args.chunk_mib * (1 << 20))
    if args.frame_mib is not None:
        state_transfer.BULK_FRAME_BYTES = int(args.frame_mib * (1 << 20))
    if args.no_bulk:
        state_transfer.USE_BULK = False
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        key_path = Path(tmp) / "coordinator.pem"
        coordinator = PeerKey.load_or_create(key_path)
        child = subprocess.Popen([sys.executable, __file__, "--serve", "--coordinator-key", str(key_path),
                                  "--scale", str(args.scale), "--seed", str(args.seed)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        transport = None
        try:
            hello = json.loads(child.stdout.readline())
            transport = Transport(initial_peers=hello["maddrs"])
            member = make_member(coordinator, RUN_ID, transport.peer_id)
            shapes = gpt2_small_shapes(args.scale)
            like = like_state(shapes)
            peak = PeakRSS()
            start = time.perf_counter()
            state, nbytes = download_state(transport, member=member, run_id=RUN_ID, holders=[hello["peer_id"]],
                                           round_no=ROUND, expected_hash=hello["state_hash"], like=like, timeout_s=600)
            seconds = time.perf_counter() - start
            download_rss, download_p2pd_rss = peak.added()
            download_cpu = peak.cpu_s()
            child.stdin.write("done\n")
            child.stdin.flush()
            served = json.loads(child.stdout.readline())

            peak = PeakRSS()
            start = time.perf_counter()
            save_vote(Path(tmp), state, run_id=RUN_ID)
            write_s = time.perf_counter() - start
            write_rss = peak.added()[0]
            del state
            peak = PeakRSS()
            start = time.perf_counter()
            tensors, manifest = load_checkpoint(vote_dir(Path(tmp), ROUND))
            loaded = state_from_tensors(tensors, ROUND, like=like)
            read_s = time.perf_counter() - start
            read_rss = peak.added()[0]
            assert loaded.state_hash == hello["state_hash"] == manifest["state_hash"]
        finally:
            if transport is not None:
                transport.shutdown()
            child.stdin.close()
            child.wait(timeout=60)

    result = {"params": sum(torch.Size(s).numel() for s in shapes), "bytes": nbytes, "seconds": round(seconds, 3),
              "MB_per_s": round(nbytes / seconds / 1e6, 1), **served, "download_rss_added": download_rss,
              "download_p2pd_rss_added": download_p2pd_rss, "download_cpu_s": download_cpu, "checkpoint_write_s": round(write_s, 3),
              "checkpoint_read_s": round(read_s, 3), "checkpoint_write_rss_added": write_rss,
              "checkpoint_read_rss_added": read_rss, "loadavg": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
