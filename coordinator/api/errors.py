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


class NotAuthenticated(Rejection):
    """A call without a valid signature of a known member: the same answer whether the peer id exists or not."""

    code = "UNAUTHENTICATED"

    def __init__(self) -> None:
        super().__init__(
            "this call is not signed by a member of this run; restart `swarm peer --join ...` to join again."
        )


class BadJoinProof(Rejection):
    """A join whose signatures do not check out."""

    code = "UNAUTHENTICATED"


class StaleChallenge(Rejection):
    """The join's challenge is unknown, used or expired: the client fetches a fresh one and tries again."""

    code = "ABORTED"

    def __init__(self) -> None:
        super().__init__("the join's challenge was already used or has expired; join again to get a fresh one.")


class RateLimited(Rejection):
    code = "RESOURCE_EXHAUSTED"


class WrongProtocol(Rejection):
    """A peer of another generation of Swarm's wire formats: it could not average with the run's peers."""

    code = "FAILED_PRECONDITION"
