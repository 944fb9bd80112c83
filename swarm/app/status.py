"""`swarm status`: the run as the coordinator sees it, as rich tables or one JSON object."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Optional

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich import box
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table

from swarm.app.tables import Column, fitted, is_piped, print_plain
from swarm.core.codecs.sparse_codec import density_note
from swarm.v1 import coordinator_pb2 as pb

MAX_PAGES = 1000  # a coordinator that keeps answering with a next page is not followed forever
DISPLAY_CHARS = 24  # a peer's name or site in the table (names are strangers' text: a long one is cut)
ID_CHARS = 128  # ids, states and hashes are never cut (the coordinator bounds hashes at 128 characters)
SHARES_SHOWN = 8  # the controller's shares listed in the table (--json has all)


def fetch_all_pages(
    get_page: Callable[[str], pb.GetStatusResponse], *, max_peers: Optional[int] = None
) -> pb.GetStatusResponse:
    """The status: ``get_page(page_token)`` answers one page; the peers of every page, in order, or of the pages
    that hold the first ``max_peers`` (then ``next_page_token`` is left set when more peers follow)."""
    first = get_page("")
    token = first.next_page_token
    for _ in range(MAX_PAGES):
        if not token or (max_peers is not None and len(first.peers) >= max_peers):
            break
        page = get_page(token)
        first.peers.extend(page.peers)
        token = page.next_page_token
    if max_peers is not None and len(first.peers) > max_peers:
        del first.peers[max_peers:]
        token = token or "more"
    first.next_page_token = token if max_peers is not None else ""
    return first


def status_to_dict(response: pb.GetStatusResponse) -> dict[str, Any]:
    """The JSON shape of `swarm status --json`: {"run": {...}, "peers": [{..., "metrics": {...}}], "totals": {...},
    "peers_omitted": N} (and "peers_more": true when only the first of the peers were fetched); paging is the
    transport's business, not the answer's."""
    status = _plain(response)
    if status.pop("next_page_token", None):  # fetched up to a number of peers, and more follow
        status["peers_more"] = True
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


def status_tables(status: dict[str, Any], *, width: Optional[int] = None) -> list[RenderableType]:
    """The run's table and the peers' table (or blocks) for a terminal ``width`` columns wide; None: piped, every
    column in full."""
    run, totals = status["run"], status["totals"]
    state = (
        "finished"
        if run["finished"]
        else (f"round {run['open_round']} open" if run["open_round"] else "waiting for peers")
    )
    table = Table(
        title=f"run {_shown(run['run_id'], 64)} — {state}",
        show_header=False,
        box=box.SQUARE if width is not None else None,
        pad_edge=width is not None,
        title_justify="center" if width is not None else "left",
    )
    table.add_column("what", style="bold")
    table.add_column("value")
    max_rounds = run["max_rounds"] or "∞"
    table.add_row("rounds committed", f"{run['rounds_committed']} / {max_rounds} ({run['rounds_voided']} voided)")
    table.add_row("committed θg hash", _shown(run["committed_hash"], 64) or "—")
    table.add_row(
        "eval loss", f"{_num(run['eval_loss'])} at round {run['eval_round']} (initial {_num(run['initial_eval_loss'])})"
    )
    table.add_row("train loss", _num(run["loss"]))
    table.add_row("model", model_line(run))
    table.add_row("plan", plan_line(run))
    if run.get("controller"):
        table.add_row("controller", controller_line(run["controller"]))
    ddp = totals["ddp_equivalent_bytes"]
    sent = totals["bytes_sent"]
    ratio = f" ({ddp / sent:,.0f}× less)" if sent and ddp else ""
    table.add_row("bytes sent", f"{format_bytes(sent)} vs {format_bytes(ddp)} for data-parallel{ratio}")
    table.add_row("compute utilization", f"{100 * totals['compute_utilization']:.1f}% (inner-step time / wall time)")
    table.add_row("tokens", f"{totals['tokens']:,}")
    refused = [
        (totals.get(k) or 0, words)
        for k, words in (
            ("contributions_rejected", "contributions left out (norm far above the group's median)"),
            ("contributions_clipped", "contributions clipped"),
            ("foreign_messages_dropped", "slices from non-members dropped"),
        )
    ]
    if any(n for n, _ in refused):
        table.add_row("robust aggregation", ", ".join(f"{n:,} {words}" for n, words in refused if n))
    if status.get("peers_omitted"):
        table.add_row("peers not listed", f"{status['peers_omitted']} (left or evicted long ago)")
    if status.get("peers_more"):
        table.add_row("peers listed", f"the first {len(status['peers']):,} by index (--max-peers lists more)")

    rows = [_peer_row(p) for p in status["peers"]]
    return [table, fitted("peers", PEER_COLUMNS, rows, width=width)]


def plan_line(run: dict[str, Any]) -> str:
    """The run's plan in words: H, the codec, fragments, overlap, the outer optimizer and the aggregation."""
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
    return plan


# The peers table's columns; a terminal too narrow for all of them drops the highest ranks first (0: always shown).
PEER_COLUMNS = tuple(
    Column(h, rank)
    for h, rank in (
        ("id", 0),
        ("name", 1),
        ("site", 6),
        ("state", 0),
        ("θg hash", 0),
        ("round", 0),
        ("joined", 7),
        ("missed", 5),
        ("restarts", 13),
        ("tokens/s", 3),
        ("s/step", 10),
        ("loss", 2),
        ("sent", 11),
        ("up/down Mbit/s", 8),
        ("rtt ms", 9),
        ("util", 12),
        ("seen", 4),
    )
)


def _peer_row(p: dict[str, Any]) -> list[str]:
    m = p["metrics"]
    return [
        _shown(p["id"], ID_CHARS),
        _shown(p["name"]),
        _shown(p["site"]) or "—",
        _shown(p["state"], ID_CHARS),
        _shown(m["state_hash"], ID_CHARS) or "—",
        str(max(m["state_round"], 0)),
        str(p["rounds_joined"]),
        str(p["rounds_missed"]),
        str(p.get("restarts") or 0),
        f"{m['tokens_per_s']:,.0f}",
        _measured(m.get("step_time_s"), "{:.3g}"),
        _num(m["loss"]),
        format_bytes(m["bytes_sent"]),
        f"{_measured(m.get('upload_mbit_s'))}/{_measured(m.get('download_mbit_s'))}",
        _measured(m.get("rtt_ms"), "{:.0f}"),
        f"{100 * p['compute_utilization']:.0f}%",
        f"{p['last_seen_s']:.0f}s ago",
    ]


def model_line(run: dict[str, Any]) -> str:
    """The model the run trains, where it comes from and its size: "gpt2 (hf_config, 124,439,808 parameters)"."""
    name = run.get("model") or run["model_preset"]  # a coordinator before the model field has only the preset
    source = f"{_shown(run['model_source'])}, " if run.get("model_source") else ""
    return f"{_shown(name, 128)} ({source}{run['param_count']:,} parameters)"


def controller_line(choice: dict[str, Any]) -> str:
    """The controller's latest choice in one line: round, codec, shares and why."""
    shares = choice.get("shares") or {}
    total = sum(shares.values()) or 1.0
    listed = sorted(shares.items())
    shown = ", ".join(f"{_shown(p, 12)} {s / total:.2f}" for p, s in listed[:SHARES_SHOWN]) or "equal"
    if len(listed) > SHARES_SHOWN:
        shown += f", … ({len(listed) - SHARES_SHOWN} more)"
    return (
        f"round {choice['round']}: {_shown(choice['codec'])}, shares {shown}, recommended H "
        f"{choice['inner_steps']}; {_shown(choice['reason'], 300)}"
    )


def render_status(status: dict[str, Any], console: Console) -> None:
    """The tables on ``console``: fitted to its width on a terminal, every column in full when piped."""
    if is_piped(console):
        print_plain(console, status_tables(status))
        return
    for table in status_tables(status, width=console.width):
        console.print(table)


def print_status(status: dict[str, Any], *, as_json: bool, console: Console) -> None:
    if as_json:
        console.file.write(json.dumps(status, sort_keys=True) + "\n")
        console.file.flush()
    else:
        render_status(status, console)


def watch(fetch, *, interval_s: float, console: Console, count: Optional[int] = None, as_json: bool = False) -> None:
    """Show the run every ``interval_s`` until interrupted, the run finishes or ``count`` snapshots were shown: on a
    terminal the tables refresh in place; piped (or ``as_json``), each snapshot is printed after the last, a plain
    one under a line with its time (JSON: one object per line), like `vmstat 1`."""
    if as_json or is_piped(console):
        _print_snapshots(fetch, interval_s=interval_s, console=console, count=count, as_json=as_json)
        return
    from rich.console import Group
    from rich.live import Live

    shown = 0
    with Live(console=console, auto_refresh=False) as live:
        while True:
            status = fetch()
            live.update(Group(*status_tables(status, width=console.width)), refresh=True)
            shown += 1
            if status["run"]["finished"] or (count is not None and shown >= count):
                return
            time.sleep(interval_s)  # a display refresh period, not a wait for a condition


def _print_snapshots(fetch, *, interval_s: float, console: Console, count: Optional[int], as_json: bool) -> None:
    shown = 0
    while True:
        status = fetch()
        if as_json:
            print_status(status, as_json=True, console=console)
        else:
            console.file.write(("\n" if shown else "") + f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            render_status(status, console)
            console.file.flush()
        shown += 1
        if status["run"]["finished"] or (count is not None and shown >= count):
            return
        time.sleep(interval_s)  # a display refresh period, not a wait for a condition
