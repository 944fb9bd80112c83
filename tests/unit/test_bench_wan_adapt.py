"""bench_wan.py's adaptation rows and verdict, from a run's history and the controller's choices: how many
rounds after a link change the codec changed and the peers' busy share was back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_wan_adapt import rows_by_round, summary  # noqa: E402

pytestmark = pytest.mark.timeout(10)


def history_of(codecs: list[str], utilization: list[float]) -> dict:
    return {
        "rounds": [
            {
                "round": i + 1,
                "outcome": "committed",
                "codec": c,
                "fragments": 1,
                "inner_steps": 40,
                "utilization": u,
                "inner_s": 20.0,
                "exchange_s": 1.0,
                "opened_at": 100.0 + 25 * i,
            }
            for i, (c, u) in enumerate(zip(codecs, utilization))
        ]
    }


def polls_of(busy: list[float]) -> list:
    """`swarm status` polls at each round's opening: one peer whose live inner seconds grew by busy × the
    round's 25 s period (the utilization the summary counts on), and a second peer always busy."""
    polls, inner = [], 0.0
    for i in range(len(busy) + 1):
        polls.append((100.0 + 25 * i, {"p-a": (inner, 25.0 * i), "p-b": (25.0 * i, 25.0 * i)}))
        inner += 25 * (2 * busy[i] - 1) if i < len(busy) else 0.0  # the mean of the two peers is busy[i]
    return polls


def test_rows_carry_the_choice_the_reason_and_the_compute_share() -> None:
    log = "12:00:00 INFO coordinator.rounds.controller: round 2: int8: fp16 would take 3.1 s (shares p-a 0.25)\n"
    rows = rows_by_round(history_of(["fp32", "int8"], [0.99, 0.9]), {2: {"inner_steps": 80, "fragments": 1}}, log)
    assert [r["codec"] for r in rows] == ["fp32", "int8"]
    assert rows[1]["H"] == 80 and rows[1]["reason"] == "int8: fp16 would take 3.1 s"
    assert rows[0]["compute_share"] == 0.8 and rows[1]["compute_share"] is None  # 20 s of a 25 s period; last: unknown


@pytest.mark.parametrize(
    ("codecs", "utilization", "cut", "restore", "expected"),
    [
        # the codec changes in the 2nd round on the slow link, utilization is back in its 3rd; restored: 1st and 1st
        (
            ["fp32"] * 3 + ["fp32", "int8", "int8", "int8", "fp32", "fp32"],
            [0.99] * 3 + [0.8, 0.9, 0.96, 0.97, 0.99, 0.99],
            4,
            8,
            {
                "cut": {"changed_after_rounds": 2, "recovered_after_rounds": 3},
                "restore": {"changed_after_rounds": 1, "recovered_after_rounds": 1},
            },
        ),
        # the controller never reacts: no change is reported, not a made-up one
        (
            ["fp32"] * 6,
            [0.99, 0.99, 0.7, 0.7, 0.7, 0.7],
            3,
            None,
            {
                "cut": {"changed_after_rounds": None, "recovered_after_rounds": None},
                "restore": {"changed_after_rounds": None, "recovered_after_rounds": None},
            },
        ),
    ],
)
def test_summary_counts_rounds_from_each_link_change(codecs, utilization, cut, restore, expected) -> None:
    # the history's own utilization (inner ÷ (inner + exchange)) is not what counts: the polls' busy share is
    rows = rows_by_round(history_of(codecs, [0.5] * len(codecs)), {}, "", polls_of(utilization))
    assert [r["busy"] for r in rows[:-1]] == pytest.approx(utilization[:-1])
    assert summary(rows, cut, restore) == expected
