"""``swarm peer --max-restarts N``: the peer runs in a child forked from a parent that has already imported
everything a peer needs (torch, hivemind, the trainer), and when that child dies — a crash, an out-of-memory
kill, ``kill -9`` — the parent forks a new one at once, which rejoins from the same state dir without paying
the imports again (~4 CPU-s of a cold start here, torch alone ~2.6 s). torchrun's ``--max-restarts`` does
the same for its workers, from a cold interpreter. Processes that keep dying before they train are restarted
after growing waits (``backoff_s``), not in a tight loop.

What is restarted and what is not: a child killed by a signal, or one that ended on an exception nobody
caught (exit ``CRASHED``). A peer that finished or left (0), was refused or misconfigured (2), or was
interrupted (130) is not: a restart would end the same way. SIGINT and SIGTERM to the parent are passed on
to the child (it leaves the run as it would alone; a second SIGINT, from the terminal to the whole group,
changes nothing) and end the supervision.

When a child dies, its DHT process and p2pd are re-parented to the parent (a child subreaper), which kills and
reaps them before the next start, so nothing of a dead peer outlives it. The child stays in the parent's process
group: killing the group (``kill -9 -PGID``, a terminal's Ctrl-C) reaches all of them, as without a supervisor.

The parent starts no thread and touches no device before it forks (a CUDA context does not survive a fork):
device checks run in each child."""

from __future__ import annotations

import atexit
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

from peer import startup

logger = logging.getLogger("peer.daemon")

CRASHED = 70  # sysexits' EX_SOFTWARE: the child ended on an uncaught exception
NOT_RESTARTED = (0, 2, 130)  # finished or left; refused or misconfigured; interrupted
MAX_BACKOFF_S = 60.0  # the longest wait before restarting a process that keeps dying before it trains
LEFTOVERS_WAIT_S = 2.0  # how long a dead child's leftovers (DHT process, p2pd) get to vanish after SIGKILL
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1

# What a peer imports on its way to training, imported once by the parent so that no child pays for it
# (swarm.net first: it keeps hivemind's scipy import deferred, swarm/net/deferred_imports.py)
PRELOAD = (
    "swarm.net",
    "torch",
    "hivemind",
    "swarm.net.bulk.transport",
    "swarm.net.exchange.allreduce",
    "peer.daemon",
    "peer.run",
    "swarm.train.trainer",
    "swarm.train.eager_optimizer",
)


def supervise(run: Callable[[], int], *, max_restarts: int, preload: tuple[str, ...] = PRELOAD) -> int:
    """Run ``run`` in forked children until one ends in a way a restart would not change, or ``max_restarts``
    restarts were spent; the exit code to exit with. ``preload``: the modules the parent imports first."""
    for name in preload:
        importlib.import_module(name)
    become_subreaper()
    stopping: list[int] = []
    child: list[int] = []  # the running child's pid (the signal handlers read it)
    woken = threading.Event()  # a backoff's wait ends early on SIGINT/SIGTERM (no thread: set by the handler)

    def forward(signum, frame) -> None:
        stopping.append(signum)
        woken.set()
        if child:
            _signal(child[0], signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    launch = time.monotonic() - (startup.seconds_since_launch() or 0.0)
    restarts = quick_deaths = 0
    while True:
        startup.launched_at = launch if restarts == 0 else None  # a restart counts from its own fork
        started = time.monotonic()
        trained_r, trained_w = os.pipe()  # the child writes a byte once it trains (startup.on_first_round)
        pid = _fork_child(run, trained_w)
        os.close(trained_w)
        child[:] = [pid]
        if stopping:  # a signal that came while the child was being forked
            _signal(pid, stopping[-1])
        code = _wait(pid)
        child.clear()
        _end_leftovers()
        if stopping and code < 0 and -code != stopping[-1]:  # it died of something else as the signal came
            return 128 + stopping[-1]
        if stopping or code in NOT_RESTARTED:
            return code if code >= 0 else 128 - code
        if restarts >= max_restarts:
            logger.error(
                "the peer process %s; it was restarted %d times (--max-restarts), giving up", _ended(code), restarts
            )
            return code if code > 0 else 1
        restarts += 1
        lived = time.monotonic() - started
        quick_deaths = 0 if _trained(trained_r) else quick_deaths + 1
        delay = backoff_s(quick_deaths)
        logger.warning(
            "the peer process %s after %.1fs; starting it again %s from its state dir (restart %d of %d)",
            _ended(code),
            lived,
            f"in {delay:.0f}s" if delay else "at once",
            restarts,
            max_restarts,
        )
        if woken.wait(delay):
            return 128 + stopping[-1]


def backoff_s(quick_deaths: int) -> float:
    """The wait before a restart, after ``quick_deaths`` deaths in a row of processes that never started
    training: none for the first (back at once), then 1, 2, 4, ... up to MAX_BACKOFF_S, so that a process that
    cannot start (out of memory at once, a coordinator that refuses it) is not restarted in a tight loop."""
    return 0.0 if quick_deaths <= 1 else min(MAX_BACKOFF_S, 2.0 ** (quick_deaths - 2))


def _trained(trained_r: int) -> bool:
    """Whether the dead child had started training (it wrote to the pipe); closes the pipe."""
    try:
        os.set_blocking(trained_r, False)
        return bool(os.read(trained_r, 1))
    except BlockingIOError:
        return False
    finally:
        os.close(trained_r)


def _fork_child(run: Callable[[], int], trained_w: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    startup.on_first_round = lambda: os.write(trained_w, b"t")
    # the child: the peer itself, with the signal handlers a fresh one has
    code: object = CRASHED
    try:
        _die_with_parent(parent)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = run()
    except SystemExit as e:
        code = e.code
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  reported, and the parent restarts
        traceback.print_exc()
        code = CRASHED
    finally:
        exit_as_the_interpreter(code)


def exit_as_the_interpreter(code: object) -> NoReturn:
    """End this (forked) process the way the interpreter ends a script: non-daemon threads joined, then the
    atexit handlers, the streams flushed; ``code`` as SystemExit takes it (None: 0; not an int: printed, 1)."""
    status = 0 if code is None else code if isinstance(code, int) else 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        if status == 1 and not isinstance(code, int):
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status & 0xFF)


def _wait(pid: int) -> int:
    """The child's exit code, negative for the signal that killed it; meanwhile reaps the orphans of earlier
    children as they end (torch's shared-memory manager, which leaves the dead child's process group)."""
    while True:
        try:
            ended, status = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        if ended == pid:
            return os.waitstatus_to_exitcode(status)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _end_leftovers() -> None:
    """SIGKILL and reap what a dead child left (its DHT process, then that one's p2pd, torch's shared-memory
    manager: orphans, re-parented to this process, their subreaper), so that nothing of it lingers and a fixed
    --p2p-port is free again for the next child; done once this process has no child left."""
    deadline = time.monotonic() + LEFTOVERS_WAIT_S
    while time.monotonic() < deadline:
        for pid in children(os.getpid()):
            _signal(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # none left
        time.sleep(0.01)  # SIGKILL is not instant, and a killed DHT process's p2pd is re-parented only then


def children(parent: int) -> list[int]:
    """The pids of ``parent``'s children (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == parent:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # gone meanwhile
    return found


def peer_processes(supervisor: int) -> list[int]:
    """The running peer process of the `swarm peer --max-restarts` whose pid is ``supervisor`` (a fork: a child
    with its command line; [] between two), for soaks and benchmarks that kill it as a crash would."""

    def cmdline(pid: int) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()  # b"" for a zombie
        except OSError:
            return b""

    own = cmdline(supervisor)
    return [pid for pid in children(supervisor) if own and cmdline(pid) == own]


def _die_with_parent(parent: int) -> None:
    """A SIGKILL for the child when the supervising parent dies (kill -9 of `swarm peer` ends the peer too)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def become_subreaper() -> None:
    """Orphans of this process's descendants (a dead child's DHT process, then p2pd) re-parent to it instead of
    init, so it sees and reaps them (also the test suite's reaper, tests/conftest.py)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _prctl(option: int, value: int) -> None:
    """Linux prctl(2); nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"crashed (exit {code})"
