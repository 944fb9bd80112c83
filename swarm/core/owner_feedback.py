"""Error feedback for a butterfly slice owner's second encoding.

In a butterfly all-reduce the owner of a slice reduces the groupmates' decoded slices and encodes the
average once more for everyone. A coarse codec (``sign``: 1 bit) loses as much there as in the first
encoding, and no peer's own error feedback sees that loss. With ``Codec.owner_feedback`` the owner
keeps it: it sends ``encode(average + residual)`` and keeps ``residual = (average + residual) − decoded``
for the next round in which it owns the same slice of the same fragment.

The residual belongs to exact element bounds. When the group or the slice bounds change (a member
joins or leaves, the controller re-cuts slices), the old residual covers elements this peer no longer
owns, and it is dropped: the update loses at most one round's re-encoding error of that slice, which
is what every round lost before owner feedback existed. It is local (never sent) and does not enter
the global state, so dropping it leaves every peer's θg identical.

The exchange stages the new residual; the round commits it (``commit``) or, when the round is voided
and nobody applied the average, forgets it (``discard``), keeping the previous one.
"""

from __future__ import annotations

from typing import Optional

import torch

Bounds = tuple[int, int]


class OwnerFeedback:
    """One peer's residual of the averaged slice it last owned in one fragment's exchange.

    Written by the exchange's thread (``compensate``/``stage``) and then, after the round's future, by
    the round runner (``commit``/``discard``): never at the same time."""

    def __init__(self) -> None:
        self.bounds: Optional[Bounds] = None  # the slice [start, end) the residual covers
        self.residual: Optional[torch.Tensor] = None
        self._pending: Optional[tuple[Bounds, torch.Tensor]] = None

    def compensate(self, bounds: Bounds, average: torch.Tensor) -> torch.Tensor:
        """``average`` + the residual when it covers exactly ``bounds``, else ``average`` itself."""
        if self.residual is None or self.bounds != tuple(bounds) or self.residual.numel() != average.numel():
            return average
        return average + self.residual

    def stage(self, bounds: Bounds, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """The residual this round would leave: ``sent_input − decoded`` over ``bounds``."""
        if sent_input.shape != decoded.shape:
            raise ValueError(f"owner feedback: sent {tuple(sent_input.shape)} but decoded {tuple(decoded.shape)}.")
        self._pending = (tuple(bounds), sent_input - decoded)

    def commit(self) -> None:
        """The round committed: the staged residual replaces the old one (a round that owned nothing,
        e.g. a member with an empty slice, drops it)."""
        if self._pending is None:
            self.bounds, self.residual = None, None
        else:
            (self.bounds, self.residual), self._pending = self._pending, None

    def discard(self) -> None:
        """The round was voided: nobody applied its average, so the previous residual stays."""
        self._pending = None

    def reset(self) -> None:
        self.bounds, self.residual, self._pending = None, None, None
