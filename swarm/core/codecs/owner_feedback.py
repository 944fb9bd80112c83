"""Error feedback for a butterfly slice owner's second encoding.

In a butterfly all-reduce the owner of a slice reduces the groupmates' decoded slices and encodes the
average once more for everyone. A coarse codec (``sign``: 1 bit) loses as much there as in the first
encoding, and no peer's own error feedback sees that loss. With ``Codec.owner_feedback`` the owner
keeps it: it sends ``encode(average + residual)`` and keeps ``residual = (average + residual) − decoded``
for the next round in which it owns the same slice of the same fragment (a large vector's butterfly goes in
stripes, ``swarm.core.average.butterfly_bounds``: a member owns one slice of each, each with its residual).

A residual belongs to exact element bounds. When the group or the slice bounds change (a member
joins or leaves, the controller re-cuts slices), the old residual covers elements this peer no longer
owns, and it is dropped: the update loses at most one round's re-encoding error of that slice, which
is what every round lost before owner feedback existed. It is local (never sent) and does not enter
the global state, so dropping it leaves every peer's θg identical.

The exchange stages the new residual; the round commits it (``commit``) or, when the round is voided
and nobody applied the average, forgets it (``discard``), keeping the previous one.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

Bounds = tuple[int, int]


class OwnerFeedback:
    """One peer's residuals of the averaged slices it last owned in one fragment's exchange (one per stripe).

    Written by the exchange's threads (``compensate``/``stage``: stripes reduced at once stage under a lock) and
    then, after the round's future, by the round runner (``commit``/``discard``): never at the same time."""

    def __init__(self) -> None:
        self.residuals: dict[Bounds, torch.Tensor] = {}  # by the slice [start, end) each covers
        self._pending: Optional[dict[Bounds, torch.Tensor]] = None
        self._staging = threading.Lock()

    @property
    def bounds(self) -> list[Bounds]:
        """The slices the residuals cover, in vector order."""
        return sorted(self.residuals)

    @property
    def residual(self) -> Optional[torch.Tensor]:
        """The residuals of the slices, concatenated in vector order (None: none held)."""
        return torch.cat([self.residuals[b] for b in self.bounds]) if self.residuals else None

    def compensate(self, bounds: Bounds, average: torch.Tensor) -> torch.Tensor:
        """``average`` + the residual when one covers exactly ``bounds``, else ``average`` itself."""
        residual = self.residuals.get(tuple(bounds))
        if residual is None or residual.numel() != average.numel():
            return average
        return average + residual

    def stage(self, bounds: Bounds, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """The residual this round would leave over ``bounds``: ``sent_input − decoded``."""
        if sent_input.shape != decoded.shape:
            raise ValueError(f"owner feedback: sent {tuple(sent_input.shape)} but decoded {tuple(decoded.shape)}.")
        residual = sent_input - decoded
        with self._staging:
            if self._pending is None:
                self._pending = {}
            self._pending[tuple(bounds)] = residual

    def commit(self) -> None:
        """The round committed: the staged residuals replace the old ones (a round that owned nothing, e.g. a
        member with an empty slice, drops them)."""
        self.residuals, self._pending = self._pending or {}, None

    def discard(self) -> None:
        """The round was voided: nobody applied its average, so the previous residuals stay."""
        self._pending = None

    def reset(self) -> None:
        self.residuals, self._pending = {}, None
