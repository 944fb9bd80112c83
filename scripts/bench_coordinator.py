"""Load-test the coordinator: N simulated peers over real gRPC (pinned TLS) against a real coordinator.

The coordinator runs in a child process (so its CPU time is measured on its own); the peers are
grpc.aio clients in this one process: each joins, heartbeats every second and, with ``--rounds``,
reports every round it is planned into; a status poll runs once a second.  Latencies are measured
after every peer joined.  Run it as

    python scripts/bench_coordinator.py --peers 2000 --seconds 30 --json

and the last stdout line is one JSON object (peers, rpc_p50_ms, rpc_p99_ms, errors, coordinator_cpu_s, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.control import tls  # noqa: E402
from swarm.control.joinstring import JoinString  # noqa: E402
from swarm.v1 import coordinator_pb2 as pb  # noqa: E402
from swarm.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402

REQUEST_TIMEOUT_S = 10.0
INITIAL_HASH = "0" * 64


# --- the coordinator, in a child process --------------------------------------------------------------

def serve(state_dir: Path) -> None:
    """Child process: run a coordinator until stdin closes; print its join string first."""
    from coordinator.server import CoordinatorServer
    from swarm.config import RoundConfig, RunConfig

    logging.basicConfig(level=logging.WARNING)
    server = CoordinatorServer(run=RunConfig(rounds=RoundConfig(min_peers=1)), state_dir=state_dir,
                               heartbeat_interval_s=1.0)
    print(f"join: {server.start()}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


# --- the per-call client: the one function to swap for signed calls ------------------------------------

Call = Callable[[pb_grpc.CoordinatorStub, str, Any], Awaitable[Any]]


async def plain_call(stub: pb_grpc.CoordinatorStub, method: str, request: Any) -> Any:
    """One RPC as a peer sends it today (no per-call signature)."""
    return await getattr(stub, method)(request, timeout=REQUEST_TIMEOUT_S)


def aio_channel(join: JoinString) -> grpc.aio.Channel:
    cert_pem = tls.fetch_certificate(join.host, join.port, timeout_s=REQUEST_TIMEOUT_S)
    if tls.fingerprint(cert_pem) != join.fingerprint:
        raise SystemExit("the coordinator presented a certificate the join string does not pin")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    return grpc.aio.secure_channel(join.address, credentials,
                                   options=[("grpc.ssl_target_name_override", tls.SERVER_NAME)])


# --- the load ------------------------------------------------------------------------------------------

class Load:
    def __init__(self, stub: pb_grpc.CoordinatorStub, join: JoinString, call: Call, *, rounds: bool,
                 train_s: float) -> None:
        self.stub, self.join, self.call, self.rounds, self.train_s = stub, join, call, rounds, train_s
        self.latencies_ms: list[float] = []
        self.by_method: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.measuring = False
        self.stop = asyncio.Event()
        self.reports = 0

    async def timed(self, method: str, request: Any) -> Any:
        started = time.perf_counter()
        try:
            response = await self.call(self.stub, method, request)
        except grpc.aio.AioRpcError as e:
            if self.measuring:
                key = f"{method}: {e.code().name}"
                self.errors[key] = self.errors.get(key, 0) + 1
            return None
        if self.measuring:
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
            self.by_method.setdefault(method, []).append(self.latencies_ms[-1])
        return response

    async def peer(self, index: int, joined: asyncio.Queue) -> None:
        response = None
        while response is None and not self.stop.is_set():
            response = await self.timed("Join", pb.JoinRequest(token=self.join.token, name=f"bench-{index}"))
        if response is None:
            return
        peer_id = response.peer_id
        await joined.put(peer_id)
        state_round, state_hash, reported = 0, INITIAL_HASH, 0
        planned_at: dict[int, float] = {}  # round -> when this peer first saw itself planned into it
        await asyncio.sleep(random.random())  # spread the heartbeats over the second
        while not self.stop.is_set():
            metrics = pb.PeerMetrics(state=pb.PEER_STATE_READY if self.rounds else pb.PEER_STATE_JOINING,
                                     state_round=state_round, state_hash=state_hash, model_fingerprint="bench",
                                     param_count=1000, dht_peer_id=f"dht-{index}")
            beat = await self.timed("Heartbeat", pb.HeartbeatRequest(peer_id=peer_id, metrics=metrics))
            if beat is not None and self.rounds:
                info = beat.round
                if info.last_committed_round > state_round:
                    state_round, state_hash = info.last_committed_round, info.last_committed_hash
                planned = info.open_round > reported and info.round == info.open_round and peer_id in info.participants
                if planned and planned_at.setdefault(info.open_round, time.monotonic()) + self.train_s <= time.monotonic():
                    reported = info.open_round
                    await self.timed("ReportRound", pb.ReportRoundRequest(
                        peer_id=peer_id, round=reported, ok=True, state_hash=f"h{reported}",
                        group=list(info.participants), inner_steps=10, samples=10, loss=2.0))
                    self.reports += 1
            await asyncio.sleep(1.0)

    async def status(self) -> None:
        while not self.stop.is_set():
            await self.timed("GetStatus", pb.GetStatusRequest(token=self.join.token))
            await asyncio.sleep(1.0)


async def run_load(join: JoinString, *, peers: int, seconds: float, rounds: bool, train_s: float,
                   child: psutil.Process, call: Call = plain_call) -> dict:
    channel = aio_channel(join)
    load = Load(pb_grpc.CoordinatorStub(channel), join, call, rounds=rounds, train_s=train_s)
    joined: asyncio.Queue = asyncio.Queue()
    tasks = []
    join_started = time.perf_counter()
    for i in range(peers):
        tasks.append(asyncio.create_task(load.peer(i, joined)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # joins come in waves, not all in one instant
    for _ in range(peers):
        await joined.get()
    join_s = time.perf_counter() - join_started
    tasks.append(asyncio.create_task(load.status()))
    await asyncio.sleep(2.0)  # let the heartbeats spread out
    me = psutil.Process()
    cpu_before, load_cpu_before = sum(child.cpu_times()[:2]), sum(me.cpu_times()[:2])
    load.measuring = True
    await asyncio.sleep(seconds)
    load.measuring = False
    cpu_s = sum(child.cpu_times()[:2]) - cpu_before
    load_cpu_s = sum(me.cpu_times()[:2]) - load_cpu_before
    load.stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    final = (await load.call(load.stub, "GetStatus", pb.GetStatusRequest(token=join.token))).run
    await channel.close()
    latencies = sorted(load.latencies_ms)
    return {
        "peers": peers, "seconds": seconds, "rounds": rounds, "rpcs": len(latencies),
        "rpc_p50_ms": round(_percentile(latencies, 50), 2), "rpc_p99_ms": round(_percentile(latencies, 99), 2),
        "rpc_max_ms": round(latencies[-1], 2) if latencies else 0.0,
        "p99_ms_by_method": {m: round(_percentile(sorted(v), 99), 2) for m, v in load.by_method.items()},
        "errors": sum(load.errors.values()), "error_kinds": load.errors,
        "coordinator_cpu_s": round(cpu_s, 2),
        "coordinator_cpu_ms_per_rpc": round(1000 * cpu_s / max(1, len(latencies)), 3),
        "load_generator_cpu_s": round(load_cpu_s, 2), "join_s": round(join_s, 2), "reports": load.reports,
        "rounds_committed": final.rounds_committed, "rounds_voided": final.rounds_voided,
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=500, help="simulated peers")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to measure once all joined")
    parser.add_argument("--rounds", action="store_true",
                        help="peers are ready and report every round they are planned into (default: they stay joining)")
    parser.add_argument("--train-s", type=float, default=5.0,
                        help="with --rounds: how long a peer 'trains' after it sees itself planned, before it reports")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    with tempfile.TemporaryDirectory(prefix="bench-coordinator-") as state_dir:
        child = subprocess.Popen([sys.executable, __file__, "--serve", state_dir], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            line = child.stdout.readline()
            if not line.startswith("join: "):
                raise SystemExit(f"the coordinator did not start (it printed {line!r})")
            join = JoinString.parse(line.removeprefix("join: "))
            result = asyncio.run(run_load(join, peers=args.peers, seconds=args.seconds, rounds=args.rounds,
                                          train_s=args.train_s, child=psutil.Process(child.pid)))
        finally:
            child.stdin.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
