"""Start ``swarm`` commands for the integration tests as a user's shell would, but forked from a process that
has already imported torch, hivemind, grpc and Swarm (multiprocessing's forkserver), instead of a fresh
interpreter each: the suite starts ~75 coordinators and peers, and each fresh one spent ~4 CPU-s importing
(torch alone ~2.6 s here) before it did anything a test is about.

A launched command is the CLI's own ``main(argv)`` in a real process of its own, with its own stdout and
stderr files, environment and working directory; it exits as the interpreter would (non-daemon threads joined,
then ``atexit`` handlers, then the exit status), and is killed and signalled by pid like any process.
``LaunchedCli`` is the part of ``subprocess.Popen`` the tests use. Benchmarks and soaks (scripts/) start cold
interpreters: a user's restart pays the imports, and what they measure must too."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from peer.restarts import exit_as_the_interpreter

# swarm.net first: it keeps hivemind's scipy import deferred (swarm/net/deferred_imports.py), as the CLI does
PRELOAD = ["swarm.net", "torch", "hivemind", "grpc", "swarm.app.cli", "peer.run", "coordinator.server"]

_context: Optional[multiprocessing.context.ForkServerContext] = None
_lock = threading.Lock()


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver (started on first use: ~4 s once per test process)."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            from multiprocessing import forkserver

            forkserver.ensure_running()
            _context = ctx
        return _context


def launch(argv: list[str], *, stdout: Path, stderr: Path, env: dict[str, str], cwd: Path) -> "LaunchedCli":
    """``python -m swarm.app.cli *argv`` with stdout and stderr appended to those files."""
    for path in (stdout, stderr):
        Path(path).touch()  # there to read before the child opens them
    process = context().Process(
        target=_run_cli,
        args=(list(argv), str(stdout), str(stderr), dict(env), str(cwd)),
        name="swarm " + " ".join(argv[:1]),
    )
    process.start()
    return LaunchedCli(process, ["swarm", *argv], stdout if stdout != stderr else None)


def _run_cli(argv: list[str], stdout: str, stderr: str, env: dict[str, str], cwd: str) -> None:
    """In the forked child: become the command, then exit the way the interpreter ends a script."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # PYTHONUNBUFFERED, as harness sets
    sys.argv = [sys.executable, *argv]
    code: object = 1
    try:
        from swarm.app.cli import main

        code = main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        exit_as_the_interpreter(code)  # as `swarm peer --max-restarts` ends its forked peers


class LaunchedCli:
    """A launched command, with the Popen methods the tests call (exit status: negative for a signal)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str], stdout: Optional[Path]) -> None:
        self._process = process
        self.args = args
        self.pid = process.pid
        self.stdout = _Follow(stdout, self) if stdout is not None else None

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:  # not yet reaped: the pid is still this process's
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _Follow:
    """``stdout.readline()`` over the file a launched command writes its stdout to: the next whole line, as
    bytes; b"" once the command has exited and every line was read."""

    def __init__(self, path: Path, owner: LaunchedCli) -> None:
        self._path, self._owner, self._offset = path, owner, 0

    def readline(self) -> bytes:
        while True:
            exited = self._owner.poll() is not None  # before reading: what it wrote before exiting is read
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                line = f.readline()
            if line.endswith(b"\n") or exited:
                self._offset += len(line)
                return line
            time.sleep(0.05)  # a file has no readiness to wait on; lines come a few a second at most
