"""A TCP forwarder that adds a one-way delay in each direction without limiting bandwidth: every chunk
read is stamped and written once its delay has passed, while reading goes on (no ``netem`` needed).
Run inside the client's host; it prints the port it bound, then forwards until killed.

    python -m testbed.delay_proxy --listen 10.77.0.10:0 --to 10.77.0.11:7000 --delay-ms 25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys

_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 256  # up to ~16 MiB in flight per direction before the reader waits (bandwidth x delay)


_EARLY_S = 0.0005  # the event loop rounds its timers up to whole milliseconds: aim half of that early


async def _until(loop: asyncio.AbstractEventLoop, due: float) -> None:
    if due - loop.time() > _EARLY_S:
        await asyncio.sleep(due - loop.time() - _EARLY_S)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)

    async def read() -> None:
        while data := await reader.read(_CHUNK):
            await queue.put((loop.time() + delay_s, data))
        await queue.put((loop.time() + delay_s, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            await _until(loop, due)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    except (ConnectionError, OSError):
        writer.close()
    finally:
        reading.cancel()  # the far side is gone (or done): stop reading for it


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def serve(listen_host: str, listen_port: int, target_host: str, target_port: int, delay_ms: float) -> None:
    delay_s = delay_ms / 1000

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        _no_delay(client_writer)
        _no_delay(target_writer)
        await asyncio.gather(_pump(client_reader, target_writer, delay_s), _pump(target_reader, client_writer, delay_s))
        client_writer.close()
        target_writer.close()

    server = await asyncio.start_server(handle, listen_host, listen_port)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _wake_promptly() -> None:
    """On a busy machine a sleeping process waits for a CPU when its timer fires, which adds to the delay;
    a higher priority (root only, as the testbed runs) keeps that wait short."""
    try:
        os.nice(-10)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delay_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--to", type=_address, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay added in each direction")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms must be zero or more, got {args.delay_ms}")
    _wake_promptly()
    try:
        asyncio.run(serve(*args.listen, *args.to, args.delay_ms))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
