"""The one error an exchange ends with when it cannot complete: matchmaking (``swarm.net.exchange.rendezvous``) and the
all-reduce (``swarm.net.exchange.allreduce``) raise it, the round runner turns it into a failed vote."""

from __future__ import annotations


class ExchangeFailed(RuntimeError):
    """The group could not complete the average; nothing of it may be applied."""

    def __init__(self, message: str, *, from_groupmate: bool = False, unreachable: bool = False):
        super().__init__(message)
        self.from_groupmate = from_groupmate  # a groupmate's abort: not passed on again
        self.unreachable = unreachable  # a groupmate could not be dialled
