"""Load-test the coordinator: N simulated peers over real gRPC (pinned TLS) against a real coordinator.

The coordinator runs in a child process (so its CPU time is measured on its own); the peers are
grpc.aio clients in this one process.  Each joins as a real peer does (a Challenge, then a Join signed
by its own Ed25519 key and by a libp2p RSA key), then heartbeats at the coordinator's pace (the interval of
the Join's answer, then of each Heartbeat's: ``coordinator.pace``) and, with ``--rounds``, polls the current
round at the pace's poll interval while it waits to be planned or for a decision (not while it trains, as a real
peer does not) and reports every round it is planned into once ``--train-s`` passed; every member call is signed in its metadata (swarm.control.signing). A
status poll (one page) runs once a second.  Latencies are measured after every peer joined.

A report names the group its peer "averaged" with, as matchmaking forms one: the peers that saw themselves
planned before the round's first report went out (a planned peer that saw it later was left behind and reports a
failure); a group of more than MAX_GROUP (the most a report names) goes as its digest and size, as a real peer
reports it. A round of more than 256 participants
names only the requester in its answer (``coordinator.rounds.info_cache``), so the group is gathered here.

Two shortcuts, both outside what is measured: the peers share a small pool of libp2p identities
(``--libp2p-identities``; making an RSA key takes a while, and the coordinator keys members by their
Ed25519 key, not by their libp2p id), and the coordinator started here takes joins from this one
address without its usual rate limits (BENCH_JOIN_LIMITS; the defaults would make 2,000 joins from one
address take half an hour).  Run it as

    python scripts/bench_coordinator.py --peers 2000 --seconds 30 --json

and the last stdout line is one JSON object (peers, calls_per_s, rpc_p50_ms, rpc_p99_ms, p50/p99 by method,
errors, evictions, coordinator_cpu_s, coordinator CPU ms per peer-second, the pace the peers followed, the
machine's load average, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import grpc
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from swarm.control import signing, tls  # noqa: E402
from swarm.control.joinstring import JoinString  # noqa: E402
from swarm.core.trust import commit_rule  # noqa: E402
from swarm.core.trust.credential import PeerKey  # noqa: E402
from swarm.core.trust.round_vote import group_id  # noqa: E402
from swarm.v1 import coordinator_pb2 as pb  # noqa: E402
from swarm.v1 import coordinator_pb2_grpc as pb_grpc  # noqa: E402

REQUEST_TIMEOUT_S = 10.0
SETTLE_MAX_S = 30.0  # after the joins, the longest wait before measuring
# a real peer has a connection of its own; one connection carrying thousands of peers' calls holds calls back in
# its HTTP/2 streams whenever many are in flight at once, which no coordinator sees
PEERS_PER_CONNECTION = 100
OWN_POLL_S = 0.2  # a real peer's own poll interval (peer.options), which the coordinator's pace may lengthen
SLOW_MS = 100.0  # a call slower than the target p99
LAG_TICK_S = 0.01  # the load generator measures its own loop every so often
UNLIMITED = 1_000_000  # joins per second and burst: no join of this benchmark waits for a rate limit
MAX_GROUP = commit_rule.NAMED_GROUP_MAX  # peer ids a report names; a larger group: its digest and size


# --- the coordinator, in a child process --------------------------------------------------------------


def serve(state_dir: Path) -> None:
    """Child process: run a coordinator until stdin closes; print its join string first."""
    from coordinator.api.rate_limit import JoinLimits, Rate
    from coordinator.server import CoordinatorServer
    from swarm.config import RoundConfig, RunConfig

    logging.basicConfig(level=logging.WARNING)
    many = Rate(per_s=UNLIMITED, burst=UNLIMITED)  # all the simulated peers join from this one address
    server = CoordinatorServer(
        run=RunConfig(rounds=RoundConfig(min_peers=1)),
        state_dir=state_dir,
        heartbeat_interval_s=1.0,
        join_limits=JoinLimits(challenges_per_address=many, joins_per_address=many, joins_per_token=many),
    )
    print(f"join: {server.start()}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()


# --- the per-call client -------------------------------------------------------------------------------


def libp2p_pool(size: int, directory: Path) -> list[Any]:
    """``size`` libp2p identities for the simulated peers to share (each takes an RSA key generation)."""
    from swarm.net.link.libp2p_identity import Libp2pIdentity  # hivemind: only the load generator needs it

    return [Libp2pIdentity.create(directory / f"p2p-{i}.key") for i in range(max(1, size))]


def aio_channel(join: JoinString) -> grpc.aio.Channel:
    cert_pem = tls.fetch_certificate(join.host, join.port, timeout_s=REQUEST_TIMEOUT_S)
    if tls.fingerprint(cert_pem) != join.fingerprint:
        raise SystemExit("the coordinator presented a certificate the join string does not pin")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
    return grpc.aio.secure_channel(
        join.address,
        credentials,
        options=[("grpc.ssl_target_name_override", tls.SERVER_NAME), ("grpc.use_local_subchannel_pool", 1)],
    )  # a connection of its own


# --- the load ------------------------------------------------------------------------------------------


class Load:
    def __init__(
        self, stubs: list[pb_grpc.CoordinatorStub], join: JoinString, libp2p: list[Any], *, rounds: bool, train_s: float
    ) -> None:
        self.stubs, self.join, self.libp2p, self.rounds, self.train_s = stubs, join, libp2p, rounds, train_s
        self.latencies_ms: list[float] = []
        self.slow_at: list[float] = []  # when (s into the measurement) each call over SLOW_MS started
        self.loop_lag_ms: list[float] = []  # how late this process's own loop woke a LAG_TICK_S sleep
        self.measure_started = 0.0
        self.sign_ms: list[float] = []  # the client's signing of each measured call, included in its latency
        self.by_method: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.evicted: set[str] = set()  # peers told they were evicted (counted whenever it happens)
        self.intervals_s: list[float] = []  # the heartbeat interval the coordinator set, as last heard by each peer
        self.poll_s = OWN_POLL_S  # the poll interval the last RoundInfo set
        self.measuring = False
        self.stop = asyncio.Event()
        self.reports = 0
        self.posted: dict[int, list[str]] = {}  # round -> the peers that saw themselves planned, in that order
        # round -> the group its reports name: its members, as a set and, for a group too large to name, its digest
        self.groups: dict[int, tuple[list[str], frozenset[str], str]] = {}

    async def timed(
        self, method: str, request: Any, signer: Optional[signing.CallSigner] = None, *, peer: int = 0
    ) -> Any:
        """One RPC of simulated peer ``peer`` (on its connection), signed by ``signer`` when given, timed from
        before the signing to the response."""
        started = time.perf_counter()
        try:
            metadata = signer.metadata(method, request) if signer is not None else None
            signed = time.perf_counter()
            stub = self.stubs[peer % len(self.stubs)]
            response = await getattr(stub, method)(request, metadata=metadata, timeout=REQUEST_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if "evicted" in (e.details() or "") and signer is not None:
                self.evicted.add(getattr(request, "peer_id", ""))
            if self.measuring:
                key = f"{method}: {e.code().name}"
                self.errors[key] = self.errors.get(key, 0) + 1
            return None
        if self.measuring:
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
            if self.latencies_ms[-1] > SLOW_MS:
                self.slow_at.append(started - self.measure_started)
            self.by_method.setdefault(method, []).append(self.latencies_ms[-1])
            if signer is not None:
                self.sign_ms.append((signed - started) * 1000)
        return response

    async def loop_lag(self) -> None:
        """The load generator's own delay: a latency measured here includes it, so it is reported beside them."""
        while not self.stop.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(LAG_TICK_S)
            if self.measuring:
                self.loop_lag_ms.append((time.perf_counter() - asked - LAG_TICK_S) * 1000)

    async def join_as(self, index: int) -> Optional[tuple[pb.JoinResponse, signing.CallSigner]]:
        """Join as a new peer (retrying until it is in or the load stops): the answer and its call signer."""
        key, libp2p = PeerKey.generate(), self.libp2p[index % len(self.libp2p)]
        while not self.stop.is_set():
            challenge = await self.timed("Challenge", pb.ChallengeRequest(), peer=index)
            if challenge is None:
                await asyncio.sleep(0.1)  # refused (the coordinator is busy): ask again in a moment
                continue
            request = signing.signed_join(
                token=self.join.token, nonce=challenge.nonce, key=key, libp2p=libp2p, name=f"bench-{index}"
            )
            response = await self.timed("Join", request, peer=index)
            if response is not None:
                return response, signing.CallSigner(key, response.session)
            await asyncio.sleep(0.1)
        return None

    async def peer(self, index: int, joined: asyncio.Queue) -> None:
        joined_as = await self.join_as(index)
        if joined_as is None:
            return
        response, signer = joined_as
        peer_id, libp2p_id = response.peer_id, self.libp2p[index % len(self.libp2p)].peer_id
        await joined.put(peer_id)
        # the run's initial state, as a peer that built the run's model holds it
        state_round, state_hash, reported = response.round.last_committed_round, response.round.last_committed_hash, 0
        training: Optional[tuple[int, float]] = None  # (round, when its steps are done): planned, not yet reported
        interval_s, poll_s = response.heartbeat_interval_s, max(OWN_POLL_S, response.round.poll_interval_s)
        slot = len(self.intervals_s)
        self.intervals_s.append(interval_s)
        loop = asyncio.get_running_loop()
        next_beat = loop.time() + random.random() * interval_s  # spread over the interval, as joins are
        next_poll = loop.time() + random.random() * poll_s
        while not self.stop.is_set() and peer_id not in self.evicted:
            now = loop.time()
            # a real peer polls while it waits for a round or a decision, not while it trains (its heartbeats' answers
            # say whether the round went on without it); it reports once its steps are done
            next_call = min(next_beat, training[1] if training else next_poll) if self.rounds else next_beat
            if now < next_call:
                await asyncio.sleep(next_call - now)
                continue
            if training is not None and now >= training[1]:
                reported, training = training[0], None
                group = self.group(reported)
                ok = peer_id in group[1]
                named = len(group[0]) <= MAX_GROUP  # a larger group goes as its digest (each peer computes its own)
                await self.timed(
                    "ReportRound",
                    pb.ReportRoundRequest(
                        peer_id=peer_id,
                        round=reported,
                        ok=ok,
                        state_hash=f"h{reported}" if ok else "",
                        error="" if ok else "the group averaged without this peer",
                        group=group[0] if ok and named else [],
                        group_digest=group[2] if ok and not named else "",
                        group_size=len(group[0]) if ok and not named else 0,
                        inner_steps=10,
                        samples=10,
                        loss=2.0,
                    ),
                    signer,
                    peer=index,
                )
                self.reports += 1
                next_poll = loop.time() + poll_s  # then it waits for the decision
                continue
            info, polled = None, False
            if now >= next_beat:
                metrics = pb.PeerMetrics(
                    state=pb.PEER_STATE_READY if self.rounds else pb.PEER_STATE_JOINING,
                    state_round=state_round,
                    state_hash=state_hash,
                    param_count=1000,
                    dht_peer_id=libp2p_id,
                )
                beat = await self.timed(
                    "Heartbeat", pb.HeartbeatRequest(peer_id=peer_id, metrics=metrics), signer, peer=index
                )
                if beat is not None:
                    info = beat.round
                    if beat.heartbeat_interval_s > 0:
                        interval_s = self.intervals_s[slot] = beat.heartbeat_interval_s
                next_beat = loop.time() + interval_s * random.uniform(0.9, 1.1)  # as peer.link.heartbeat does
            else:
                info = await self.timed("GetRound", pb.GetRoundRequest(peer_id=peer_id, round=0), signer, peer=index)
                next_poll, polled = loop.time() + poll_s, True
            if info is None:
                continue
            poll_s = max(OWN_POLL_S, info.poll_interval_s)
            self.poll_s = poll_s
            if not self.rounds:
                continue
            if info.last_committed_round > state_round:
                state_round, state_hash = info.last_committed_round, info.last_committed_hash
            if not polled:
                continue  # a heartbeat's answer names only this peer of the participants: the group comes from a poll
            if (
                info.open_round > reported
                and info.round == info.open_round
                and peer_id in info.participants
                and training is None
            ):
                training = info.open_round, loop.time() + self.train_s
                self.posted.setdefault(info.open_round, []).append(peer_id)  # its group entry, as it were

    def group(self, round_no: int) -> tuple[list[str], frozenset[str], str]:
        """The group of ``round_no``: closed as its first report goes out (matchmaking is over then). Its digest is
        computed once here for all the simulated peers (each real peer hashes its group on its own machine: sorting
        thousands of ids for every report would stall this one process's loop and every latency it measures)."""
        if round_no not in self.groups:
            members = list(self.posted.get(round_no, []))
            self.groups[round_no] = members, frozenset(members), group_id(members) if len(members) > MAX_GROUP else ""
        return self.groups[round_no]

    async def status(self) -> None:
        while not self.stop.is_set():
            await self.timed("GetStatus", pb.GetStatusRequest(token=self.join.token, page_size=100))
            await asyncio.sleep(1.0)


async def run_load(
    join: JoinString,
    *,
    peers: int,
    seconds: float,
    rounds: bool,
    train_s: float,
    child: psutil.Process,
    libp2p: list[Any],
) -> dict:
    gc.collect()
    gc.freeze()  # the imports' objects (torch, hivemind) out of the collector's full passes: not the coordinator's time
    channels = [aio_channel(join) for _ in range(max(1, math.ceil(peers / PEERS_PER_CONNECTION)))]
    load = Load([pb_grpc.CoordinatorStub(c) for c in channels], join, libp2p, rounds=rounds, train_s=train_s)
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
    tasks.append(asyncio.create_task(load.loop_lag()))

    # most peers heard the swarm's pace (a join burst may have slowed them down for a while: not waited out)
    await asyncio.sleep(min(SETTLE_MAX_S, max(load.intervals_s)) if load.intervals_s else 2.0)
    me = psutil.Process()
    loadavg_before = os.getloadavg()[0]
    cpu_before, load_cpu_before = sum(child.cpu_times()[:2]), sum(me.cpu_times()[:2])
    load.measure_started = time.perf_counter()
    load.measuring = True
    await asyncio.sleep(seconds)
    load.measuring = False
    cpu_s = sum(child.cpu_times()[:2]) - cpu_before
    load_cpu_s = sum(me.cpu_times()[:2]) - load_cpu_before
    load.stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    final = (
        await load.stubs[0].GetStatus(pb.GetStatusRequest(token=join.token, page_size=1), timeout=REQUEST_TIMEOUT_S)
    ).run
    for channel in channels:
        await channel.close()
    latencies, sign_ms = sorted(load.latencies_ms), sorted(load.sign_ms)
    return {
        "peers": peers,
        "seconds": seconds,
        "rounds": rounds,
        "rpcs": len(latencies),
        "calls_per_s": round(len(latencies) / seconds, 1),
        "heartbeat_interval_s": round(statistics.median(load.intervals_s), 2) if load.intervals_s else None,
        "heartbeat_interval_max_s": round(max(load.intervals_s), 2) if load.intervals_s else None,
        "poll_interval_s": round(load.poll_s, 2),
        "rpc_p50_ms": round(_percentile(latencies, 50), 2),
        "rpc_p99_ms": round(_percentile(latencies, 99), 2),
        "rpc_max_ms": round(latencies[-1], 2) if latencies else 0.0,
        "p50_ms_by_method": {m: round(_percentile(sorted(v), 50), 2) for m, v in load.by_method.items()},
        "p99_ms_by_method": {m: round(_percentile(sorted(v), 99), 2) for m, v in load.by_method.items()},
        "calls_by_method": {m: len(v) for m, v in load.by_method.items()},
        "errors": sum(load.errors.values()),
        "error_kinds": load.errors,
        "evictions": len(load.evicted),
        "coordinator_cpu_s": round(cpu_s, 2),
        "coordinator_cpu_ms_per_peer_s": round(1000 * cpu_s / (peers * seconds), 4),
        "coordinator_cores": round(cpu_s / seconds, 3),
        "coordinator_cpu_ms_per_rpc": round(1000 * cpu_s / max(1, len(latencies)), 3),
        "load_generator_cpu_s": round(load_cpu_s, 2),
        "load_generator_loop_lag_p99_ms": round(_percentile(sorted(load.loop_lag_ms), 99), 2),
        "slow_calls": len(load.slow_at),  # over SLOW_MS
        "slow_calls_by_10s": _by_window(load.slow_at, seconds, 10.0),
        "join_s": round(join_s, 2),
        "reports": load.reports,
        "rounds_committed": final.rounds_committed,
        "rounds_voided": final.rounds_voided,
        "client_sign_ms_p50": round(_percentile(sign_ms, 50), 3),
        "libp2p_identities": len(libp2p),
        "loadavg_1m_before": round(loadavg_before, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def _by_window(times: list[float], seconds: float, window: float) -> list[int]:
    """How many of ``times`` fall in each ``window`` of the measurement: when the slow calls came."""
    counts = [0] * max(1, math.ceil(seconds / window))
    for t in times:
        counts[min(len(counts) - 1, max(0, int(t // window)))] += 1
    return counts


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q / 100))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=500, help="simulated peers")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to measure once all joined")
    parser.add_argument(
        "--rounds",
        action="store_true",
        help="peers are ready and report every round they are planned into (default: they stay joining)",
    )
    parser.add_argument(
        "--train-s",
        type=float,
        default=5.0,
        help="with --rounds: how long a peer 'trains' after it sees itself planned, before it reports",
    )
    parser.add_argument(
        "--libp2p-identities",
        type=int,
        default=4,
        help="libp2p identities the simulated peers share (each is an RSA key to generate)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    with (
        tempfile.TemporaryDirectory(prefix="bench-coordinator-") as state_dir,
        tempfile.TemporaryDirectory(prefix="bench-p2p-") as p2p_dir,
    ):
        libp2p = libp2p_pool(args.libp2p_identities, Path(p2p_dir))
        child = subprocess.Popen(
            [sys.executable, __file__, "--serve", state_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        try:
            line = child.stdout.readline()
            if not line.startswith("join: "):
                raise SystemExit(f"the coordinator did not start (it printed {line!r})")
            join = JoinString.parse(line.removeprefix("join: "))
            result = asyncio.run(
                run_load(
                    join,
                    peers=args.peers,
                    seconds=args.seconds,
                    rounds=args.rounds,
                    train_s=args.train_s,
                    child=psutil.Process(child.pid),
                    libp2p=libp2p,
                )
            )
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
