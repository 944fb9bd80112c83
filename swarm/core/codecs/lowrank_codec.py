"""The ``lowrank{r}-{values}`` codec names (e.g. ``lowrank4-fp16``): a rank-r projection of every
2-D parameter whose two thin factors go over the wire in ``values``. The exchange and its math are in
``swarm.core.codecs.lowrank``; here only the name and the wire format of each of its two all-reduces."""

from __future__ import annotations

import re
from typing import Optional

import torch

from swarm.core.codecs.codec_base import Codec

_NAME = re.compile(r"lowrank(\d+)-(\w+)")
MAX_RANK = 64


class LowRankCodec(Codec):
    """A rank-r projection whose two factors go over the wire in ``values`` (fp16, int8, int4, ...).

    ``encode``/``decode`` are the values' codec: what each of the two all-reduces sends."""

    lowrank = True

    def __init__(self, rank: int, values: Codec) -> None:
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"a low-rank codec's rank must be between 1 and {MAX_RANK}, got {rank}.")
        self.rank, self.values = rank, values
        self.name = f"lowrank{rank}-{values.name}"
        self.block = values.block

    def encoded_size(self, numel: int) -> int:
        return self.values.encoded_size(numel)

    def encode(self, t: torch.Tensor) -> bytes:
        return self.values.encode(t)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        return self.values.decode(data, numel)


def parse_lowrank(name: str, codecs: dict[str, Codec]) -> Optional[LowRankCodec]:
    """``lowrank4-fp16`` -> LowRankCodec(4, fp16); None when ``name`` is not of that form."""
    match = _NAME.fullmatch(name)
    if match is None or match.group(2) not in codecs:
        return None
    values = codecs[match.group(2)]
    if values.gathered or values.lowrank or values.owner_feedback:
        return None  # sparse, low-rank or 1-bit values do not average in a plain butterfly
    return LowRankCodec(int(match.group(1)), values)
