"""Why the coordinator turns a request down: ValueErrors that carry a gRPC status code name.

The logic raises them with one sentence for the user; the servicer maps ``code`` to the gRPC status.
Kept free of grpc so the logic stays plain Python.
"""

from __future__ import annotations


class Rejection(ValueError):
    """A request the coordinator refuses; ``str(self)`` is one sentence that says what to do."""

    code = "FAILED_PRECONDITION"


class BadToken(Rejection):
    code = "UNAUTHENTICATED"

    def __init__(self) -> None:
        super().__init__("the join token is not valid for this run; ask the operator for the current join string.")


class UnknownPeer(Rejection):
    code = "NOT_FOUND"

    def __init__(self, peer_id: str) -> None:
        super().__init__(
            f"peer {peer_id or '(empty id)'} is not a member of this run; "
            "restart `swarm peer --join ...` to join again."
        )


class PeerGone(Rejection):
    """The peer left or was evicted; it must join again to take part."""

    code = "FAILED_PRECONDITION"


class StateMismatch(Rejection):
    """The peer's model or initial state differs from the run's; it was evicted."""

    code = "FAILED_PRECONDITION"


class BadRequest(Rejection):
    code = "INVALID_ARGUMENT"
