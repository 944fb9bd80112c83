"""What each fragment of a model syncs (Streaming DiLoCo's F fragments; one fragment: the whole model)."""

from __future__ import annotations

from typing import Sequence

import torch

from swarm.core import fragments, spans


class FragmentLayout:
    """The element spans each fragment syncs (whole tensors, except with the "balanced" pattern) and the parameters
    it holds elements of; checked against the outer optimizer (``spans.check_outer``)."""

    def __init__(self, named_shapes: Sequence[tuple[str, torch.Size]], count: int, pattern: str, outer: str) -> None:
        shapes = [shape for _, shape in named_shapes]
        self.spans: list[list[spans.Span]] = fragments.fragment_spans(list(named_shapes), count, pattern)
        self.params: list[list[int]] = [sorted({s.param for s in group}) for group in self.spans]
        spans.check_outer(outer, pattern, self.spans, shapes)
        self.all_spans = spans.whole(shapes, range(len(shapes)))

    def of(self, fragment: int | None) -> list[spans.Span]:
        """``fragment``'s spans (None: every parameter); ValueError for a fragment the run does not have."""
        if fragment is None:
            return self.all_spans
        if not 0 <= fragment < len(self.spans):
            raise ValueError(f"fragment {fragment} does not exist; this run has {len(self.spans)}.")
        return self.spans[fragment]

    def index(self, fragment: int | None) -> int:
        """``fragment``, or the only one when None names it (ValueError when the run has several)."""
        if fragment is None:
            if len(self.spans) != 1:
                raise ValueError(f"this run has {len(self.spans)} fragments; name the one to sync.")
            return 0
        self.of(fragment)
        return fragment
