"""Tables of `swarm status` and `swarm history` that stay readable at any terminal width, and whole when piped.

On a terminal a wide table keeps its most important columns (those with the lowest ``rank``) and drops the others,
the way `kubectl get` shows fewer columns than `-o wide`; a caption names what was left out. A terminal too narrow
even for the columns that must stay gets one block per row instead. Piped (stdout not a terminal), every column is
printed in full, without box characters or a width limit, for grep, awk and files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

PIPED_WIDTH = 100_000  # piped: rows are never wrapped (rich's default for a non-terminal would be 80 columns)


@dataclass(frozen=True)
class Column:
    header: str
    rank: int = 0  # a terminal too narrow for every column drops the highest ranks first; 0: never dropped
    justify: str = "left"


def is_piped(console: Console) -> bool:
    return not console.is_terminal


def print_plain(console: Console, renderables: Sequence[RenderableType]) -> None:
    """``renderables`` on ``console``'s file as piped output: no width limit, no colours, no trailing blanks."""
    import io

    buffer = io.StringIO()
    plain = Console(
        file=buffer, width=PIPED_WIDTH, color_system=None, highlight=False, emoji=False, no_color=True, soft_wrap=False
    )
    for renderable in renderables:
        plain.print(renderable)
    console.file.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))


def fitted(
    title: Optional[str],
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: Optional[int],
    what: str = "columns",
) -> RenderableType:
    """A table of ``rows`` for a console ``width`` columns wide (None: piped, every column in full)."""
    if width is None:
        return _table(title, columns, rows, plain=True)
    console = Console(width=PIPED_WIDTH, file=_Null())
    options = console.options
    keep = list(range(len(columns)))
    by_rank = sorted((i for i, c in enumerate(columns) if c.rank > 0), key=lambda i: (-columns[i].rank, -i))
    table = _table(title, columns, rows, plain=False)
    for drop in by_rank:
        if _needed(console, options, table) <= width:
            break
        keep.remove(drop)
        table = _table(title, [columns[i] for i in keep], [[r[i] for i in keep] for r in rows], plain=False)
    if _needed(console, options, table) > width:
        return _blocks(title, columns, rows)
    hidden = [c.header for i, c in enumerate(columns) if i not in keep]
    if hidden:
        table.caption = (
            f"{len(hidden)} {what} hidden at {width} columns ({', '.join(hidden)}): widen the terminal, "
            "or pipe the output (| cat) for every column"
        )
    return table


def _needed(console: Console, options: ConsoleOptions, table: Table) -> int:
    return Measurement.get(console, options, table).maximum


def _table(title: Optional[str], columns: Sequence[Column], rows: Sequence[Sequence[str]], *, plain: bool) -> Table:
    table = Table(
        title=title,
        box=None if plain else box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1),
        title_justify="left" if plain else "center",
    )
    for c in columns:
        table.add_column(c.header, justify=c.justify, no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _blocks(title: Optional[str], columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> RenderableType:
    """One block per row: its first cell on a line of its own, then every other cell as "header: value"."""
    from rich.console import Group

    parts: list[RenderableType] = [Text(title, style="bold")] if title else []
    for row in rows:
        parts.append(Text.from_markup(row[0], style="bold"))
        for c, cell in zip(columns[1:], row[1:]):
            parts.append(Text.assemble("  ", (c.header, "dim"), ": ", Text.from_markup(cell)))
    return Group(*parts)


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
