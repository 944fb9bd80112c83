"""Line charts as SVG text, drawn on the server: the dashboard needs no charting library and works offline.

Every number and label is formatted or escaped here, so the page can insert the SVG as it is.
"""

from __future__ import annotations

import html
import math
from typing import Optional, Sequence

WIDTH, HEIGHT = 460, 200
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 24, 26  # margins for the axis labels and the title
COLORS = ("#2563eb", "#dc2626", "#059669", "#d97706")

Point = tuple[float, Optional[float]]  # (x, y); y None: no value there


def line_chart(chart_id: str, title: str, series: dict[str, Sequence[Point]]) -> str:
    """An SVG line chart of ``series`` (name -> points) with a point marker per value (class ``pt``)."""
    points = [(x, y) for values in series.values() for x, y in values if _finite(y)]
    parts = [f'<svg id="{html.escape(chart_id)}" class="chart" xmlns="http://www.w3.org/2000/svg" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img">',
             f'<text x="{LEFT}" y="15" class="title">{html.escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" class="empty">no data yet</text>')
        return "".join(parts) + "</svg>"
    x0, x1 = _span([x for x, _ in points])
    y0, y1 = _span([y for _, y in points])  # type: ignore[misc]

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def sy(y: float) -> float:
        return HEIGHT - BOTTOM - (y - y0) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
                 'class="frame"/>')
    for value in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text x="{LEFT - 4}" y="{sy(value) + 4:.1f}" text-anchor="end" class="tick">{_fmt(value)}</text>')
    for value in (x0, x1):
        parts.append(f'<text x="{sx(value):.1f}" y="{HEIGHT - 8}" text-anchor="middle" class="tick">{_fmt(value)}</text>')
    for i, (name, values) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        shown = [(sx(x), sy(y)) for x, y in values if _finite(y)]  # type: ignore[arg-type]
        if len(shown) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in shown)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        parts.extend(f'<circle class="pt" data-series="{html.escape(name)}" cx="{x:.1f}" cy="{y:.1f}" r="2.5" '
                     f'fill="{color}"/>' for x, y in shown)
        parts.append(f'<text x="{WIDTH - RIGHT - 4}" y="{TOP + 14 + 13 * i}" text-anchor="end" fill="{color}" '
                     f'class="legend">{html.escape(name)}</text>')
    return "".join(parts) + "</svg>"


def _finite(y: Optional[float]) -> bool:
    return y is not None and math.isfinite(y)


def _span(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high - low < 1e-12:
        pad = abs(low) * 0.05 or 1.0
        return low - pad, high + pad
    return low, high


def _fmt(value: float) -> str:
    if abs(value) >= 1e6 or (0 < abs(value) < 1e-2):
        return f"{value:.2e}"
    return f"{value:.3g}"


def codec_bits(codec: str) -> float:
    """Bits per value a codec sends (fp32 32 ... int4 4; NaN for one without a fixed width)."""
    for bits in (32, 16, 8, 4):
        if codec.endswith(str(bits)):
            return float(bits)
    return math.nan


def run_charts(rounds: Sequence[dict]) -> dict[str, str]:
    """The dashboard's charts over rounds, from ``coordinator.http_snapshot``'s round rows."""
    def series(key: str, *, committed_only: bool = False) -> list[Point]:
        return [(r["round"], r[key]) for r in rounds if not committed_only or r["outcome"] == "committed"]

    return {  # the train loss of committed rounds only: a voided round's training was thrown away
        "loss": line_chart("chart-loss", "loss", {"train": series("mean_loss", committed_only=True),
                                                  "eval": series("eval_loss")}),
        "tokens_per_s": line_chart("chart-tokens", "tokens/s", {"tokens/s": series("tokens_per_s")}),
        "utilization": line_chart("chart-utilization", "compute utilization", {"utilization": series("utilization")}),
        "bytes": line_chart("chart-bytes", "bytes per round", {"sent": series("bytes_sent"),
                                                                 "data-parallel equivalent": series("ddp_equivalent_bytes")}),
        "participants": line_chart("chart-participants", "participants", {"participants": series("participants")}),
        "choices": line_chart("chart-choices", "round settings (the controller's, when on)",
                              {"H": series("inner_steps"), "codec bits": [(r["round"], codec_bits(r["codec"]))
                                                                         for r in rounds],
                               "fragments": series("fragments")}),
    }
