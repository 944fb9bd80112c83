"""The quality benchmark's documented rows still reproduce: a short pinned row re-run bit for bit,
the docs table generated from docs/bench_quality.json, and which rows the default run and --full run."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_quality as bq  # noqa: E402
import bench_quality_record as record_mod  # noqa: E402

# A few CPU seconds; the wall time is generous for a machine shared with other test runs.
pytestmark = pytest.mark.timeout(180)


def _bench(grid: bq.Grid) -> bq.Bench:
    return bq.Bench(workers=4, steps=800, warm_steps=1000, seed=0, threads=1, cache_dir=Path("unused"), grid=grid)


def test_the_pinned_row_reproduces_bit_for_bit(tmp_path: Path) -> None:
    record = record_mod.load()
    pinned = record["pinned"]
    settings = bq.Bench(workers=2, steps=10, warm_steps=10, seed=0, threads=1, cache_dir=tmp_path, grid=bq.Grid())
    differ = record_mod.bits_differ(record["environment"], record_mod.environment(settings.run_config().data, 1))
    if differ:
        pytest.skip("the documented bits come from another corpus, torch or CPU: " + "; ".join(differ))
    row = bq.pinned_row(tmp_path)
    assert row["warm_eval_loss"] == pinned["warm_eval_loss"], "the warm-start checkpoint no longer reproduces"
    assert (row["eval_loss"], row["bytes_per_worker"]) == (pinned["eval_loss"], pinned["bytes_per_worker"]), (
        "the pinned DiLoCo row changed: re-run scripts/bench_quality.py --record and say in docs/BENCHMARKS.md why"
    )


def test_the_docs_table_is_the_recorded_rows() -> None:
    assert record_mod.docs_table() == record_mod.render_table(record_mod.load()), (
        "docs/BENCHMARKS.md's warm-start table differs from docs/bench_quality.json: run --record"
    )


def test_check_names_a_row_whose_loss_moved_by_one_ulp() -> None:
    documented = [
        {"label": label, "method": method, "eval_loss": loss, "bytes_per_worker": sent}
        for label, method, loss, sent in (
            ("ddp fp32 (warm)", "ddp", 1.9257, 1.06e9),
            ("diloco fp32 H=50 (warm)", "diloco", 1.9568, 2.1e7),
        )
    ]
    measured = copy.deepcopy(documented)
    moved = next(r for r in measured if r["method"] == "ddp")
    moved["eval_loss"] = moved["eval_loss"] * (1 + 2**-52)
    bad, _ = record_mod.compare(documented, measured)
    assert len(bad) == 1 and bad[0].startswith(moved["label"])
    assert record_mod.compare(documented, copy.deepcopy(documented))[0] == []


def test_the_default_run_keeps_every_targets_rows_and_full_adds_the_sweeps() -> None:
    default = bq.plan(_bench(bq.Grid()), bq.METHODS, init="warm")
    full = bq.plan(_bench(bq.FULL_GRID), bq.METHODS, init="warm")
    labels = {j.label for j in default}
    assert {
        "ddp fp32 (warm)",
        "diloco fp32 H=50 (warm)",
        "diloco int4+EF H=200 (warm)",
        "streaming fp32 H=100 F=4 tau=5 (warm)",
        "torchft_diloco fp32 H=50 (warm)",
    } <= labels
    assert not any(j.codec in ("fp16", "int8") or j.codec.startswith("topk") for j in default)
    sparse = {(j.codec, j.H) for j in full if j.codec.startswith("topk")}
    assert sparse == {(f"topk-int4@{d}", h) for d in ("0.01", "0.03", "0.1") for h in (25, 50, 100)}
    assert set(default) < set(full) and len(full) == len(set(full))


def test_codec_fragments_make_the_codec_rows_streamed_without_overlap() -> None:
    grid = bq.Grid(
        h_values=(),
        codecs=("ternary@0.5",),
        codec_h=(50,),
        keep_unsent_locally=True,
        codec_fragments=4,
        fragment_pattern="balanced",
    )
    [job] = bq.plan(_bench(grid), ["diloco"], init="warm")
    assert (job.method, job.codec, job.H, job.fragments, job.overlap, job.keep_unsent) == (
        "streaming",
        "ternary@0.5",
        50,
        4,
        0,
        True,
    )
    assert job.label == "streaming ternary@0.5+EF H=50 unsent kept locally F=4 tau=0 (warm)"
