#!/usr/bin/env python3
"""Swarm's exchange against hivemind's DecentralizedAverager, side by side on loopback.

    .venv/bin/python scripts/bench_exchange.py --peers 3 --numel 1000000 4000000 --repeats 5 --json

K peers run in one process (threads), each with its own hivemind DHT and p2pd. For every vector size
and codec both all-reduces average the same random vectors; the script reports the median seconds,
bytes each peer sent (Swarm counts them; hivemind's is the same butterfly layout, estimated as
2(K−1)/K × payload) and whether every peer ended with bit-identical results. With --json the last
stdout line is a JSON list of rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.core.codecs.codec import CODECS  # noqa: E402
from swarm.core.trust import credential  # noqa: E402
from swarm.net.bulk.transport import Transport  # noqa: E402
from swarm.net.exchange.allreduce import Exchange  # noqa: E402
from swarm.net.exchange.rendezvous import Member, group_key, rendezvous  # noqa: E402


def run_threads(fn, count: int, timeout_s: float) -> list:
    results, errors = [None] * count, []

    def target(i: int) -> None:
        try:
            results[i] = fn(i)
        except Exception as e:  # reported below, not swallowed
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    return results


def run_members(transports) -> list[credential.Member]:
    """A member of the bench run per transport, as a coordinator would admit them (signed DHT entries)."""
    coordinator, now = credential.PeerKey.generate(), time.time()
    members = []
    for t in transports:
        key = credential.PeerKey.generate()
        signed = credential.issue(
            coordinator,
            credential.Credential(
                run_id="bench",
                peer_id=key.peer_id,
                public_key=key.public_key,
                dht_peer_id=t.peer_id,
                role="peer",
                token_id="bench",
                issued_at=now,
                expires_at=now + 86400,
            ),
        )
        members.append(
            credential.Member(key=key, credential=signed, coordinator_public_key=coordinator.public_key, run_id="bench")
        )
    return members


def bench_swarm(transports, exchanges, vectors, codec: str, repeats: int, round0: int) -> dict:
    k = len(transports)
    times, sent, identical = [], [], True
    members = run_members(transports)
    planned = {m.peer_id for m in members}
    for rep in range(repeats):
        key = group_key("bench", round0 + rep)

        def one(i: int):
            me = Member(
                peer_id=members[i].peer_id,
                dht_peer_id=transports[i].peer_id,
                index=i,
                weight=1.0,
                numel=vectors[i].numel(),
                codec=codec,
                bulk=exchanges[i].bulk_address,
            )
            group = rendezvous(
                transports[i].dht, key=key, me=me, member=members[i], planned=lambda: planned, window_s=30, ttl_s=120
            )
            start = time.perf_counter()
            result = exchanges[i].average(key=key, group=group, me=me, delta=vectors[i], timeout_s=120)
            return time.perf_counter() - start, result

        out = run_threads(one, k, 300)
        times.append(max(t for t, _ in out))
        sent.append(statistics.mean(r.bytes_sent for _, r in out))
        identical &= all(torch.equal(r.average, out[0][1].average) for _, r in out)
    return {
        "median_s": statistics.median(times),
        "bytes_sent_per_peer": int(statistics.mean(sent)),
        "identical_across_peers": identical,
    }


def bench_hivemind(transports, vectors, codec: str, repeats: int, prefix: str) -> dict:
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression

    compression = {"fp32": NoCompression(), "fp16": Float16Compression()}.get(codec)
    if compression is None:
        note = (
            "hivemind's 8-bit codecs fail under numpy 2 (they average only the local part)"
            if codec == "int8"
            else f"hivemind has no {codec} codec"
        )
        return {"median_s": None, "bytes_sent_per_peer": None, "identical_across_peers": None, "note": note}
    k = len(transports)
    averagers = [
        DecentralizedAverager(
            [vectors[i].clone()],
            transports[i].dht,
            prefix=prefix,
            start=True,
            target_group_size=k,
            min_matchmaking_time=2.0,
            request_timeout=1.0,
            compression=compression,
        )
        for i in range(k)
    ]
    times, identical = [], True
    try:
        for _ in range(repeats):
            for i, a in enumerate(averagers):
                with a.get_tensors() as tensors:
                    tensors[0].copy_(vectors[i])

            def one(i: int):
                start = time.perf_counter()
                ok = averagers[i].step(timeout=120)
                return time.perf_counter() - start, ok

            out = run_threads(one, k, 300)
            if not all(ok for _, ok in out):
                continue
            # matchmaking waits for the group; the all-reduce itself is what the row compares
            times.append(max(t for t, _ in out))
            results = []
            for a in averagers:
                with a.get_tensors() as tensors:
                    results.append(tensors[0].clone())
            identical &= all(torch.equal(r, results[0]) for r in results)
    finally:
        for a in averagers:
            a.shutdown()
    payload = CODECS[codec].encoded_size(vectors[0].numel())
    return {
        "median_s": statistics.median(times) if times else None,
        "bytes_sent_per_peer": int(2 * (k - 1) / k * payload),
        "identical_across_peers": identical,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--numel", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--codecs", nargs="+", default=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    first = Transport(initial_peers=[])
    transports = [first] + [Transport(initial_peers=first.visible_maddrs) for _ in range(args.peers - 1)]
    exchanges = [Exchange(t, run_id="bench") for t in transports]
    rows, round0 = [], 1
    try:
        for numel in args.numel:
            gen = torch.Generator().manual_seed(numel)
            vectors = [torch.randn(numel, generator=gen) for _ in range(args.peers)]
            for codec in args.codecs:
                swarm_row = bench_swarm(transports, exchanges, vectors, codec, args.repeats, round0)
                round0 += args.repeats
                hm_row = bench_hivemind(transports, vectors, codec, args.repeats, prefix=f"hm{numel}{codec}")
                for impl, row in (("swarm", swarm_row), ("hivemind", hm_row)):
                    rows.append({"impl": impl, "peers": args.peers, "numel": numel, "codec": codec, **row})
                    print(
                        f"{impl:9s} K={args.peers} n={numel:>9,} {codec:5s} median {row['median_s']} s, "
                        f"{row['bytes_sent_per_peer']} B/peer, identical={row['identical_across_peers']}",
                        file=sys.stderr,
                    )
    finally:
        for t in transports:
            t.shutdown()
    print(json.dumps(rows) if args.json else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
