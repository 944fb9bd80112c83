"""Progress people can see: a bar on a terminal, one plain line per step in a log (CI stays readable)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from swarm.app.run_progress import RunProgress

pytestmark = pytest.mark.timeout(30)


def test_a_log_gets_one_plain_line_per_committed_round_not_per_poll() -> None:
    out = io.StringIO()
    with RunProgress(3, what="rounds committed", console=Console(file=out, width=200)) as progress:
        assert not progress.live
        for done, loss in ((0, "—"), (1, "3.100"), (1, "3.100"), (2, "2.900"), (3, "2.750")):
            progress.update(done, eval=loss, sent="1.2 MB")
    assert out.getvalue().splitlines() == [
        "rounds committed 0/3  eval —  sent 1.2 MB",
        "rounds committed 1/3  eval 3.100  sent 1.2 MB",
        "rounds committed 2/3  eval 2.900  sent 1.2 MB",
        "rounds committed 3/3  eval 2.750  sent 1.2 MB",
    ]


def test_a_terminal_gets_a_bar_with_done_of_total_and_the_figures() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with RunProgress(10, what="rounds committed", console=console) as progress:
        assert progress.live
        progress.note("join string: swarm://x")
        progress.update(4, eval="2.345", sent="12.0 MB")
    screen = out.getvalue()
    assert "join string: swarm://x" in screen and "4/10" in screen and "eval 2.345" in screen and "━" in screen
