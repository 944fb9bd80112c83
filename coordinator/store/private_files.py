"""The coordinator's state dir and the files in it that hold secrets (the join token, the TLS key): owner-only."""

from __future__ import annotations

import os
from pathlib import Path

from coordinator.store.database import STORE_FILE
from swarm.control import tls

JOIN_STRING_FILE = "join-string"


def private_dir(path: Path) -> None:
    """The state dir holds the join token and the TLS key: only its owner may enter it."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"the state dir {path} is a file; give --state-dir a directory.")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)


def private_files(state_dir: Path) -> None:
    """The store holds the join token: create it owner-only (SQLite gives its -wal and -shm files the
    database file's mode) and tighten files an older version left readable."""
    database = state_dir / STORE_FILE
    os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))
    for path in (
        database,
        state_dir / f"{STORE_FILE}-wal",
        state_dir / f"{STORE_FILE}-shm",
        state_dir / JOIN_STRING_FILE,
        state_dir / tls.KEY_FILE,
    ):
        if path.exists():
            os.chmod(path, 0o600)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a file that already existed
    with os.fdopen(fd, "w") as f:
        f.write(text)
