"""Progress people can see in the demo and the long benchmarks: a rich progress bar (done of total, and the
figures that matter: eval loss, bytes) when the console is a terminal, and one plain line per step
otherwise, so that CI logs stay readable."""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RunProgress:
    """``with RunProgress(10, what="rounds committed", console=c) as p: p.update(3, eval="2.31", sent="4 MB")``."""

    def __init__(self, total: Optional[int], *, what: str, console: Console, live: Optional[bool] = None) -> None:
        """``live``: draw a bar (default: when ``console`` is a terminal); otherwise print a line per step."""
        self.total, self.what, self.console = total, what, console
        self.live = console.is_terminal if live is None else live
        self._bar: Optional[Progress] = None
        self._task = None
        self._shown: Optional[tuple[int, str]] = None

    def __enter__(self) -> "RunProgress":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "RunProgress":
        if self.live and self._bar is None:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[figures]}"),
                console=self.console,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total, figures="")
        return self

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, done: int, **figures: str) -> None:
        """``done`` steps of ``total``; the bar shows ``figures`` as they are now, a plain line is printed
        only when ``done`` changed (one line per round, not one per poll)."""
        text = "  ".join(f"{name.replace('_', ' ')} {value}" for name, value in figures.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=done, figures=text)
        elif self._shown is None or self._shown[0] != done:
            total = "" if self.total is None else f"/{self.total}"
            self.console.print(f"{self.what} {done}{total}  {text}", soft_wrap=True, highlight=False)
        self._shown = (done, text)

    def note(self, line: str) -> None:
        """A line of its own above the bar (or among the plain lines)."""
        self.console.print(line, soft_wrap=True, highlight=False)
