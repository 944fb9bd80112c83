"""The repository states what the code and its measurements are, not how they came to be: no tracked text file
names a development session or an issue number (the forms are in ``HISTORY`` below).

A peer's join *session* is product vocabulary and stays legal: a peer's first session, ``session
{peer.session}`` and ``joined.session`` in code and log text (``PRODUCT`` below). Only the forms history takes
are refused: a numbered session of 2 or more, plural sessions with a number, a numbered session with a hyphen,
"this session's code" and "earlier sessions", and any issue number.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

PATTERNS = [
    # a numbered session of 2 or more; a peer's first join session is product vocabulary
    re.compile(r"\bsession\s+(?:[2-9]|[1-9]\d+)\b", re.IGNORECASE),
    # plural sessions with a number
    re.compile(r"\bsessions\s+\d", re.IGNORECASE),
    # a numbered session with a hyphen
    re.compile(r"\bsession[- ]s?\d+-|\bsession-\d", re.IGNORECASE),
    # "this session's code", "that session's machine", "earlier sessions" (not a peer's "next session" or
    # "its last session's measured step time")
    re.compile(
        r"\b(?:this|that|earlier|previous)\s+session(?:'s)?\s+(?:code|machine|start|run)\b"
        r"|\bearlier\s+sessions\b",
        re.IGNORECASE,
    ),
    # any issue number, with or without "#"
    re.compile(r"\bissues?\s+#?\d", re.IGNORECASE),
]


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    paths = []
    for name in names.decode().split("\0"):
        if not name or name == THIS_FILE or name.endswith(".json"):
            continue
        path = ROOT / name
        if path.is_file():
            paths.append(path)
    return paths


def history_lines(paths: list[Path]) -> list[str]:
    """``file:line: text`` for every line of ``paths`` that names a development session or an issue number."""
    found = []
    for path in paths:
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        if not any(p.search(text) for p in PATTERNS):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(p.search(line) for p in PATTERNS):
                found.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {line.strip()[:160]}")
    return found


def test_the_patterns_tell_history_from_a_peers_join_session() -> None:
    n, m = 21, 12  # (the examples are made from templates, so that this file names no session itself)
    history = [
        f"## Session {n}: low-density ternary",
        f"Until session {n} the check ran once",
        f"(sessions {m}–{n})",
        f"the session-{m} record",
        "on this session's code",
        f"(issue {m}, part 3)",
        f"issue {n}'s winning row",
        f"see issue #{m}",
        f"(from before session {n})",
    ]
    product = [
        f"sets ``coordinator_decided`` for session {1}.)",
        'f"(session {peer.session}, this process has session',
        "joined as index %d, session %d (name %r)",
        "joined.session <= 1",
        "its last session's measured step time",
        "the test session",
        "credential.issue(key, credential.Credential(",
        "a TLS session",
        "and its next session.",
    ]
    assert [line for line in history if not any(p.search(line) for p in PATTERNS)] == []
    assert [line for line in product if any(p.search(line) for p in PATTERNS)] == []


def test_no_tracked_text_file_names_a_development_session_or_an_issue_number() -> None:
    found = history_lines(_tracked_text_files())
    assert not found, (
        "development history in the repository (state what the code does and why, or drop it):\n" + "\n".join(found)
    )
