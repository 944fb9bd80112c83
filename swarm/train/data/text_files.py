"""The text files a ``[data] source`` names, in an order every machine agrees on: the standard library's
Python files (``stdlib``), one file, or a directory's files (hidden ones skipped)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

_THIRD_PARTY_DIRS = {"site-packages", "dist-packages"}


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path relative to the stdlib root.

    The same Python version gives the same list (and so the same corpus) on every machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, keep=lambda name: name.endswith(".py"), skip_dirs=_THIRD_PARTY_DIRS)


def _walk(root: Path, *, keep, skip_dirs: set[str]) -> list[Path]:
    """Files under ``root`` sorted by relative POSIX path; pruned dirs are never descended into
    (site-packages can be much larger than the stdlib itself)."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not d.startswith((".", "__pycache__"))]
        for name in filenames:
            if keep(name):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return [path for _, path in found]


def source_files(source: str) -> list[Path]:
    if source == "stdlib":
        return stdlib_files()
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        # Hidden files and folders (.git, editor swap files) are not text the user meant to train on.
        return _walk(path, keep=lambda name: not name.startswith("."), skip_dirs=set())
    raise ValueError(f"data source {source!r} does not exist; give 'stdlib' or a path to text files.")
