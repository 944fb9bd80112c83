"""Train a small byte-level BPE tokenizer on local text, offline, for ``[data] tokenizer``.

    python scripts/train_tokenizer.py --source corpus/ --vocab-size 4096 --out tokenizer.json
    python scripts/train_tokenizer.py --source stdlib --vocab-size 100 --max-bytes 200000 --out tiny.json

It reads the files as ``[data] source`` does (sorted, hidden files skipped; ``stdlib`` is the standard library's
Python files) and needs ``pip install 'swarm-train[hf]'``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.config import ConfigError
from swarm.train.data.text_files import source_files


def texts(source: str, max_bytes: int | None) -> Iterator[str]:
    total = 0
    for path in source_files(source):
        if max_bytes is not None and total >= max_bytes:
            return
        data = path.read_bytes()[: None if max_bytes is None else max_bytes - total]
        total += len(data)
        yield data.decode("utf-8", errors="replace")


def train(source: str, *, vocab_size: int, out: str, max_bytes: int | None = None) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # All 256 byte symbols when the vocabulary has room, so any text encodes; a smaller (test) vocabulary keeps
    # only the symbols its text uses.
    alphabet = pre_tokenizers.ByteLevel.alphabet() if vocab_size > 256 else []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, limit_alphabet=vocab_size, show_progress=False
    )
    tokenizer.train_from_iterator(texts(source, max_bytes), trainer=trainer)
    tokenizer.save(out)
    return tokenizer.get_vocab_size()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, help="a text file, a directory of text files, or 'stdlib'")
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="tokens in the vocabulary (over 256: every byte encodes)"
    )
    parser.add_argument("--max-bytes", type=int, help="read at most this many bytes of text")
    parser.add_argument("--out", default="tokenizer.json", help="the tokenizer.json to write")
    args = parser.parse_args(argv)
    try:
        vocab = train(args.source, vocab_size=args.vocab_size, out=args.out, max_bytes=args.max_bytes)
    except (ConfigError, ValueError) as e:
        print(f"train_tokenizer: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({vocab} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
