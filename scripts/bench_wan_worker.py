#!/usr/bin/env python3
"""One testbed host's side of scripts/bench_wan.py: a hivemind node with Swarm's exchange, stock hivemind
averagers and raw TCP sockets, driven by JSON commands on stdin (one per line, one JSON reply per line on
stdout). Every timed command carries a wall-clock start time ``at``, so all hosts start together (the
namespaces share the machine's clock) and each reports the seconds from ``at`` to its own finish.

    python scripts/bench_wan_worker.py --host 10.77.0.11 --bootstrap /ip4/10.77.0.10/tcp/.../p2p/...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL, set_congestion  # noqa: E402
from swarm.net.bulk.transport import Transport  # noqa: E402
from swarm.net.exchange.allreduce import Exchange  # noqa: E402
from swarm.net.exchange.rendezvous import Member  # noqa: E402

CONGESTION = os.environ.get("SWARM_BENCH_TCP_CONGESTION", CONGESTION_CONTROL)  # bench_wan.py --tcp-congestion


def _wait_until(at: float) -> float:
    """Sleep until ``at``; returns how late this host was ready (0: on time)."""
    late_s = max(0.0, time.time() - at)
    while (left := at - time.time()) > 0:
        time.sleep(min(left, 0.05))
    return late_s


def _vector(numel: int, index: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + index))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(t.contiguous().numpy()).cast("B")).hexdigest()[:16]  # read in place: no copy


def _recv_into(sock: socket.socket, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = sock.recv_into(view[got:], len(buf) - got)
        if n == 0:
            raise ConnectionError("a groupmate closed its TCP connection mid-exchange")
        got += n


class TcpFloor:
    """The butterfly's traffic over plain TCP: one connection to every groupmate, the slices sent in two phases
    like the exchange's (phase 2 waits for every phase-1 slice), no encoding, no reduction."""

    def __init__(self, host: str) -> None:
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.out: dict[int, socket.socket] = {}
        self.inbound: dict[int, socket.socket] = {}

    def connect(self, index: int, peers: list[tuple[str, int]]) -> None:
        def accept() -> None:
            for _ in range(len(peers) - 1):
                conn, _ = self.listener.accept()
                hello = bytearray(4)
                set_congestion(conn, CONGESTION)
                _recv_into(conn, hello)
                sender = struct.unpack("<I", hello)[0]
                self.inbound[sender] = conn

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        for j, (host, port) in enumerate(peers):
            if j != index:
                sock = socket.create_connection((host, port))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                set_congestion(sock, CONGESTION)
                sock.sendall(struct.pack("<I", index))
                self.out[j] = sock
        acceptor.join(60)

    def exchange(self, slice_bytes: int, index: int = 0, in_turn: bool = False) -> None:
        """``in_turn``: step i sends to position index + i and receives from index − i (one flow per link)."""
        payload = bytes(slice_bytes)
        if in_turn:
            peers = len(self.out) + 1
            for _ in range(2):
                for i in range(1, peers):
                    buffer = bytearray(slice_bytes)
                    sender = threading.Thread(target=self.out[(index + i) % peers].sendall, args=(payload,))
                    sender.start()
                    _recv_into(self.inbound[(index - i) % peers], buffer)
                    sender.join()
            return
        for _ in range(2):  # phase 1: contributions to owners; phase 2: averaged slices to everyone
            senders = [threading.Thread(target=s.sendall, args=(payload,)) for s in self.out.values()]
            buffers = {j: bytearray(slice_bytes) for j in self.inbound}
            receivers = [threading.Thread(target=_recv_into, args=(c, buffers[j])) for j, c in self.inbound.items()]
            for t in senders + receivers:
                t.start()
            for t in senders + receivers:
                t.join()


class Worker:
    def __init__(self, host: str, bootstrap: list[str], index: int) -> None:
        self.index = index
        self.transport = Transport(initial_peers=bootstrap, host=host, announce_host=host, tcp_congestion=CONGESTION)
        self.exchange = Exchange(self.transport, run_id="bench")
        self.tcp = TcpFloor(host)
        self.averager = None
        self.control = None
        self._vectors: dict[int, torch.Tensor] = {}  # made before the clock starts, once per size
        # The last exchange's result, hashed only when asked ("digest"): after every host has stopped its clock,
        # so a host that finished early does not hash 100 MB on the cores its groupmates are still exchanging on.
        self._last: torch.Tensor | None = None

    def vector(self, numel: int) -> torch.Tensor:
        if numel not in self._vectors:
            self._vectors = {numel: _vector(numel, self.index)}
        return self._vectors[numel]

    def hello(self) -> dict:
        return {
            "maddrs": self.transport.visible_maddrs,
            "dht_peer_id": self.transport.peer_id,
            "tcp_port": self.tcp.port,
            "bulk": self.exchange.bulk_address,
        }

    def handle(self, cmd: dict) -> dict:
        name = cmd["cmd"]
        if name == "tcp_connect":
            self.tcp.connect(self.index, [tuple(p) for p in cmd["peers"]])
            return {"ok": True}
        if name == "tcp":
            late_s = _wait_until(cmd["at"])
            self.tcp.exchange(cmd["slice_bytes"], self.index, cmd.get("in_turn", False))
            return {"seconds": time.time() - cmd["at"], "late_s": late_s}
        if name == "swarm":
            return self._swarm(cmd)
        if name == "digest":
            if self.averager is not None:
                with self.averager.get_tensors() as tensors:
                    return {"digest": _digest(tensors[0])}
            digest = _digest(self._last) if self._last is not None else None
            self._last = None  # hashed: released, as a peer releases its round's average once applied
            return {"digest": digest}
        if name == "hm_open":
            return self._hm_open(cmd)
        if name == "hm_arm":
            self.control = self.averager.step(wait=False, require_trigger=True, timeout=cmd.get("timeout_s", 300))
            from hivemind.averaging.control import AveragingStage

            deadline = time.time() + cmd.get("timeout_s", 300)
            while self.control.stage != AveragingStage.AWAITING_TRIGGER and time.time() < deadline:
                if self.control.done():
                    return {"ok": False, "error": repr(self.control.exception())}
                time.sleep(0.02)
            return {"ok": self.control.stage == AveragingStage.AWAITING_TRIGGER}
        if name == "hm_go":
            late_s = _wait_until(cmd["at"])
            self.control.allow_allreduce()
            try:
                self.control.result(timeout=cmd.get("timeout_s", 300))
            except Exception as e:  # a failed all-reduce is a row without a time, not a crash
                return {"seconds": None, "error": repr(e)}
            return {"seconds": time.time() - cmd["at"], "late_s": late_s}
        if name == "hm_close":
            if self.averager is not None:
                self.averager.shutdown()
            self.averager = None
            return {"ok": True}
        raise ValueError(f"unknown command {name!r}")

    def _swarm(self, cmd: dict) -> dict:
        bulk = cmd.get("bulk") or [""] * len(cmd["group"])  # "": that member's slices come over libp2p
        group = [
            Member(peer_id=f"p{i}", dht_peer_id=d, index=i, weight=1.0, numel=cmd["numel"], codec=cmd["codec"], bulk=b)
            for i, (d, b) in enumerate(zip(cmd["group"], bulk))
        ]
        self.exchange.send_in_turn = cmd.get("in_turn", False)
        self.exchange.pace_mbit_s = cmd.get("pace_mbit", 0.0)
        delta = self.vector(cmd["numel"])
        late_s = _wait_until(cmd["at"])
        result = self.exchange.average(
            key=cmd["key"], group=group, me=group[self.index], delta=delta, timeout_s=cmd.get("timeout_s", 300)
        )
        seconds = time.time() - cmd["at"]
        self._last = result.average
        return {
            "seconds": seconds,
            "bytes_sent": result.bytes_sent,
            "late_s": late_s,
            "inside_s": result.seconds,
            "phases_s": result.phases_s,
        }

    def _hm_open(self, cmd: dict) -> dict:
        from hivemind.averaging import DecentralizedAverager

        self.averager = DecentralizedAverager(
            [self.vector(cmd["numel"]).clone()],
            self.transport.dht,
            prefix=cmd["prefix"],
            start=True,
            target_group_size=cmd["peers"],
        )
        return {"ok": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", required=True, help="this testbed host's address")
    parser.add_argument("--index", type=int, required=True, help="position in the group")
    parser.add_argument("--bootstrap", nargs="*", default=[], help="multiaddrs of a running worker")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    worker = Worker(args.host, args.bootstrap, args.index)
    print(json.dumps(worker.hello()), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = worker.handle(json.loads(line))
        except Exception as e:  # reported to the driver, which decides what the row says
            reply = {"error": repr(e)}
        print(json.dumps(reply), flush=True)
    worker.transport.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
