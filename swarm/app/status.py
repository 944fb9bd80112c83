"""`swarm status`: the run as the coordinator sees it, as rich tables or one JSON object."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from swarm.core.sparse_codec import density_note
from swarm.v1 import coordinator_pb2 as pb


MAX_PAGES = 1000  # a coordinator that keeps answering with a next page is not followed forever
DISPLAY_CHARS = 24  # a peer's name, site or hash in the table
SHARES_SHOWN = 8  # the controller's shares listed in the table (--json has all)


def fetch_all_pages(get_page: Callable[[str], pb.GetStatusResponse]) -> pb.GetStatusResponse:
    """The whole status: ``get_page(page_token)`` answers one page; the peers of every page, in order."""
    first = get_page("")
    token = first.next_page_token
    for _ in range(MAX_PAGES):
        if not token:
            break
        page = get_page(token)
        first.peers.extend(page.peers)
        token = page.next_page_token
    first.next_page_token = ""
    return first


def status_to_dict(response: pb.GetStatusResponse) -> dict[str, Any]:
    """The JSON shape of `swarm status --json`: {"run": {...}, "peers": [{..., "metrics": {...}}], "totals": {...},
    "peers_omitted": N}; paging is the transport's business, not the answer's."""
    status = _plain(response)
    status.pop("next_page_token", None)
    if not response.run.HasField("controller"):
        status["run"]["controller"] = None  # [rounds] controller = "off"
    return status


def _plain(message: Message) -> dict[str, Any]:
    """Every field of ``message`` as JSON values: numbers as numbers (int64 too), NaN as None, enums by name."""
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            data[field.name] = dict(value)  # e.g. the controller's shares: peer id -> share
        elif field.message_type is not None:
            data[field.name] = [_plain(m) for m in value] if field.is_repeated else _plain(value)
        elif field.enum_type is not None or field.is_repeated:
            continue  # MessageToDict's names and lists stand
        elif isinstance(value, float):
            data[field.name] = None if math.isnan(value) else value
        elif isinstance(value, int) and not isinstance(value, bool):
            data[field.name] = int(value)
    return data


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _shown(text: Any, limit: int = DISPLAY_CHARS) -> str:
    """Text a peer chose, safe for a rich table: its markup escaped, cut to ``limit`` characters, one line."""
    text = "".join(c if c.isprintable() else "?" for c in str(text))
    return escape(text if len(text) <= limit else text[: limit - 1] + "…")


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    return "—" if value is None else fmt.format(value)


def _measured(value: Any, fmt: str = "{:.1f}") -> str:
    """A rate or time a peer measured; "—" before its first measurement (None: NaN; 0: a peer that predates it)."""
    return "—" if not value else fmt.format(value)


def status_tables(status: dict[str, Any]) -> list[Table]:
    run, totals = status["run"], status["totals"]
    state = "finished" if run["finished"] else (f"round {run['open_round']} open" if run["open_round"] else "waiting for peers")
    table = Table(title=f"run {_shown(run['run_id'], 64)} — {state}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    max_rounds = run["max_rounds"] or "∞"
    table.add_row("rounds committed", f"{run['rounds_committed']} / {max_rounds} ({run['rounds_voided']} voided)")
    table.add_row("committed θg hash", _shown(run["committed_hash"], 64) or "—")
    table.add_row("eval loss", f"{_num(run['eval_loss'])} at round {run['eval_round']} (initial {_num(run['initial_eval_loss'])})")
    table.add_row("train loss", _num(run["loss"]))
    table.add_row("model", f"{_shown(run['model_preset'])} ({run['param_count']:,} parameters)")
    fragments = run.get("fragments") or 1
    plan = f"H = {run['inner_steps']} inner steps, codec {_shown(run['codec'])}{density_note(str(run['codec']))}"
    if run.get("error_feedback") and run["codec"] not in ("fp32", ""):
        plan += " with error feedback"
    if fragments > 1:
        plan += f", {fragments} fragments synced in turn"
    if run.get("overlap_steps"):
        plan += f", exchanges overlap {run['overlap_steps']} steps"
    plan += f", outer {_shown(run.get('outer_optimizer') or 'nesterov')}"
    if run.get("aggregation") not in (None, "", "mean"):
        plan += f", aggregation {_shown(run['aggregation'])}"
    table.add_row("plan", plan)
    if run.get("controller"):
        table.add_row("controller", controller_line(run["controller"]))
    ddp = totals["ddp_equivalent_bytes"]
    sent = totals["bytes_sent"]
    ratio = f" ({ddp / sent:,.0f}× less)" if sent and ddp else ""
    table.add_row("bytes sent", f"{format_bytes(sent)} vs {format_bytes(ddp)} for data-parallel{ratio}")
    table.add_row("compute utilization", f"{100 * totals['compute_utilization']:.1f}% (inner-step time / wall time)")
    table.add_row("tokens", f"{totals['tokens']:,}")
    refused = [(totals.get(k) or 0, words) for k, words in (
        ("contributions_rejected", "contributions left out (norm far above the group's median)"),
        ("contributions_clipped", "contributions clipped"),
        ("foreign_messages_dropped", "slices from non-members dropped"))]
    if any(n for n, _ in refused):
        table.add_row("robust aggregation", ", ".join(f"{n:,} {words}" for n, words in refused if n))
    if status.get("peers_omitted"):
        table.add_row("peers not listed", f"{status['peers_omitted']} (left or evicted long ago)")

    peers = Table(title="peers")
    for column in ("id", "name", "site", "state", "θg hash", "round", "joined", "missed", "restarts", "tokens/s",
                   "s/step", "loss", "sent", "up/down Mbit/s", "rtt ms", "util", "seen"):
        peers.add_column(column)
    for p in status["peers"]:
        m = p["metrics"]
        peers.add_row(
            _shown(p["id"]), _shown(p["name"]), _shown(p["site"]) or "—", _shown(p["state"]),
            _shown(m["state_hash"]) or "—", str(max(m["state_round"], 0)),
            str(p["rounds_joined"]), str(p["rounds_missed"]), str(p.get("restarts") or 0), f"{m['tokens_per_s']:,.0f}",
            _measured(m.get("step_time_s"), "{:.3g}"), _num(m["loss"]), format_bytes(m["bytes_sent"]),
            f"{_measured(m.get('upload_mbit_s'))}/{_measured(m.get('download_mbit_s'))}",
            _measured(m.get("rtt_ms"), "{:.0f}"), f"{100 * p['compute_utilization']:.0f}%", f"{p['last_seen_s']:.0f}s ago",
        )
    return [table, peers]


def controller_line(choice: dict[str, Any]) -> str:
    """The controller's latest choice in one line: round, codec, shares and why."""
    shares = choice.get("shares") or {}
    total = sum(shares.values()) or 1.0
    listed = sorted(shares.items())
    shown = ", ".join(f"{_shown(p, 12)} {s / total:.2f}" for p, s in listed[:SHARES_SHOWN]) or "equal"
    if len(listed) > SHARES_SHOWN:
        shown += f", … ({len(listed) - SHARES_SHOWN} more)"
    return (f"round {choice['round']}: {_shown(choice['codec'])}, shares {shown}, recommended H "
            f"{choice['inner_steps']}; {_shown(choice['reason'], 300)}")


def render_status(status: dict[str, Any], console: Console) -> None:
    for table in status_tables(status):
        console.print(table)


def print_status(status: dict[str, Any], *, as_json: bool, console: Console) -> None:
    if as_json:
        print(json.dumps(status, sort_keys=True), flush=True)
    else:
        render_status(status, console)


def watch(fetch, *, interval_s: float, console: Console) -> None:
    """Refresh the tables in place until interrupted or the run finishes."""
    from rich.console import Group
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        while True:
            status = fetch()
            live.update(Group(*status_tables(status)), refresh=True)
            if status["run"]["finished"]:
                return
            time.sleep(interval_s)  # a display refresh period, not a wait for a condition
