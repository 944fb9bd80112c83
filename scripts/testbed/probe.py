"""Small raw-TCP measurements run inside the testbed's hosts: a sink that times what it receives, a
source, an echo server and an RTT meter, and a connect check. Each prints one JSON line (servers first
print the port they bound).

    python -m testbed.probe sink --host 10.77.0.11
    python -m testbed.probe source --to 10.77.0.11:PORT --bytes 5000000
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

_CHUNK = 64 * 1024


def _listen(host: str) -> socket.socket:
    server = socket.create_server((host, 0))
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    return server


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def sink(host: str) -> dict:
    """Accept one connection, read to EOF; bytes and seconds from the first byte to the last."""
    with _listen(host) as server:
        conn, _ = server.accept()
        with conn:
            received, first, last = 0, None, None
            while data := conn.recv(_CHUNK):
                last = time.perf_counter()
                first = first or last
                received += len(data)
    seconds = (last - first) if first is not None else 0.0
    return {"bytes": received, "seconds": seconds, "mbit_s": received * 8 / seconds / 1e6 if seconds else 0.0}


def source(to: str, total_bytes: int) -> dict:
    payload = b"\0" * _CHUNK
    with socket.create_connection(_split(to), timeout=30) as conn:
        sent = 0
        while sent < total_bytes:
            conn.sendall(payload[: min(_CHUNK, total_bytes - sent)])
            sent += min(_CHUNK, total_bytes - sent)
    return {"bytes": sent}


def echo(host: str) -> None:
    """Echo every message on one connection at a time, until killed."""
    with _listen(host) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(_CHUNK):
                    conn.sendall(data)


def rtt(to: str, count: int, size: int) -> dict:
    """Round-trip times of ``count`` messages of ``size`` bytes, one in flight at a time."""
    message = b"x" * size
    times_ms = []
    with socket.create_connection(_split(to), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            start = time.perf_counter()
            conn.sendall(message)
            got = 0
            while got < size:
                data = conn.recv(size - got)
                if not data:
                    raise ConnectionError("the echo server closed the connection")
                got += len(data)
            times_ms.append((time.perf_counter() - start) * 1000)
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms)}


def connect(to: str, timeout_s: float) -> dict:
    try:
        with socket.create_connection(_split(to), timeout=timeout_s):
            return {"connected": True}
    except OSError as e:
        return {"connected": False, "error": str(e) or type(e).__name__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probe", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("sink", "echo"):
        sub.add_parser(name).add_argument("--host", required=True)
    p = sub.add_parser("source")
    p.add_argument("--to", required=True)
    p.add_argument("--bytes", type=int, default=5_000_000)
    p = sub.add_parser("rtt")
    p.add_argument("--to", required=True)
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--size", type=int, default=64)
    p = sub.add_parser("connect")
    p.add_argument("--to", required=True)
    p.add_argument("--timeout-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.command == "echo":
        echo(args.host)
        return 0
    result = {
        "sink": lambda: sink(args.host),
        "source": lambda: source(args.to, args.bytes),
        "rtt": lambda: rtt(args.to, args.count, args.size),
        "connect": lambda: connect(args.to, args.timeout_s),
    }[args.command]()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
