"""The quality benchmark's documented rows: what they depend on, the file that pins them
(docs/bench_quality.json), the check that they still reproduce, and the docs table made from them.

scripts/bench_quality.py --record writes the file and regenerates the table in docs/BENCHMARKS.md;
--check re-runs the recorded rows and compares their eval loss bit for bit.
tests/unit/test_bench_quality.py re-runs the file's short pinned row in seconds.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
RECORD_PATH = ROOT / "docs" / "bench_quality.json"
DOCS_PATH = ROOT / "docs" / "BENCHMARKS.md"
# The code a row's numbers come from (the app, control and net layers are not on its path).
CODE_DIRS = ("config", "core", "train")
TABLE_BEGIN = "<!-- bench_quality.json: warm-start table (scripts/bench_quality.py --record) -->"
TABLE_END = "<!-- end of generated table -->"


def code_digest(*, with_scripts: bool = True) -> str:
    """A hash of every Python file the benchmark's numbers come from: the swarm layers it runs (as
    imported, wherever that is), and (``with_scripts``) the benchmark script and this module."""
    import swarm

    package = Path(swarm.__file__).resolve().parent
    files = [(p.relative_to(package).as_posix(), p) for d in CODE_DIRS for p in sorted((package / d).rglob("*.py"))]
    if with_scripts:
        files += [(p.name, p) for p in sorted(Path(__file__).resolve().parent.glob("bench_quality*.py"))]
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def corpus_digest(data_cfg: Any) -> str:
    """A hash of the corpus bytes: ``stdlib`` is this Python build's standard library, and another
    build (another patch release, a distribution's package) reads other files."""
    from swarm.train.data.data import ByteCorpus

    corpus = ByteCorpus.load(data_cfg)
    digest = hashlib.sha256(corpus.train.numpy().tobytes())
    digest.update(corpus.eval.numpy().tobytes())
    return digest.hexdigest()[:16]


def environment(data_cfg: Any, threads: int, *, with_scripts: bool = True) -> dict[str, Any]:
    """What a row's bits depend on besides its settings: code, corpus, CPU kernels and threads."""
    return {
        "code": code_digest(with_scripts=with_scripts),
        "corpus": corpus_digest(data_cfg),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
    }


def bits_differ(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """The environment keys (other than the code) that differ: rows cannot be compared bit for bit."""
    return [
        f"{k} {recorded.get(k)!r} here {here.get(k)!r}"
        for k in ("corpus", "torch", "cpu_capability", "threads")
        if recorded.get(k) != here.get(k)
    ]


def load(path: Path = RECORD_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def write(path: Path, record: dict[str, Any]) -> None:
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def compare(documented: list[dict], measured: list[dict]) -> tuple[list[str], list[str]]:
    """(mismatches, rows not compared) between documented and re-measured rows, matched by label.
    Eval losses must be equal to the bit; bytes must be equal."""
    by_label = {r["label"]: r for r in measured}
    bad: list[str] = []
    unchecked: list[str] = []
    for doc in documented:
        row = by_label.get(doc["label"])
        if row is None or doc["eval_loss"] is None or row["eval_loss"] is None:
            unchecked.append(doc["label"] + ("" if row is None else f" ({row.get('note') or doc.get('note')})"))
            continue
        if row["eval_loss"] != doc["eval_loss"] or row["bytes_per_worker"] != doc["bytes_per_worker"]:
            bad.append(
                f"{doc['label']}: eval loss {row['eval_loss']!r} (documented {doc['eval_loss']!r}), "
                f"bytes/worker {row['bytes_per_worker']:.0f} (documented {doc['bytes_per_worker']:.0f})"
            )
    return bad, unchecked


class RowCache:
    """Finished rows on disk under ``directory``/rows, keyed by everything their bits depend on
    (``base``: settings and environment, with the code; the row; what it starts from), so a run
    killed half-way, --full after the default run, or --record after a run reuse them."""

    def __init__(self, directory: Path, base: dict[str, Any]) -> None:
        self.dir = directory / "rows"
        self.base = base

    def _path(self, job: dict[str, Any], start: Optional[str]) -> Path:
        key = json.dumps({"base": self.base, "job": job, "start": start, "version": 1}, sort_keys=True)
        return self.dir / f"row-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def get(self, job: dict[str, Any], start: Optional[str]) -> Optional[dict[str, Any]]:
        path = self._path(job, start)
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, job: dict[str, Any], start: Optional[str], row: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(job, start)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, sort_keys=True) + "\n")
        tmp.replace(path)


# ---- the docs table ---------------------------------------------------------------------------


def _bytes(n: Optional[float]) -> str:
    from swarm.app.status import format_bytes

    return "—" if n is None else format_bytes(n)


def render_table(record: dict[str, Any]) -> str:
    """The warm-start table in Markdown, from the recorded rows."""
    rows = record["rows"]
    ddp = next((r for r in rows if r["method"] == "ddp" and r["eval_loss"] is not None), None)
    lines = [
        "| method | codec | H | F | τ | eval loss | vs DDP | bytes/worker | reduction vs DDP "
        "| peak bytes/sync | CPU s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = r["eval_loss"]
        codec = r["codec"] + ("+EF" if r["error_feedback"] else "")
        gap = "—" if loss is None or ddp is None else f"{(loss - ddp['eval_loss']) / ddp['eval_loss']:+.2%}"
        reduction = "—" if r["reduction_vs_ddp"] is None else f"{r['reduction_vs_ddp']:,.0f}×"
        cpu = "—" if r.get("cpu_s") is None else f"{r['cpu_s']:.0f}"
        lines.append(
            " | ".join(
                [
                    f"| {r['method']}",
                    codec,
                    str(r["H"] or "—"),
                    str(r["fragments"]),
                    str(r["overlap"]),
                    "—" if loss is None else f"{loss:.4f}",
                    gap,
                    _bytes(r["bytes_per_worker"]),
                    reduction,
                    _bytes(r["peak_bytes_per_sync"]),
                    cpu,
                    (r.get("note") or "") + " |",
                ]
            )
        )
    return "\n".join(lines)


def update_docs(record: dict[str, Any], doc_path: Path = DOCS_PATH) -> bool:
    """Replace the generated table in ``doc_path``; False when its markers are missing."""
    text = doc_path.read_text()
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        return False
    doc_path.write_text(text[: start + len(TABLE_BEGIN)] + "\n\n" + render_table(record) + "\n\n" + text[end:])
    return True


def docs_table(doc_path: Path = DOCS_PATH) -> Optional[str]:
    """The generated table as docs/BENCHMARKS.md holds it now (None: no markers)."""
    text = doc_path.read_text()
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        return None
    return text[start + len(TABLE_BEGIN) : end].strip()
