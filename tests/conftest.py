"""Shared test fixtures: reap every child process a test started, even when it fails."""

import os
import signal

import psutil
import pytest


@pytest.fixture(autouse=True)
def reap_children():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    for child in psutil.Process().children(recursive=True):
        if child.pid in before:
            continue
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs([c for c in psutil.Process().children(recursive=True) if c.pid not in before], timeout=5)
