"""Work the main thread waits for but does not wait out: a state download runs on a thread of its own, so that a
stopped peer leaves at once instead of after it."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def unless_stopped(
    fn: Callable[[], T], stop: threading.Event, *, name: str, check_s: float = 0.1
) -> tuple[bool, Optional[T]]:
    """``(True, fn())`` run on a thread named ``name`` (its exception re-raised here), or ``(False, None)`` as soon
    as ``stop`` is set while it still runs: the thread is left to end on its own (the transport's shutdown cancels
    a download). ``check_s``: how often ``stop`` is looked at."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # re-raised on the calling thread
            done.set_exception(e)

    threading.Thread(target=work, name=name, daemon=True).start()
    while not stop.is_set():
        try:
            return True, done.result(timeout=check_s)
        except concurrent.futures.TimeoutError:
            continue
    if done.done():
        return True, done.result()
    return False, None
