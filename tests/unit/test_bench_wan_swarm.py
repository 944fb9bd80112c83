"""scripts/bench_wan_swarm.py without the testbed: its arguments, the run config it writes and the report it
assembles from a run's history, the peers' logs and their final models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_wan_swarm import check_config, parse_args, run_config, site_of_hosts, summarize  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_sites_are_consecutive_hosts_after_the_coordinator() -> None:
    assert site_of_hosts(2, 3) == {"h1": "a", "h2": "a", "h3": "a", "h4": "b", "h5": "b", "h6": "b"}
    assert len(set(site_of_hosts(4, 6).values())) == 4 and "h0" not in site_of_hosts(4, 6)


def test_the_run_config_is_two_levels_in_groups_of_g_and_waits_for_every_peer() -> None:
    args = parse_args(["--sites", "4", "--peers-per-site", "6", "--group-size", "4", "--rounds", "6"])
    text = run_config(args)
    assert check_config(text) is None
    assert "hierarchical = true" in text and "group_size = 4" in text
    assert "min_peers = 24" in text and "max_rounds = 6" in text and 'preset = "tiny"' in text
    assert args.need_gb == pytest.approx(0.45 * 24 + 1)


def test_set_wins_over_the_defaults_and_a_refused_config_is_one_sentence() -> None:
    text = run_config(parse_args(["--set", "rounds.exchange_timeout_s=300"]))
    assert "exchange_timeout_s = 300" in text and "exchange_timeout_s = 120" not in text
    refused = check_config(run_config(parse_args(["--set", "rounds.group_size=-1"])))
    assert refused is not None and "group_size" in refused and "\n" not in refused


def test_flat_has_no_group_size() -> None:
    text = run_config(parse_args(["--flat"]))
    assert "hierarchical = false" in text and "group_size" not in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--sites", "1"],
        ["--peers-per-site", "0"],
        ["--group-size", "0"],
        ["--cross-site-mbit", "-5"],
        ["--sites", "20", "--peers-per-site", "10"],
    ],
)
def test_bad_arguments_exit_2_with_a_sentence(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert "must be" in capsys.readouterr().err


def averaged(host: str, round_no: int, in_site: int, cross_site: int) -> str:
    return (
        f"12:00:00 INFO swarm.net.exchange.group: [{host} r{round_no}] averaged fragment 0 with 4 peers in 1.20s "
        f"(fp32, {in_site + cross_site} bytes sent: {in_site} in-site, {cross_site} cross-site)\n"
    )


def history_of(outcomes: str, participants: list[int]) -> dict:
    return {
        "rounds": [
            {
                "round": i + 1,
                "outcome": "committed" if o == "c" else "voided",
                "participants": p,
                "group_size": 4,
                "opened_at": 10.0 * i,
                "decided_at": 10.0 * i + 8,
                "exchange_s": 2.0,
            }
            for i, (o, p) in enumerate(zip(outcomes, participants))
        ]
    }


def test_the_report_counts_rounds_bytes_and_one_final_model() -> None:
    logs = {
        "p1": averaged("p1", 1, 100, 50) + averaged("p1", 3, 100, 50),
        "p2": averaged("p2", 1, 100, 0) + averaged("p2", 3, 100, 0),
    }
    report = summarize(
        record=history_of("cvc", [4, 0, 4]),
        logs=logs,
        digests={"p1": "abc", "p2": "abc"},
        wire={"in_site": 9000, "cross_site": 700},
        peaks={"peers_rss": 3 * 2**30, "peers_pss": 2**30},
        load=[4.0, 8.0],
        wall_s=61.04,
        finished=True,
    )
    assert (report["rounds_committed"], report["rounds_voided"], report["outcomes"]) == (2, 1, "cvc")
    assert report["contributors"] == [4, 4] and report["mean_contributors"] == 4
    assert (report["in_site_bytes_per_round"], report["cross_site_bytes_per_round"]) == (200, 50)
    assert (report["in_site_wire_bytes"], report["cross_site_wire_bytes"]) == (9000, 700)
    assert report["identical"] and report["final_models"] == {"abc": 2}
    assert (report["peak_peers_rss_gb"], report["peak_peers_pss_gb"]) == (3.0, 1.0)
    assert report["load_1m"] == [4.0, 6.0, 8.0] and report["wall_s"] == 61.0 and report["round_s"] == 8.0


def test_different_or_missing_final_models_are_not_identical() -> None:
    base = dict(record=history_of("c", [2]), logs={}, wire={}, peaks={}, load=[], wall_s=1.0, finished=True)
    differ = summarize(digests={"p1": "abc", "p2": "def"}, **base)
    assert not differ["identical"] and differ["distinct_final_models"] == 2
    missing = summarize(digests={"p1": "abc", "p2": None}, **base)
    assert not missing["identical"] and missing["missing_final_models"] == ["p2"]
