"""Line charts as SVG text, drawn on the server: the dashboard needs no charting library and works offline.

Every number and label is formatted or escaped here, so the page can insert the SVG as it is. Each chart
has its x label ("round") and a y label with the unit; its ticks are round numbers in that unit (14.5k,
45 MB, 97%, never 1.45e+04), and its y range fits its kind: fractions on 0-100%, counters and rates from 0,
losses from a padded minimum.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

WIDTH, HEIGHT = 460, 250
LEFT, RIGHT, BOTTOM = 62, 12, 38  # margins for the y ticks and label, and the x ticks and label
TITLE_Y, LINE_H = 16, 13  # the title's baseline; the height of a note or legend line under it
COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706")
CHAR_W = 6.0  # a conservative width of a 10 px character, to lay the legend out without overlaps
MAX_X_TICKS, MAX_Y_TICKS = 8, 6

Point = tuple[float, Optional[float]]  # (x, y); y None: no value there


# ---- numbers as people read them ---------------------------------------------------------------------


def plain(value: float, digits: int = 3) -> str:
    """``digits`` significant digits as a plain decimal, trailing zeros dropped: 14.5, 0.0006, 1200."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else "–"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def si(value: float, digits: int = 3) -> str:
    """A count with a k/M/G/T suffix: 14.5k, 2.1M."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor * 0.9995:
            return plain(value / factor, digits) + suffix
    return plain(value, digits)


def byte_size(value: float) -> str:
    """Bytes in decimal units: 45.1 MB."""
    units = ("B", "kB", "MB", "GB", "TB")
    i = 0
    while abs(value) >= 999.5 and i < len(units) - 1:
        value /= 1000
        i += 1
    return f"{plain(value)} {units[i]}"


def percent(value: float) -> str:
    """A fraction as a percentage: 0.974 -> 97.4%."""
    return plain(100 * value, 3 if abs(value) < 1 else 4) + "%"


def seconds(value: float) -> str:
    return f"{plain(value, 2)} s"


@dataclass(frozen=True)
class Axis:
    """A y axis: its label (with the unit), how its ticks read, and where its range starts."""

    label: str
    tick: Callable[[float], str]
    floor: str = "zero"  # "zero": from 0; "fraction": 0 to 1; "padded": from a padded minimum (not below 0)
    integer: bool = False  # a count: whole-number ticks


LOSS = Axis("loss (nats/token)", plain, "padded")
TOKENS = Axis("tokens/s", si)
FRACTION = Axis("utilization (%)", lambda v: plain(100 * v) + "%", "fraction")
BYTES = Axis("bytes per round", byte_size)
PEERS = Axis("peers", plain, integer=True)
SETTINGS = Axis("steps · bits · fragments", plain, integer=True)
RATE = Axis("learning rate", plain)


# ---- the chart -----------------------------------------------------------------------------------------


def line_chart(
    chart_id: str, title: str, series: dict[str, Sequence[Point]], axis: Axis = Axis("value", plain), *, note: str = ""
) -> str:
    """An SVG line chart of ``series`` (name -> points) with a point marker per value (class ``pt``), an x
    label "round" with integer ticks, ``axis``'s y label and ticks, and ``note`` (what the figure is) under
    the title and as the chart's tooltip. ``data-y-min`` / ``data-y-max`` give the y range drawn."""
    points = [(x, y) for values in series.values() for x, y in values if _finite(y)]
    legend, legend_rows = _legend(list(series))
    top = TITLE_Y + 6 + LINE_H * (legend_rows + (1 if note else 0)) + 4
    x0, x1 = _x_span([x for x, _ in points]) if points else (0.0, 1.0)
    y0, y1, y_ticks = _y_axis([y for _, y in points], axis.floor, axis.integer)  # type: ignore[misc]
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - top - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return top + plot_h - (y - y0) / (y1 - y0) * plot_h

    parts = [
        f'<svg id="{html.escape(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" preserveAspectRatio="xMidYMid meet" role="img" '
        f'data-y-min="{y0:.12g}" data-y-max="{y1:.12g}">',
        f"<title>{html.escape(title + (': ' + note if note else ''))}</title>",
        f'<text x="{LEFT}" y="{TITLE_Y}" class="title">{html.escape(title)}</text>',
    ]
    line = TITLE_Y + 6
    if note:
        line += LINE_H
        parts.append(f'<text x="{LEFT}" y="{line - 2}" class="note">{html.escape(note)}</text>')
    parts.extend(part.replace("{Y}", f"{line + LINE_H * (row + 1) - 2}") for row, part in legend)
    parts.append(f'<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    for value in y_ticks:
        y = sy(value)
        parts.append(
            f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 4}" y="{y + 3.5:.1f}" text-anchor="end" class="tick ytick">'
            f"{html.escape(axis.tick(value))}</text>"
        )
    for value in _x_ticks(x0, x1) if points else []:
        parts.append(
            f'<text x="{sx(value):.1f}" y="{top + plot_h + 13}" text-anchor="middle" class="tick xtick">{value}</text>'
        )
    parts.append(
        f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 5}" text-anchor="middle" class="axis xlabel">round</text>'
    )
    mid = top + plot_h / 2
    parts.append(
        f'<text x="{-mid:.1f}" y="12" transform="rotate(-90)" text-anchor="middle" class="axis ylabel">'
        f"{html.escape(axis.label)}</text>"
    )
    if not points:
        parts.append(
            f'<text x="{LEFT + plot_w / 2:.1f}" y="{mid:.1f}" text-anchor="middle" class="empty">no data yet</text>'
        )
        return "".join(parts) + "</svg>"
    parts.extend(_lines(series, sx, sy))
    return "".join(parts) + "</svg>"


def _lines(series: dict[str, Sequence[Point]], sx: Callable[[float], float], sy: Callable[[float], float]) -> list[str]:
    """Each series' polyline and point markers (class ``pt``), in plot coordinates."""
    parts = []
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        shown = [(sx(x), sy(y)) for x, y in values if _finite(y)]  # type: ignore[arg-type]
        if len(shown) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in shown)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        radius = 2.5 if len(shown) <= 60 else 1.2
        parts.extend(
            f'<circle class="pt" data-series="{html.escape(name)}" cx="{x:.1f}" cy="{y:.1f}" '
            f'r="{radius}" fill="{color}"/>'
            for x, y in shown
        )
    return parts


def _legend(names: list[str]) -> tuple[list[tuple[int, str]], int]:
    """(row, SVG with "{Y}" for the row's baseline) per series name, laid out left to right under the title
    and wrapped at the chart's width, so no two entries overlap; and the number of rows."""
    if len(names) < 2:
        return [], 0  # one series: the title names it
    out, row, x = [], 0, float(LEFT)
    for i, name in enumerate(names):
        width = 14 + CHAR_W * len(name) + 12
        if x + width > WIDTH - RIGHT and x > LEFT:
            row, x = row + 1, float(LEFT)
        color = COLORS[i % len(COLORS)]
        out.append(
            (
                row,
                f'<g class="legend" data-legend="{html.escape(name)}">'
                f'<rect x="{x:.1f}" y="{{Y}}" width="10" height="3" fill="{color}" '
                f'transform="translate(0,-4)"/>'
                f'<text x="{x + 14:.1f}" y="{{Y}}" fill="{color}">{html.escape(name)}</text></g>',
            )
        )
        x += width
    return out, row + 1


def _finite(y: Optional[float]) -> bool:
    return y is not None and math.isfinite(y)


def _x_span(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    return (low - 1, high + 1) if high - low < 1e-12 else (low, high)


def _x_ticks(low: float, high: float) -> list[int]:
    """Evenly spaced integer rounds, at most MAX_X_TICKS of them: every 1, 2, 5, 10, 20, 50, ... rounds."""
    step = 1
    while True:
        for multiple in (1, 2, 5):
            ticks = list(
                range(math.ceil(low / (step * multiple)) * step * multiple, math.floor(high) + 1, step * multiple)
            )
            if len(ticks) <= MAX_X_TICKS:
                return ticks
        step *= 10


def _nice_step(span: float, most: int) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k that cuts ``span`` into at most ``most`` - 1 parts."""
    raw = span / (most - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        if multiple * magnitude >= raw * (1 - 1e-9):
            return multiple * magnitude
    return 10 * magnitude


def _y_axis(values: Sequence[float], floor: str, integer: bool = False) -> tuple[float, float, list[float]]:
    """(low, high, ticks) of a y axis over ``values``: fractions on [0, 1]; counters from 0; losses from
    their minimum less a tenth of their spread (not below 0); the ends on a tick."""
    if floor == "fraction":
        return 0.0, 1.0, [0.0, 0.25, 0.5, 0.75, 1.0]
    low, high = (min(values), max(values)) if values else (0.0, 1.0)
    if floor == "zero":
        low, high = min(low, 0.0), max(high, 0.0)
    else:
        pad = 0.1 * (high - low) or 0.05 * abs(low) or 1.0
        low = max(0.0, low - pad) if low >= 0 else low - pad
    if high - low < 1e-12:
        high = low + (abs(low) or 1.0)
    step = _nice_step(high - low, MAX_Y_TICKS)
    if integer:
        step = float(max(1, math.ceil(step)))
    start, end = math.floor(low / step + 1e-9) * step, math.ceil(high / step - 1e-9) * step
    if (end - start) / step + 1 > MAX_Y_TICKS:  # rounding the ends out added a tick: one step larger
        step = _nice_step(end - start, MAX_Y_TICKS - 1)
        if integer:
            step = float(max(1, math.ceil(step)))
        start, end = math.floor(low / step + 1e-9) * step, math.ceil(high / step - 1e-9) * step
    count = int(round((end - start) / step)) + 1
    return start, end, [round(start + i * step, 12) for i in range(count)]


def codec_bits(codec: str) -> float:
    """Bits per value a codec sends (fp32 32 ... int4 4; NaN for one without a fixed width)."""
    for bits in (32, 16, 8, 4):
        if codec.endswith(str(bits)):
            return float(bits)
    return math.nan


UTILIZATION_NOTE = "inner s ÷ (inner + exchange s) of each round (the card: the whole run)"
LR_NOTE = "the schedule's rate at the round's last step, for a peer in from round 1"


def run_charts(rounds: Sequence[dict]) -> dict[str, str]:
    """The dashboard's charts over rounds, from ``coordinator.http.snapshot``'s round rows."""

    def series(key: str, *, committed_only: bool = False) -> list[Point]:
        return [(r["round"], r.get(key)) for r in rounds if not committed_only or r["outcome"] == "committed"]

    return {  # the train loss of committed rounds only: a voided round's training was thrown away
        "loss": line_chart(
            "chart-loss", "loss", {"train": series("mean_loss", committed_only=True), "eval": series("eval_loss")}, LOSS
        ),
        "tokens_per_s": line_chart("chart-tokens", "tokens/s per round", {"tokens/s": series("tokens_per_s")}, TOKENS),
        "utilization": line_chart(
            "chart-utilization",
            "compute utilization per round",
            {"utilization": series("utilization")},
            FRACTION,
            note=UTILIZATION_NOTE,
        ),
        "bytes": line_chart(
            "chart-bytes",
            "bytes per round",
            {"sent": series("bytes_sent"), "data-parallel equivalent": series("ddp_equivalent_bytes")},
            BYTES,
        ),
        "participants": line_chart(
            "chart-participants", "participants", {"participants": series("participants")}, PEERS
        ),
        "lr": line_chart("chart-lr", "inner learning rate", {"lr": series("lr")}, RATE, note=LR_NOTE),
        "choices": line_chart(
            "chart-choices",
            "round settings (the controller's, when on)",
            {
                "H": series("inner_steps"),
                "codec bits": [(r["round"], codec_bits(r["codec"])) for r in rounds],
                "fragments": series("fragments"),
            },
            SETTINGS,
        ),
    }
