"""The coordinator's gRPC server: ``grpc.aio`` on one event-loop thread, every handler run on that thread.

The engine is synchronous and takes its own lock for a few hundred microseconds a call, so a handler calls it
directly on the loop: no thread pool, no hand-off of each call between gRPC's polling thread and a worker, and
no convoy of a dozen threads contending for the GIL, which under a burst of reports kept calls waiting for
the interpreter longer than for the engine (``scripts/bench_coordinator.py``: docs/BENCHMARKS.md). gRPC's core
reads, decrypts and writes on its own threads.

Load shedding (``coordinator.api.load``) sees every call as it arrives (``LoadMonitor.admit``, against the calls
accepted and not yet answered, by its method's share) and hears from a probe how far behind the loop runs
(``waited``: what a call arriving now waits for its handler).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, Optional

import grpc

from coordinator.api.load import LoadMonitor

LAG_PROBE_S = 0.05  # how often the loop measures its own lag (the wait of a call that arrives while it is busy)
REFUSED = "the coordinator is saturated and sheds calls that can wait; retry in a few seconds."


class Aborted(Exception):
    """``context.abort`` of a synchronous handler, carried out of it to be awaited on the loop."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class SyncContext:
    """What a synchronous servicer method uses of its context, over an asyncio call's context."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def peer(self) -> str:
        return self._context.peer()

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()


def on_the_loop(behavior: Callable) -> Callable:
    """An asyncio handler that runs the synchronous ``behavior(request, context)`` on the loop."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return behavior(request, SyncContext(context))
        except Aborted as e:
            await context.abort(e.code, e.details)

    return handle


class AdmitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call beyond its method's share of the calls in flight (accepted, not yet answered; counted on the
    loop's thread only)."""

    def __init__(self, monitor: LoadMonitor) -> None:
        self._monitor = monitor
        self.in_flight = 0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        if not self._monitor.admit(handler_call_details.method.rpartition("/")[2], self.in_flight):
            return handler._replace(unary_unary=_refuse)
        self.in_flight += 1
        task = asyncio.current_task()  # the call's: done however it ends (answered, aborted, cancelled)
        if task is not None:
            task.add_done_callback(self._answered)
        return handler

    def _answered(self, _task: asyncio.Task) -> None:
        self.in_flight -= 1


async def _refuse(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSED)


class LoopServer:
    """A ``grpc.aio`` server on an event loop of its own thread, driven from any other thread."""

    def __init__(self, monitor: LoadMonitor, *, options: list[tuple[str, Any]], maximum_concurrent_rpcs: int) -> None:
        self.monitor = monitor
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="coordinator-grpc", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server = self._on_loop(
            grpc.aio.server,
            interceptors=[AdmitInterceptor(monitor)],
            options=options,
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        )
        self._lag_probe = asyncio.run_coroutine_threadsafe(self._probe_lag(), self._loop)

    async def _probe_lag(self, clock: Callable[[], float] = time.monotonic) -> None:
        """Tell the monitor how late the loop wakes up: what a call arriving now waits before its handler runs,
        which a burst of calls queued in gRPC's core, before any interceptor sees them, shows only this way. The
        smaller of two wake-ups in a row: a loop that stays behind, not one pause (a garbage collection, the
        machine's scheduler), is what slows the peers down."""
        previous = 0.0
        while True:
            asleep = clock()
            await asyncio.sleep(LAG_PROBE_S)
            lag = max(0.0, clock() - asleep - LAG_PROBE_S)
            self.monitor.waited(min(lag, previous))
            previous = lag

    def _run(self, coroutine: Any, timeout_s: Optional[float] = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def _on_loop(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` called on the loop's thread (the aio server is the loop's), its result here."""

        async def call() -> Any:
            return fn(*args, **kwargs)

        return self._run(call())

    def add_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        """``handlers`` of the synchronous servicer, run on the loop."""
        on_loop = {name: h._replace(unary_unary=on_the_loop(h.unary_unary)) for name, h in handlers.items()}
        self._on_loop(self._server.add_generic_rpc_handlers, (grpc.method_handlers_generic_handler(service, on_loop),))
        self._on_loop(self._server.add_registered_method_handlers, service, on_loop)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._on_loop(self._server.add_secure_port, address, credentials)

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self._server.add_insecure_port, address)

    def start(self) -> None:
        self._run(self._server.start())

    def stop(self, grace_s: Optional[float]) -> None:
        """Stop serving (calls in flight get ``grace_s``) and end the loop's thread."""
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._lag_probe.cancel)
            self._run(self._server.stop(grace_s), timeout_s=(grace_s or 0) + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
