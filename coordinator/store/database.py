"""The coordinator's durable state in SQLite, so a restarted coordinator carries on where it stopped.

One file, ``<state_dir>/coordinator.sqlite3`` (WAL), one connection guarded by a lock.  Each table
keys a record (see ``coordinator.store.records``) and keeps the rest of it as JSON, so adding a field
needs no migration; a peer's metrics are its serialized ``PeerMetrics`` in a column of their own, the run's
history its serialized ``RoundHistory`` and ``PeerRoundHistory`` rows.  A file of schema 3 gains the history
tables; one of another version is refused.  ``":memory:"`` gives a throwaway store for tests;
``read_only=True`` reads a finished (or running) run's file without writing to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sqlite3
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

from coordinator.store.records import (
    COMMITTED,
    GONE_STATES,
    OPEN,
    PeerRecord,
    ReportRecord,
    RoundRecord,
    RunRecord,
    TokenRecord,
    from_json,
    to_json,
)
from swarm.config import ConfigError
from swarm.v1 import coordinator_pb2 as pb

STORE_FILE = "coordinator.sqlite3"
# PRAGMA user_version of the file: bump it when a table's columns or a stored field's meaning change,
# so that a file written by another version is refused instead of misread.
SCHEMA_VERSION = 4  # 3: peers carry their key and session; join tokens in a table of their own; 4: history
MIGRATABLE = (3,)  # versions whose files gain what this one added (tables only) when opened for writing

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (id INTEGER PRIMARY KEY CHECK (id = 1), data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, peer_index INTEGER NOT NULL, data TEXT NOT NULL, metrics BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY, outcome INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS reports (
    round INTEGER NOT NULL, peer_id TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (round, peer_id));
CREATE TABLE IF NOT EXISTS tokens (id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS history (round INTEGER PRIMARY KEY, data BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS peer_history (
    round INTEGER NOT NULL, peer_id TEXT NOT NULL, data BLOB NOT NULL, PRIMARY KEY (round, peer_id));
CREATE TABLE IF NOT EXISTS evals (
    round INTEGER NOT NULL, peer_id TEXT NOT NULL, loss REAL NOT NULL, PRIMARY KEY (round, peer_id));
"""


class Store:
    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = str(path)
        self.read_only = read_only
        self._lock = threading.RLock()
        self._depth = 0
        self._revoked: Optional[tuple[int, frozenset[str]]] = None  # (data_version, ids): revoked_token_ids' cache
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a group of writes is atomic.
        if read_only:
            if not Path(self.path).is_file():
                raise ConfigError(f"{self.path} does not exist; give the --state-dir of a coordinator that ran.")
            self._db = sqlite3.connect(
                f"{Path(self.path).resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False, isolation_level=None
            )
            self._check_version(readable=(*MIGRATABLE, SCHEMA_VERSION))
            return
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._open_schema()

    def _open_schema(self) -> None:
        """Create the tables in a new file (or the ones a schema-3 file lacks); refuse a file whose layout this
        version does not read."""
        self._check_version(readable=(*MIGRATABLE, SCHEMA_VERSION))
        self._db.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")

    def _check_version(self, *, readable: tuple[int, ...]) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        tables = self._db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables and version not in readable:
            self._db.close()
            raise ConfigError(
                f"{self.path} holds a run written by another swarm version (store schema {version}, this version "
                f"reads {SCHEMA_VERSION}); finish that run with the version that started it, or use a new --state-dir."
            )

    @classmethod
    def in_dir(cls, state_dir: str | Path) -> "Store":
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        return cls(state_dir / STORE_FILE)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group writes into one atomic commit; nests (only the outermost commits)."""
        with self._lock:
            if self._depth == 0:
                self._db.execute("BEGIN IMMEDIATE")
            self._depth += 1
            try:
                yield
            except BaseException:
                self._depth -= 1
                if self._depth == 0:
                    self._db.execute("ROLLBACK")
                raise
            self._depth -= 1
            if self._depth == 0:
                self._db.execute("COMMIT")

    def _write(self, sql: str, args: tuple) -> int:
        with self.transaction():
            return self._db.execute(sql, args).rowcount

    def _one(self, sql: str, args: tuple = ()) -> Optional[str]:
        with self._lock:
            row = self._db.execute(sql, args).fetchone()
        return None if row is None else row[0]

    def _all(self, sql: str, args: tuple = ()) -> list[str]:
        with self._lock:
            return [row[0] for row in self._db.execute(sql, args).fetchall()]

    # run identity and run-wide counters
    def get_run(self) -> Optional[RunRecord]:
        text = self._one("SELECT data FROM run WHERE id = 1")
        return None if text is None else from_json(RunRecord, text)

    def put_run(self, run: RunRecord) -> None:
        self._write("INSERT OR REPLACE INTO run (id, data) VALUES (1, ?)", (to_json(run),))

    # peers, every one that ever joined; their metrics as the serialized PeerMetrics
    def peers(self) -> list[PeerRecord]:
        with self._lock:
            rows = self._db.execute("SELECT data, metrics FROM peers ORDER BY peer_index").fetchall()
        return [
            dataclasses.replace(from_json(PeerRecord, data), metrics=pb.PeerMetrics.FromString(metrics))
            for data, metrics in rows
        ]

    def put_peer(self, peer: PeerRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO peers (peer_id, peer_index, data, metrics) VALUES (?, ?, ?, ?)",
            (peer.peer_id, peer.peer_index, to_json(peer), peer.metrics.SerializeToString()),
        )

    def put_counters(self, peers: Sequence[PeerRecord]) -> None:
        """Write the round counters of ``peers`` (``rounds_joined``, ``rounds_missed``) into their stored records, as
        memory holds them: cheaper than the whole record, for a decided round's thousands of participants."""
        with self.transaction():
            self._db.executemany(
                "UPDATE peers SET data = json_set(data, '$.rounds_joined', ?, '$.rounds_missed', ?) WHERE peer_id = ?",
                [(p.rounds_joined, p.rounds_missed, p.peer_id) for p in peers],
            )

    # rounds
    def get_round(self, round_number: int) -> Optional[RoundRecord]:
        text = self._one("SELECT data FROM rounds WHERE round = ?", (round_number,))
        return None if text is None else from_json(RoundRecord, text)

    def latest_round(self) -> Optional[RoundRecord]:
        text = self._one("SELECT data FROM rounds ORDER BY round DESC LIMIT 1")
        return None if text is None else from_json(RoundRecord, text)

    def latest_committed_round(self) -> Optional[RoundRecord]:
        text = self._one("SELECT data FROM rounds WHERE outcome = ? ORDER BY round DESC LIMIT 1", (COMMITTED,))
        return None if text is None else from_json(RoundRecord, text)

    def put_round(self, round_record: RoundRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO rounds (round, outcome, data) VALUES (?, ?, ?)",
            (round_record.round, round_record.outcome, to_json(round_record)),
        )

    def count_rounds(self, outcome: int) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM rounds WHERE outcome = ?", (outcome,)).fetchone()[0]

    # reports, one per (round, peer)
    def reports(self, round_number: int) -> list[ReportRecord]:
        return [
            from_json(ReportRecord, t)
            for t in self._all("SELECT data FROM reports WHERE round = ? ORDER BY peer_id", (round_number,))
        ]

    def add_report(self, report: ReportRecord) -> bool:
        """Record a report; False when this peer already reported this round (the first one stands)."""
        inserted = self._write(
            "INSERT OR IGNORE INTO reports (round, peer_id, data) VALUES (?, ?, ?)",
            (report.round, report.peer_id, to_json(report)),
        )
        return inserted == 1

    def replace_report(self, report: ReportRecord) -> None:
        """Record ``report`` over this peer's earlier one (a restarted peer's real report over the placeholder)."""
        self._write(
            "INSERT OR REPLACE INTO reports (round, peer_id, data) VALUES (?, ?, ?)",
            (report.round, report.peer_id, to_json(report)),
        )

    # join tokens (another process, `swarm token`, may write them while the coordinator runs)
    def get_token(self, token_id: str) -> Optional[TokenRecord]:
        text = self._one("SELECT data FROM tokens WHERE id = ?", (token_id,))
        return None if text is None else from_json(TokenRecord, text)

    def tokens(self) -> list[TokenRecord]:
        return [from_json(TokenRecord, t) for t in self._all("SELECT data FROM tokens ORDER BY id")]

    def put_token(self, token: TokenRecord) -> None:
        self._write("INSERT OR REPLACE INTO tokens (id, data) VALUES (?, ?)", (token.id, to_json(token)))
        self._revoked = None  # this connection's own writes do not change PRAGMA data_version

    def live_identities(self, token_id: Optional[str] = None) -> dict[str, frozenset[str]]:
        """The live members (peer ids, not left or evicted) by the id of the token that admitted them; only
        ``token_id``'s when given."""
        query = (
            "SELECT json_extract(data, '$.token_id'), peer_id FROM peers "
            "WHERE json_extract(data, '$.state') NOT IN (?, ?)"
        )
        args: tuple = tuple(GONE_STATES)
        if token_id is not None:
            query, args = query + " AND json_extract(data, '$.token_id') = ?", args + (token_id,)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        live: dict[str, set[str]] = {}
        for token, peer_id in rows:
            live.setdefault(token, set()).add(peer_id)
        return {token: frozenset(ids) for token, ids in live.items()}

    def revoked_token_ids(self) -> frozenset[str]:
        """The ids of the revoked tokens, read again only when the file changed: every member call asks, and
        `swarm token revoke` writes from another process (which changes ``PRAGMA data_version`` here)."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if self._revoked is None or self._revoked[0] != version:
                revoked = frozenset(t.id for t in self.tokens() if t.revoked)
                self._revoked = (version, revoked)
            return self._revoked[1]

    # history: one row per decided round, one per participant and round, evaluations per peer and round
    def put_history(self, row: pb.RoundHistory, peer_rows: Sequence[pb.PeerRoundHistory]) -> None:
        with self.transaction():
            self._db.execute(
                "INSERT OR REPLACE INTO history (round, data) VALUES (?, ?)", (row.round, row.SerializeToString())
            )
            self.put_peer_history(peer_rows)

    def put_peer_history(self, peer_rows: Sequence[pb.PeerRoundHistory]) -> None:
        if peer_rows:
            with self.transaction():
                self._db.executemany(
                    "INSERT OR REPLACE INTO peer_history (round, peer_id, data) VALUES (?, ?, ?)",
                    [(p.round, p.peer_id, p.SerializeToString()) for p in peer_rows],
                )

    def rounds_without_history(self) -> list[int]:
        """The decided rounds whose history row is not kept yet (a large round's is written over several calls)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT round FROM rounds WHERE outcome != ? AND round NOT IN (SELECT round FROM history) ORDER BY round",
                (OPEN,),
            ).fetchall()
        return [r[0] for r in rows]

    def add_eval(self, round_number: int, peer_id: str, loss: float) -> None:
        self._write(
            "INSERT OR REPLACE INTO evals (round, peer_id, loss) VALUES (?, ?, ?)", (round_number, peer_id, loss)
        )

    def history(self, *, after_round: int = 0, limit: int = -1) -> list[pb.RoundHistory]:
        """Decided rounds after ``after_round``, oldest first, each with the mean of its evaluations."""
        if not self._has_table("history"):
            return []  # a schema-3 file read read-only: no history was kept
        with self._lock:
            rows = self._db.execute(
                "SELECT h.data, (SELECT AVG(loss) FROM evals e WHERE e.round = h.round) FROM history h "
                "WHERE h.round > ? ORDER BY h.round LIMIT ?",
                (after_round, limit),
            ).fetchall()
        out = []
        for data, eval_loss in rows:
            row = pb.RoundHistory.FromString(data)
            row.eval_loss = eval_loss if eval_loss is not None else math.nan
            out.append(row)
        return out

    def peer_history(self, *, first_round: int, last_round: int) -> list[pb.PeerRoundHistory]:
        if not self._has_table("peer_history"):
            return []
        with self._lock:
            rows = self._db.execute(
                "SELECT data FROM peer_history WHERE round BETWEEN ? AND ? ORDER BY round, peer_id",
                (first_round, last_round),
            ).fetchall()
        return [pb.PeerRoundHistory.FromString(data) for (data,) in rows]

    def eval_loss(self, round_number: int) -> float:
        """The mean evaluation of round ``round_number``'s state (0: the initial state); NaN when none."""
        if not self._has_table("evals"):
            return math.nan
        value = self._one("SELECT AVG(loss) FROM evals WHERE round = ?", (round_number,))
        return math.nan if value is None else float(value)

    def _has_table(self, name: str) -> bool:
        return self._one("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)) is not None
