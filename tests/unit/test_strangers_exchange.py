"""A run that admits strangers averages by all-gather: no member averages a slice for the others, so a malicious
slice owner has nothing to set. The run config declares it, real hivemind peers end with the simulator's bits for a
dense codec, a member that sends different bytes to different groupmates splits their averages (the round's hashes
then disagree), and in the simulator a malicious owner moves a butterfly run but not an all-gather one."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import pytest
import torch

from swarm.config import ConfigError, RoundConfig, RunConfig
from swarm.core.all_gather import gather_reference
from swarm.core.average import butterfly_bytes_sent
from swarm.core.codecs.codec import get_codec
from swarm.net.exchange.rendezvous import group_key
from swarm.train.simulator.sim import simulate
from tests.unit.test_exchange import NUMEL, Peer, concurrently, deltas, results_of, three_peers

pytestmark = [pytest.mark.timeout(180)]

RUN_ID = "run-test-strangers"


def test_a_run_that_admits_strangers_all_gathers_every_codec_and_says_so_in_its_spec():
    assert not RoundConfig().all_gathered()  # a run of trusted members keeps the butterfly
    strangers = RunConfig.from_json('{"rounds": {"admits_strangers": true, "codec": "int4"}}')
    assert strangers.rounds.all_gathered()
    assert RunConfig.from_json(strangers.to_json()).rounds.all_gathered()  # what every peer receives
    assert RoundConfig(exchange="all_gather").all_gathered()
    assert not RoundConfig(admits_strangers=True, exchange="butterfly").all_gathered()  # the operator's explicit choice
    for rounds, why in (
        ({"exchange": "ring"}, "exchange 'ring' is unknown"),
        ({"exchange": "butterfly", "codec": "topk-int4"}, "always all-gathered"),
        ({"admits_strangers": True, "hierarchical": True}, "set hierarchical = false"),
        ({"exchange": "all_gather", "codec": "lowrank4-fp16"}, "choose a dense codec"),
    ):
        with pytest.raises(ConfigError, match=why):
            RunConfig.from_dict({"rounds": rounds})


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    for group in three_peers(RUN_ID):
        for p in group:
            p.exchange.gather_all = True  # as swarm.net.exchange.group sets it from RoundConfig.all_gathered()
        yield group


def _exchange(peers, key, codec, weights, inputs):
    planned = {p.name for p in peers}
    members = [p.member(weight=w, codec=codec) for p, w in zip(peers, weights)]
    return [
        r
        for _, r in results_of(
            concurrently(
                [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
                timeout_s=90,
            )
        )
    ]


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["int8", "sign"])
def test_three_peers_all_gather_a_dense_codec_to_the_simulators_bits(peers, codec):
    weights, inputs = [3.0, 1.0, 2.0], deltas(11, 3)
    results = _exchange(peers, group_key(RUN_ID, 1 if codec == "int8" else 2), codec, weights, inputs)
    expected = gather_reference(inputs, weights, codec)
    size = get_codec(codec).encoded_size(NUMEL)
    for result in results:
        assert torch.equal(result.average, expected)
        assert 2 * size <= result.bytes_sent <= 2 * size * 1.01, result.bytes_sent  # (K - 1) x the encoded vector
    butterfly = sum(butterfly_bytes_sent(NUMEL, 3, codec)) / 3
    assert 1.4 * butterfly < results[0].bytes_sent < 1.6 * butterfly  # K / 2 x the butterfly's bytes


@pytest.mark.slow
def test_fp32_all_gathers_into_each_members_own_delta_to_the_simulators_bits(peers):
    weights, inputs = [2.0, 1.0, 4.0], deltas(13, 3)
    expected = gather_reference([d.clone() for d in inputs], weights, "fp32")
    key, planned = group_key(RUN_ID, 4), {p.name for p in peers}
    members = [p.member(weight=w, codec="fp32") for p, w in zip(peers, weights)]
    results = results_of(
        concurrently(
            [
                lambda p=p, m=m, d=d: p.exchange.average(
                    key=key, group=p.group(key, m, planned), me=m, delta=d, timeout_s=30, into_delta=True
                )
                for p, m, d in zip(peers, members, inputs)
            ],
            timeout_s=90,
        )
    )
    assert all(
        r.average.data_ptr() == d.data_ptr() and torch.equal(r.average, expected) for r, d in zip(results, inputs)
    )


@pytest.mark.slow
def test_a_member_that_sends_different_vectors_to_different_groupmates_splits_their_averages(peers, monkeypatch):
    a, b, liar = peers
    weights, inputs = [1.0, 1.0, 1.0], deltas(12, 3)
    honest_send = liar.exchange._send

    async def equivocate(member, key, digest, phase, part, sender, payload, **kwargs):
        if member.peer_id == b.name:  # b gets the liar's vector negated, a its real one
            payload = get_codec("fp32").encode(-inputs[2])
        return await honest_send(member, key, digest, phase, part, sender, payload, **kwargs)

    monkeypatch.setattr(liar.exchange, "_send", equivocate)
    results = _exchange(peers, group_key(RUN_ID, 3), "fp32", weights, inputs)
    assert torch.equal(results[0].average, gather_reference(inputs, weights, "fp32"))
    assert torch.equal(results[1].average, gather_reference([inputs[0], inputs[1], -inputs[2]], weights, "fp32"))
    # a's and b's outer steps, and so their θg hashes, differ: no hash has the group's majority unless the liar
    # joins one side, and then that side holds what its honest member computed
    assert not torch.equal(results[0].average, results[1].average)


@pytest.mark.slow
def test_a_malicious_slice_owner_moves_a_butterfly_run_and_not_an_all_gather_one():
    from tests.unit.test_trainer_sim import RUN

    def run(admits_strangers: bool, attacked: bool):
        rounds = dataclasses.replace(RUN.rounds, inner_steps=2, codec="int8", admits_strangers=admits_strangers)
        owner = (lambda o, r, s: -100 * s if o == 2 else None) if attacked else None  # peer 2 owns slice 2
        return simulate(RUN.replace(rounds=rounds), peers=3, rounds=1, owner_tamper=owner)

    honest, attacked = run(False, False), run(False, True)
    moved = max(float((x - y).abs().max()) for x, y in zip(honest.final_params, attacked.final_params))
    assert moved > 0.01 and attacked.consistent  # every member installs the owner's slice: nothing notices
    honest, attacked = run(True, False), run(True, True)
    assert honest.consistent and attacked.rounds[-1].state_hash == honest.rounds[-1].state_hash
    numel = honest.param_count
    assert honest.rounds[-1].bytes_sent == [2 * get_codec("int8").encoded_size(numel)] * 3


def test_the_benchmark_reports_the_all_gathers_bytes_and_attacks_only_the_attackers_slices():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_byzantine

    rows = {(r["codec"], r["workers"]): r for r in bench_byzantine.byte_rows(1_000_000)}
    assert [rows["fp32", 4]["ratio"], rows["fp32", 8]["ratio"]] == [2.0, 4.0]  # K / 2
    assert rows["int4", 8]["all_gather_bytes"] < rows["fp32", 8]["butterfly_bytes"]
    attacker = bench_byzantine.Attacker("slice_owner", first=3, seed=0)
    honest = torch.ones(4)
    assert attacker.owned(2, 1, honest) is None and torch.equal(attacker.owned(3, 1, honest), -100 * honest)
    jobs = bench_byzantine.plan(bench_byzantine.Grid(), slice_owner_only=True)
    assert {(j.workers, j.attackers, j.exchange) for j in jobs if j.attack == "slice_owner"} == {
        (4, 1, "butterfly"),
        (4, 1, "all_gather"),
        (8, 2, "butterfly"),
        (8, 2, "all_gather"),
    }


def test_the_controller_picks_a_codec_for_the_all_gathers_bytes_in_a_run_that_admits_strangers():
    from coordinator.rounds.controller import PeerLink, choose, predict

    links = [PeerLink(f"p{i}", 100.0, 100.0, 1.0, 1.0) for i in range(8)]
    shares = {link.peer_id: 1.0 for link in links}
    butterfly, gathered = predict(links, shares, 10**8, "fp32"), predict(links, shares, 10**8, "fp32", gathered=True)
    assert 3.9 < gathered.seconds / butterfly.seconds < 4.1  # K / 2 at K = 8
    rounds = RoundConfig(inner_steps=100, controller="auto")  # a 100 s round, 10 s of it for the exchange
    trusted = choose(links, param_count=10**7, rounds=rounds, round_no=2)
    strangers = choose(links, param_count=10**7, rounds=dataclasses.replace(rounds, admits_strangers=True), round_no=2)
    assert get_codec(strangers.codec).encoded_size(10**7) < get_codec(trusted.codec).encoded_size(10**7)


def test_the_simulator_counts_a_variable_size_codecs_all_gather_from_its_encodings():
    inputs, codec = deltas(13, 3, 20_000), get_codec("ternary@0.1")
    pairs = [[0] * 3 for _ in range(3)]
    gather_reference(inputs, [1.0] * 3, codec, pair_bytes=pairs)
    for i, row in enumerate(pairs):
        assert row[i] == 0 and len(set(row[:i] + row[i + 1 :])) == 1
        assert row[(i + 1) % 3] == len(codec.encode(inputs[i])) < codec.encoded_size(20_000)
