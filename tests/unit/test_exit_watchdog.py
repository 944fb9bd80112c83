"""A finished peer whose interpreter exit hangs (a thread that never ends) still exits, with its code and every
thread's stack in its log (peer/run.py ``exit_within``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]

HUNG_EXIT = """
import logging, threading, time
from peer.run import exit_within
logging.basicConfig(level=logging.INFO)
def stuck_in_teardown():
    time.sleep(600)
threading.Thread(target=stuck_in_teardown).start()  # not a daemon: the interpreter's exit waits for it
exit_within(1.0, 3)
"""


def test_a_peer_whose_exit_hangs_exits_with_its_code_and_shows_where_it_hung() -> None:
    result = subprocess.run(
        [sys.executable, "-c", HUNG_EXIT],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 3
    assert "the peer is done but its process has not exited 1s later; its threads:" in result.stderr
    assert "in stuck_in_teardown" in result.stderr
