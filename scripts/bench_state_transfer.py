"""Download rate and memory of a state transfer at a real model size, and the time to write and read a vote.

Two real hivemind transports over loopback, in two processes: this one downloads, a child it starts serves. With
``--testbed-mbit M`` (root) the two run on two hosts of the WAN testbed (``scripts/testbed``) whose links are shaped to
M Mbit/s each way, and ``link_share`` says what share of the link's rate the download got.
The state is GPT-2 small's (124M parameters, as ``transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12,
vocab_size=50257)`` makes them) plus a Nesterov momentum of the same shapes: ~1 GB of fp32. No model is built:
the tensors are random, and the downloader's ``like`` state is made of zero-strided views that take no memory.

    .venv/bin/python scripts/bench_state_transfer.py --json
    .venv/bin/python scripts/bench_state_transfer.py --scale 0.1      # a tenth of the elements per tensor
    .venv/bin/python scripts/bench_state_transfer.py --testbed-mbit 1000 --json   # across testbed hosts at 1 Gbit/s

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
TESTBED_PREFIX = "swst-"  # the namespaces this benchmark's testbed creates (and removes)


def gpt2_small_shapes(scale: float = 1.0) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes in ``model.parameters()`` order (tied embeddings: wte once); ``scale``
    shrinks the first dimension of each matrix (and the vocabulary) for quick runs."""
    n_embd, n_layer, vocab, n_pos = 768, 12, 50257, 1024

    def rows(n: int) -> int:
        return max(1, int(n * scale))

    shapes: list[tuple[int, ...]] = [(rows(vocab), n_embd), (rows(n_pos), n_embd)]
    for _ in range(n_layer):
        shapes += [
            (n_embd,),
            (n_embd,),
            (rows(n_embd), 3 * n_embd),
            (3 * n_embd,),
            (rows(n_embd), n_embd),
            (n_embd,),
            (n_embd,),
            (n_embd,),
            (rows(n_embd), 4 * n_embd),
            (4 * n_embd,),
            (rows(4 * n_embd), n_embd),
            (n_embd,),
        ]
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
    from swarm.net.bulk.state_server import StateServer
    from swarm.net.bulk.transport import Transport

    coordinator = PeerKey.load_or_create(args.coordinator_key)
    state = make_state(gpt2_small_shapes(args.scale), args.seed)
    state.state_hash  # computed once, before the measurement
    transport = Transport(initial_peers=[], host=args.p2p_host)
    server = StateServer(transport, run_id=RUN_ID, member=make_member(coordinator, RUN_ID, transport.peer_id))
    peak = PeakRSS()
    server.publish(state)
    print(
        json.dumps({"peer_id": transport.peer_id, "maddrs": transport.visible_maddrs, "state_hash": state.state_hash}),
        flush=True,
    )
    sys.stdin.readline()  # the download is over
    own, children = peak.added()
    print(
        json.dumps({"serve_rss_added": own, "serve_p2pd_rss_added": children, "serve_cpu_s": peak.cpu_s()}), flush=True
    )
    transport.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink each matrix's rows by this factor")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where the vote is written (default: a temporary directory)")
    parser.add_argument(
        "--window", type=int, default=None, help="requests in flight per holder (default: the module's)"
    )
    parser.add_argument("--chunk-mib", type=float, default=None, help="bytes per request, MiB (default: the module's)")
    parser.add_argument(
        "--frame-mib",
        type=float,
        default=None,
        help="bytes per request over the bulk channel, MiB (default: the module's)",
    )
    parser.add_argument("--no-bulk", action="store_true", help="every byte over libp2p (no bulk channel)")
    parser.add_argument(
        "--testbed-mbit",
        type=float,
        default=None,
        help="run the two sides on two WAN-testbed hosts with links of this rate (root)",
    )
    parser.add_argument("--serve-prefix", default="[]", help=argparse.SUPPRESS)  # JSON argv the serving side runs under
    parser.add_argument("--serve-host", default=None, help=argparse.SUPPRESS)  # the serving side's listening address
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--p2p-host", default="127.0.0.1", help=argparse.SUPPRESS)  # each side's listening address
    parser.add_argument("--coordinator-key", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.testbed_mbit is not None:
        return across_testbed(args)

    from testbed.members import make_member

    from peer.state.checkpoint import load_checkpoint
    from peer.state.votes import save_vote, vote_dir
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
        child = subprocess.Popen(
            [
                *json.loads(args.serve_prefix),
                sys.executable,
                __file__,
                "--serve",
                "--coordinator-key",
                str(key_path),
                "--scale",
                str(args.scale),
                "--seed",
                str(args.seed),
                "--p2p-host",
                args.serve_host or args.p2p_host,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        transport = None
        try:
            hello = json.loads(child.stdout.readline())
            transport = Transport(initial_peers=hello["maddrs"], host=args.p2p_host)
            member = make_member(coordinator, RUN_ID, transport.peer_id)
            shapes = gpt2_small_shapes(args.scale)
            like = like_state(shapes)
            peak = PeakRSS()
            start = time.perf_counter()
            state, nbytes = download_state(
                transport,
                member=member,
                run_id=RUN_ID,
                holders=[hello["peer_id"]],
                round_no=ROUND,
                expected_hash=hello["state_hash"],
                like=like,
                timeout_s=600,
            )
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

    result = {
        "params": sum(torch.Size(s).numel() for s in shapes),
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "MB_per_s": round(nbytes / seconds / 1e6, 1),
        **served,
        "download_rss_added": download_rss,
        "download_p2pd_rss_added": download_p2pd_rss,
        "download_cpu_s": download_cpu,
        "checkpoint_write_s": round(write_s, 3),
        "checkpoint_read_s": round(read_s, 3),
        "checkpoint_write_rss_added": write_rss,
        "checkpoint_read_rss_added": read_rss,
        "loadavg": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def across_testbed(args: argparse.Namespace) -> None:
    """This benchmark with its downloading side on testbed host h0 and its serving side on h1, both links shaped to
    ``--testbed-mbit``; prints what the download printed, with the link's rate and the share of it the download got."""
    from testbed import Testbed, make_topology, missing_privileges

    if args.testbed_mbit <= 0:
        sys.exit(f"--testbed-mbit must be a positive rate in Mbit/s, got {args.testbed_mbit}.")
    missing = missing_privileges(nat=False)
    if missing:
        sys.exit(f"--testbed-mbit needs the WAN testbed: {missing}")
    argv, value_next = [], False  # this run's arguments without --testbed-mbit (and its value)
    for arg in sys.argv[1:]:
        if not value_next and not arg.startswith("--testbed-mbit"):
            argv.append(arg)
        value_next = arg == "--testbed-mbit"
    with Testbed(make_topology(hosts=2, mbit=args.testbed_mbit, prefix=TESTBED_PREFIX)) as bed:
        out = bed.run(
            "h0",
            [
                sys.executable,
                __file__,
                *argv,
                "--json",
                "--p2p-host",
                bed.address("h0"),
                "--serve-prefix",
                json.dumps(bed.exec_argv("h1", [])),
                "--serve-host",
                bed.address("h1"),
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
    if out.returncode != 0:
        sys.exit(f"the download across the testbed failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["link_mbit_s"] = args.testbed_mbit
    result["link_share"] = round(result["MB_per_s"] * 8 / args.testbed_mbit, 3)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
