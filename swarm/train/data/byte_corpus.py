"""Text read as bytes: the corpus as two uint8 tensors (a train split and, at its end, an eval split), read once
per process, and the SHA-256 of the bytes read (the data fingerprint of text as bytes)."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.config import DataConfig
from swarm.train.data.text_files import source_files

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ByteCorpus:
    """A corpus as two uint8 tensors.  They are shared by every user in the process: treat them as
    read-only."""

    train: torch.Tensor
    eval: torch.Tensor
    digest: str = ""  # SHA-256 of the bytes read (train then eval): what the data fingerprint of text as bytes hashes
    vocab_size = 256  # one token per byte
    min_vocab_size = 256

    @staticmethod
    def load(cfg: DataConfig) -> "ByteCorpus":
        """Read ``cfg.source`` (files in sorted order, up to ``cfg.max_bytes``); the eval split is the
        last ``cfg.eval_fraction`` of the bytes.  Cached per process: virtual peers share one copy."""
        return _load_cached(cfg.source, cfg.max_bytes, cfg.eval_fraction)


@functools.lru_cache(maxsize=4)
def _load_cached(source: str, max_bytes: Optional[int], eval_fraction: float) -> ByteCorpus:
    buf = bytearray()
    files_read = 0
    for path in source_files(source):
        if max_bytes is not None and len(buf) >= max_bytes:
            break
        buf += path.read_bytes()
        files_read += 1
    if max_bytes is not None:
        del buf[max_bytes:]
    if not buf:
        raise ValueError(f"data source {source!r} holds no bytes; point it at non-empty text files.")
    data = torch.frombuffer(buf, dtype=torch.uint8).clone()
    n_eval = max(1, round(len(data) * eval_fraction))
    corpus = ByteCorpus(
        train=data[: len(data) - n_eval], eval=data[len(data) - n_eval :], digest=hashlib.sha256(buf).hexdigest()
    )
    log.info(
        "corpus %s: %d files read, %d train bytes, %d eval bytes",
        source,
        files_read,
        corpus.train.numel(),
        corpus.eval.numel(),
    )
    return corpus
