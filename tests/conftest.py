"""Shared test fixtures: reap every child process a test started, even when it fails."""

import gc
import os
import signal

# hypothesis's pytest plugin imports hypothesis at the terminal summary when no test did; pytest then parses its
# modules (assertion rewriting) while abandoned asyncio coroutines are finalized, which CPython 3.11 can break
# ("AST constructor recursion depth mismatch", exit 1 after every test passed). Imported here, nothing is left late.
import hypothesis  # noqa: E402,F401
import psutil
import pytest
import torch

import swarm.net  # noqa: F401  before any test imports hivemind: keeps scipy.optimize unloaded until used
from peer.restarts import become_subreaper  # noqa: E402

# Orphans re-parent to this process instead of init, so the reaper below still sees them: a test that SIGKILLs a
# coordinator or peer would otherwise orphan its hivemind DHT process (a fork) and that process's p2pd, which then
# outlive the test session.
become_subreaper()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the machine's cores: one torch thread each, or their intra-op threads spin-wait on
    # each other (tests that need a thread count set it themselves, see one_torch_thread).
    torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Before pytest formats a failure (it parses the test's source): finalize what the test abandoned. An asyncio
    coroutine finalized while CPython 3.11 builds an AST breaks the parse ("AST constructor recursion depth
    mismatch"), and pytest then aborts the whole run with an INTERNALERROR instead of reporting the one failure."""
    if call.excinfo is not None:
        gc.collect()
    yield


@pytest.fixture(scope="session", autouse=True)
def torch_shm_manager():
    """Start torch's shared-memory manager (a coordinator's DHT node needs it) before any test: the reaper
    below kills what a test started, and a reaped manager breaks every later DHT start in the session."""
    torch.zeros(1).share_memory_()


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


@pytest.fixture
def one_torch_thread():
    """Train single-threaded, as the peers do: GEMM bits depend on the thread count, and two intra-op
    threads on a shared 2-core machine spin-wait and can run 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
