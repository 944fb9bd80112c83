#!/usr/bin/env python3
"""CPU cost of the dense codecs, per byte of fp32 input: encode and decode, one thread.

    .venv/bin/python scripts/bench_codec.py --numel 4000000 --repeats 5 --json
    .venv/bin/python scripts/bench_codec.py --numel 25000000 --codecs int4 --host 4 --json   # one exchange's host

For each codec it reports the best-of-``repeats`` seconds and ns per fp32 byte (4 bytes per element) for
encode and decode; with --json the last stdout line is a JSON list of rows. With ``--host K`` each row is instead
what one member of a K-member butterfly all-reduce spends outside the network, in the exchange's own functions
and memory pools, the mean of ``repeats`` exchanges after two warm-up ones: the check before sending, its slices'
encodes, the decodes and reductions of the slices it owns (its groupmates' contributions given the bytes of its
own, which costs the same), and the decodes of every averaged slice into the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.core.aggregation import Aggregation  # noqa: E402
from swarm.core.average import butterfly_bounds, stripe_count  # noqa: E402
from swarm.core.codecs.codec import CODECS  # noqa: E402
from swarm.net.exchange.result_vectors import ResultVectors  # noqa: E402
from swarm.net.exchange.slices.reduction import check_sendable, decode_into, encode_slice, reduce_decoded  # noqa: E402

DENSE = ["fp32", "fp16", "bf16", "int8", "int4"]


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def host_row(name: str, values: torch.Tensor, members: int, repeats: int) -> dict:
    """One butterfly member's CPU outside the network, by step, in ms per exchange (position 0's slices)."""
    codec, numel = CODECS[name], values.numel()
    stripes = stripe_count(codec, numel, members)
    bounds = butterfly_bounds(numel, members, codec.block, stripes)
    # as swarm.net.exchange.allreduce.Exchange's
    results, scratch = ResultVectors(), ResultVectors(keep=2 * members + 2)
    weights = [float(i + 1) for i in range(members)]
    steps = dict.fromkeys(["check", "encode", "decode", "reduce", "decode_result"], 0.0)
    averaged = [encode_slice(codec, values[s:e], "bench") for s, e in bounds]  # what the owners send back
    for repeat in range(repeats + 2):
        spent = dict.fromkeys(steps, 0.0)
        start = time.perf_counter()
        check_sendable(codec, values, "bench")
        spent["check"] += time.perf_counter() - start
        for stripe in range(stripes):
            start = time.perf_counter()
            encoded = [
                encode_slice(codec, values[s:e], "bench") for s, e in bounds[stripe * members : (stripe + 1) * members]
            ]
            spent["encode"] += time.perf_counter() - start
            s, e = bounds[stripe * members]
            start = time.perf_counter()
            decoded = []
            for _ in range(members):
                decoded.append(scratch.take(e - s))
                decode_into(codec, encoded[0], decoded[-1], "bench")
            spent["decode"] += time.perf_counter() - start
            start = time.perf_counter()
            reduce_decoded(Aggregation(), codec, decoded, weights, "bench", out=scratch.take(e - s))
            del decoded
            spent["reduce"] += time.perf_counter() - start
        result = results.take(numel)
        start = time.perf_counter()
        for (s, e), data in zip(bounds, averaged):
            decode_into(codec, data, result[s:e], "bench")
        spent["decode_result"] += time.perf_counter() - start
        del result
        if repeat >= 2:
            steps = {k: steps[k] + spent[k] for k in steps}
    ms = {f"{k}_ms": round(v / repeats * 1e3, 1) for k, v in steps.items()}
    return {
        "codec": name,
        "numel": numel,
        "members": members,
        "stripes": stripes,
        **ms,
        "host_ms": round(sum(steps.values()) / repeats * 1e3, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--codecs", nargs="+", default=DENSE)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--host",
        type=int,
        default=0,
        metavar="K",
        help="one member of a K-member butterfly all-reduce instead: its CPU outside the network",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.codecs if args.host else []:
        row = host_row(name, values, args.host, args.repeats)
        rows.append(row)
        print(f"{name:5s} one host of {args.host}: {row['host_ms']} ms per exchange ({row})", file=sys.stderr)
    for name in [] if args.host else args.codecs:
        codec = CODECS[name]
        data = codec.encode(values)
        encode_s = best_of(lambda: codec.encode(values), args.repeats)
        decode_s = best_of(lambda: codec.decode(data, args.numel), args.repeats)
        row = {
            "codec": name,
            "numel": args.numel,
            "encoded_bytes": len(data),
            "encode_s": round(encode_s, 5),
            "decode_s": round(decode_s, 5),
            "encode_ns_per_byte": round(encode_s / (4 * args.numel) * 1e9, 3),
            "decode_ns_per_byte": round(decode_s / (4 * args.numel) * 1e9, 3),
        }
        rows.append(row)
        print(
            f"{name:5s} encode {row['encode_ns_per_byte']:7.3f} ns/B  decode {row['decode_ns_per_byte']:7.3f} ns/B",
            file=sys.stderr,
        )
    print(json.dumps(rows) if args.json else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
