"""Token files as a corpus: nanoGPT-style flat binaries of token ids (``[data] tokens``, a file or a glob),
memory-mapped and never read whole, with a held-out split (the last ``eval_fraction``, or ``eval_tokens``).

``TokenArray`` behaves like the byte corpus's 1-D tensor where the sampler and the evaluation touch it
(``numel``, slicing, gathering windows by an index tensor), so shards, the resumable sampler and the eval
windows work on both alike.
"""

from __future__ import annotations

import functools
import glob
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

VOCAB_PROBE_TOKENS = 1 << 20  # the model's vocabulary is checked against the largest id among these


class TokenArray:
    """Tokens ``[lo, hi)`` of the concatenation of memory-mapped files."""

    def __init__(self, arrays: list[np.ndarray], lo: int = 0, hi: int | None = None) -> None:
        self._arrays = arrays
        self._offsets = np.cumsum([0] + [len(a) for a in arrays])
        self._lo = lo
        self._hi = int(self._offsets[-1]) if hi is None else hi

    def numel(self) -> int:
        return self._hi - self._lo

    def __len__(self) -> int:
        return self.numel()

    def __getitem__(self, key: slice | torch.Tensor) -> "TokenArray | torch.Tensor":
        if isinstance(key, slice):
            start, stop, step = key.indices(self.numel())
            if step != 1:
                raise ValueError("token arrays slice contiguously only.")
            return TokenArray(self._arrays, self._lo + start, self._lo + max(start, stop))
        index = np.asarray(key, dtype=np.int64) + self._lo
        if index.size and (index.min() < self._lo or index.max() >= self._hi):
            raise IndexError("token index out of range.")
        out = np.empty(index.shape, dtype=np.int64)
        which = np.searchsorted(self._offsets[1:], index, side="right")
        for f in np.unique(which):
            mask = which == f
            out[mask] = self._arrays[f][index[mask] - self._offsets[f]]
        return torch.from_numpy(out)

    def max_id(self, limit: int) -> int:
        """The largest token id among the first ``limit`` tokens."""
        return int(self[torch.arange(min(limit, self.numel()))].max()) if self.numel() else -1


@dataclass(frozen=True, eq=False)
class TokenCorpus:
    train: TokenArray
    eval: TokenArray
    vocab_size: int | None  # the tokenizer's, when one made the tokens (None: unknown)
    min_vocab_size: int  # at least this many ids appear to be in use (the largest id seen, plus one)


def token_files(pattern: str) -> list[Path]:
    """The files ``pattern`` names (a path or a glob), sorted, so every peer reads them in one order."""
    matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    files = [Path(m) for m in matches if Path(m).is_file()]
    if not files:
        raise ConfigError(
            f"[data] tokens {pattern!r} names no files; give a token file or a glob such as 'data/*.bin'."
        )
    return files


def _memmap(path: Path, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % width:
        raise ConfigError(f"{path} holds {size} bytes, not a whole number of {dtype} tokens; check [data] token_dtype.")
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def open_tokens(files: list[Path], dtype: str) -> TokenArray:
    return TokenArray([_memmap(f, dtype) for f in files])


def load_token_corpus(cfg: DataConfig, *, tokens: str | None = None, vocab_size: int | None = None) -> TokenCorpus:
    """Token files (``tokens`` overrides ``cfg.tokens``: the tokenized-text cache) split into train and eval."""
    return _load_cached(tokens or cfg.tokens, cfg.token_dtype, cfg.eval_tokens, cfg.eval_fraction, vocab_size)


@functools.lru_cache(maxsize=4)
def _load_cached(
    tokens: str, dtype: str, eval_tokens: str, eval_fraction: float, vocab_size: int | None
) -> TokenCorpus:
    every = open_tokens(token_files(tokens), dtype)
    if eval_tokens:
        train, held_out = every, open_tokens(token_files(eval_tokens), dtype)
    else:
        n_eval = max(1, round(every.numel() * eval_fraction))
        train, held_out = every[: every.numel() - n_eval], every[every.numel() - n_eval :]
    corpus = TokenCorpus(
        train=train,
        eval=held_out,
        vocab_size=vocab_size,
        min_vocab_size=max(train.max_id(VOCAB_PROBE_TOKENS), held_out.max_id(VOCAB_PROBE_TOKENS)) + 1,
    )
    log.info("tokens %s: %d train tokens, %d eval tokens", tokens, train.numel(), held_out.numel())
    return corpus
