"""The peer's calls to the coordinator that must get through: retried while it is unreachable, given up once it is
gone (the run finished and it stopped answering, or it stayed unreachable ``give_up_after_s``); and the exits that
end the daemon."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, TypeVar

from peer.link.retry import with_retry
from swarm.control.client import CoordinatorClient, CoordinatorUnreachable

logger = logging.getLogger(__name__)
T = TypeVar("T")

FINISHED_RETRY_S = 5.0  # once the coordinator said the run finished, how long an unanswered call is retried


class PeerExit(Exception):
    """Stop the daemon with this exit code; the message has already been logged."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Departed(Exception):
    """The coordinator said the run finished and has stopped answering since: nothing more will come from it."""


class Behind(CoordinatorUnreachable):
    """The coordinator answered from an earlier round than the one reported: back, not yet caught up with the group."""


class CoordinatorCalls:
    """Retried calls. Threads: any (the main thread and the round runner's executor); it holds no state a call
    changes: ``client`` is set once (a test may swap it), ``finished`` is asked of the plan cache at each call."""

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        stop: threading.Event,
        tag: Callable[[Optional[int]], str],
        finished: Callable[[], bool],
        give_up_after_s: Optional[float] = None,
    ) -> None:
        self.client, self.stop, self.tag = client, stop, tag
        self.finished = finished  # whether the coordinator said the run finished (the plan cache's ``final``)
        # unreachable this long while this peer has nothing it can do without the coordinator: it exits (None: never)
        self.give_up_after_s = give_up_after_s

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retrying while the coordinator is unreachable: PeerExit(0) when the peer is stopped; Departed
        when the coordinator said the run finished and then stopped answering (it does not come back for a
        finished run); PeerExit(1), after one sentence, when it stays unreachable ``give_up_after_s``."""
        finished = self.finished()
        limit = FINISHED_RETRY_S if finished else self.give_up_after_s
        started = time.monotonic()
        result = with_retry(fn, what=f"{self.tag(None)} {what}", stop=self.stop, give_up_after_s=limit)
        if result is not None:
            return result
        if self.stop.is_set():
            raise PeerExit(0)
        if finished:
            raise Departed()
        self.give_up_if_gone(max(time.monotonic() - started, limit or 0.0), what)
        raise PeerExit(1)  # unreachable: give_up_if_gone raised (with_retry gives up only with a limit)

    def give_up_if_gone(self, unreachable_s: float, waiting_for: str) -> None:
        """Raise when the coordinator has been unreachable too long for a peer that has nothing to do without it:
        Departed once it said the run finished, else PeerExit(1) after ``give_up_after_s``, with one sentence."""
        if self.finished() and unreachable_s >= FINISHED_RETRY_S:
            raise Departed()
        if self.give_up_after_s is None or unreachable_s < self.give_up_after_s:
            return
        logger.error(
            "%s the coordinator at %s has not answered for %.0fs (%s) and this peer has no round it can run "
            "without it; exiting (start it again with the same --state-dir once the coordinator is back)",
            self.tag(None),
            _address(self.client),
            unreachable_s,
            waiting_for,
        )
        raise PeerExit(1)

    def leave(self, peer_id: str, last_heartbeat, reason: str) -> None:
        """A last heartbeat carries the final numbers (if any), then the peer leaves; best effort both (the
        lease expires anyway)."""
        beat = [] if last_heartbeat is None else [lambda: self.client.heartbeat(last_heartbeat)]
        for call in [*beat, lambda: self.client.leave(peer_id=peer_id, reason=reason)]:
            try:
                call()
            except Exception as e:
                logger.debug("%s leaving: %r", self.tag(None), e)


def _address(client: CoordinatorClient) -> str:
    join = getattr(client, "join_string", None)
    return join.address if join is not None else "its address"
