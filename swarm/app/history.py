"""`swarm history`: a run's rounds as the coordinator recorded them, from a live coordinator (GetHistory)
or from a finished run's state dir (its SQLite store, read-only), as a table, CSV or JSON.

    swarm history 'swarm://...' [--csv|--json]
    swarm history STATE_DIR [--csv|--json]
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Callable

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console

from swarm.app.tables import Column, fitted, is_piped, print_plain
from swarm.config import ConfigError
from swarm.v1 import coordinator_pb2 as pb

MAX_PAGES = 10_000  # a coordinator that keeps saying "more" is not followed forever
# The columns of the table and the CSV, in order (the JSON has every field).
COLUMNS = (
    "round",
    "outcome",
    "participants",
    "holders",
    "group_size",
    "codec",
    "inner_steps",
    "fragments",
    "bytes_sent",
    "ddp_equivalent_bytes",
    "exchange_s",
    "inner_s",
    "mean_loss",
    "eval_loss",
    "tokens",
    "utilization",
)


def fetch_history(get_page: Callable[[int], pb.GetHistoryResponse]) -> pb.GetHistoryResponse:
    """The whole history: ``get_page(after_round)`` answers one page; every page's rounds, in order."""
    whole = pb.GetHistoryResponse()
    after = 0
    for _ in range(MAX_PAGES):
        page = get_page(after)
        whole.rounds.extend(page.rounds)
        whole.peer_rounds.extend(page.peer_rounds)
        if not page.more or not page.rounds:
            break
        after = page.rounds[-1].round
    return whole


def history_from_state_dir(state_dir: Path) -> pb.GetHistoryResponse:
    """The history kept in a coordinator's state dir, read without writing to it."""
    from coordinator.store.database import STORE_FILE, Store
    from coordinator.store.history import history_page

    if not state_dir.is_dir():
        raise ConfigError(
            f"{state_dir} is neither a join string nor a directory; give a join string "
            "(swarm://...) or a coordinator's --state-dir."
        )
    store = Store(state_dir / STORE_FILE, read_only=True)
    try:
        return fetch_history(lambda after: history_page(store, after_round=after))
    finally:
        store.close()


def history_to_dict(response: pb.GetHistoryResponse) -> dict[str, Any]:
    """{"rounds": [{...}], "peer_rounds": [{...}]}: numbers as numbers, NaN as None, outcomes as words."""
    return {"rounds": [_plain(r) for r in response.rounds], "peer_rounds": [_plain(p) for p in response.peer_rounds]}


def _plain(message: Message) -> dict[str, Any]:
    data = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.enum_type is not None:
            data[field.name] = pb.RoundOutcome.Name(value).removeprefix("ROUND_OUTCOME_").lower()
        elif isinstance(value, float):
            data[field.name] = None if math.isnan(value) else value
        elif isinstance(value, int) and not isinstance(value, bool):
            data[field.name] = int(value)
    return data


def to_csv(history: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in history["rounds"]:
        writer.writerow(["" if row[c] is None else row[c] for c in COLUMNS])
    return out.getvalue()


def print_history(history: dict[str, Any], *, fmt: str, console: Console) -> None:
    if fmt == "json":
        console.file.write(json.dumps(history) + "\n")
        return
    if fmt == "csv":
        console.file.write(to_csv(history))
        return
    title = f"{len(history['rounds'])} decided rounds"
    rows = [
        [_cell(row.get(c) or None) if c == "committed_hash" else _cell(row[c]) for c in TABLE_FIELDS]
        for row in history["rounds"]
    ]
    if is_piped(console):
        print_plain(console, [fitted(title, TABLE_COLUMNS, rows, width=None)])
    else:
        console.print(fitted(title, TABLE_COLUMNS, rows, width=console.width))


# The table: COLUMNS and the committed hash; a terminal too narrow for all of them drops the highest ranks first
# (0: always shown).
TABLE_FIELDS = ("round", "outcome", "committed_hash", *COLUMNS[2:])
_RANKS = {
    "round": 0,
    "outcome": 0,
    "committed_hash": 0,
    "mean_loss": 1,
    "eval_loss": 2,
    "participants": 3,
    "tokens": 4,
    "exchange_s": 5,
    "bytes_sent": 6,
    "utilization": 7,
    "codec": 8,
    "inner_s": 9,
    "holders": 10,
    "inner_steps": 11,
    "ddp_equivalent_bytes": 12,
    "group_size": 13,
    "fragments": 14,
}
TABLE_COLUMNS = tuple(
    Column(
        "θg hash" if c == "committed_hash" else c.replace("_", " "),
        _RANKS[c],
        "left" if c in ("outcome", "codec", "committed_hash") else "right",
    )
    for c in TABLE_FIELDS
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def serve_dashboard(state_dir: Path, *, host: str = "127.0.0.1", port: int = 0) -> int:
    """`swarm dashboard STATE_DIR`: the run's page and /metrics from its store, read-only, until Ctrl-C."""
    import threading

    from coordinator.http.server import DashboardServer
    from coordinator.http.snapshot import snapshot
    from coordinator.store.database import STORE_FILE, Store

    if not state_dir.is_dir():
        raise ConfigError(f"{state_dir} is not a directory; give the --state-dir of a coordinator that ran.")
    store = Store(state_dir / STORE_FILE, read_only=True)
    server = DashboardServer(lambda: snapshot(store), host=host, port=port)
    try:
        print(f"dashboard: {server.start()}", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        store.close()
    return 0
