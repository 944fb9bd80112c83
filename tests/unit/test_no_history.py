"""The repository states what the code and its measurements are, not how they came to be: no tracked text file
names a development session ("Session 21", "sessions 11–20", "until session 17") or an issue number ("issue 14",
"(issue 11, part 3)", "issue #12").

A peer's join *session* is product vocabulary and stays legal: ``session 1`` (a peer's first join), ``session
{peer.session}`` and ``joined.session`` in code and log text. Only the forms history takes are refused: a session
number of 2 or more ("session 15", "Session 21:" headings), plural sessions with a number ("sessions 11–12"), a
numbered session with a hyphen ("session-12 record"), "this session's code" and "earlier sessions", and any issue
number.
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
    # "session 15", "Session 21", "before session 16"; "session 1" (a peer's first join) is product vocabulary
    re.compile(r"\bsession\s+(?:[2-9]|[1-9]\d+)\b", re.IGNORECASE),
    # "sessions 11–20", "sessions 18 and 19"
    re.compile(r"\bsessions\s+\d", re.IGNORECASE),
    # "the session-12 record", "session s10-bulk"
    re.compile(r"\bsession[- ]s?\d+-|\bsession-\d", re.IGNORECASE),
    # "this session's code", "that session's machine", "earlier sessions" (not a peer's "next session" or
    # "its last session's measured step time")
    re.compile(r"\b(?:this|that|earlier|previous)\s+session(?:'s)?\s+(?:code|machine|start|run)\b"
               r"|\bearlier\s+sessions\b", re.IGNORECASE),
    # "issue 14", "(issue 11, part 3)", "issue #12", "issues 10 and 11"
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
    history = ["## Session 21: low-density ternary", "Until session 17 the check ran once", "(sessions 11–12)",
               "the session-12 record", "on this session's code", "(issue 11, part 3)", "issue 14's winning row",
               "see issue #12", "(from before session 16)"]
    product = ["sets ``coordinator_decided`` for session 1.)", 'f"(session {peer.session}, this process has session',
               "joined as index %d, session %d (name %r)", "joined.session <= 1", "its last session's measured step time",
               "the test session", "credential.issue(key, credential.Credential(", "a TLS session", "and its next session."]
    assert [line for line in history if not any(p.search(line) for p in PATTERNS)] == []
    assert [line for line in product if any(p.search(line) for p in PATTERNS)] == []


def test_no_tracked_text_file_names_a_development_session_or_an_issue_number() -> None:
    found = history_lines(_tracked_text_files())
    assert not found, ("development history in the repository (state what the code does and why, or drop it):\n"
                       + "\n".join(found))
