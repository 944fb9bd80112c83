#!/usr/bin/env python3
"""CPU cost of the dense codecs, per byte of fp32 input: encode and decode, one thread.

    .venv/bin/python scripts/bench_codec.py --numel 4000000 --repeats 5 --json

For each codec it reports the best-of-``repeats`` seconds and ns per fp32 byte (4 bytes per element) for
encode and decode; with --json the last stdout line is a JSON list of rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.core.codec import CODECS  # noqa: E402

DENSE = ["fp32", "fp16", "bf16", "int8", "int4"]


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=4_000_000)
    parser.add_argument("--codecs", nargs="+", default=DENSE)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    values = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in args.codecs:
        codec = CODECS[name]
        data = codec.encode(values)
        encode_s = best_of(lambda: codec.encode(values), args.repeats)
        decode_s = best_of(lambda: codec.decode(data, args.numel), args.repeats)
        row = {"codec": name, "numel": args.numel, "encoded_bytes": len(data), "encode_s": round(encode_s, 5),
               "decode_s": round(decode_s, 5), "encode_ns_per_byte": round(encode_s / (4 * args.numel) * 1e9, 3),
               "decode_ns_per_byte": round(decode_s / (4 * args.numel) * 1e9, 3)}
        rows.append(row)
        print(f"{name:5s} encode {row['encode_ns_per_byte']:7.3f} ns/B  decode {row['decode_ns_per_byte']:7.3f} ns/B",
              file=sys.stderr)
    print(json.dumps(rows) if args.json else json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
