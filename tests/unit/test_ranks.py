"""A multi-GPU peer's ranks on the CPU (gloo, 2 ranks): this test process is rank 0, as ``swarm peer
--nproc 2`` is, and one spawned worker trains in lockstep with it."""

import dataclasses

import pytest
import torch

from peer.ranks import start_ranks
from peer.state.resume import resume_trainer, save_trainer
from swarm.config import RunConfig
from swarm.train.data.data import BatchSampler
from swarm.train.multi_gpu.ranks import RankSampler
from swarm.train.trainer import LocalTrainer
from tests.unit.test_inner_loop import RUN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]


class _GlobalBatch:
    """The 2-rank peer's global batch drawn in one process: the peer's batches 2k (rank 0's) and 2k + 1."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler = sampler

    def next_batch(self):
        (x0, y0), (x1, y1) = self.sampler.next_batch(), self.sampler.next_batch()
        return torch.cat([x0, x1]), torch.cat([y0, y1])

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)


def _single_process_twin(peer_index: int, run: RunConfig) -> LocalTrainer:
    """One process with the 2-rank peer's global batch."""
    run = run.replace(data=dataclasses.replace(RUN.data, batch_size=2 * RUN.data.batch_size))
    twin = LocalTrainer(run, peer_index=peer_index)
    d = RUN.data
    twin.sampler = _GlobalBatch(
        BatchSampler(
            twin.corpus.train,
            shard_index=twin.shard_index,
            num_shards=d.num_shards,
            batch_size=d.batch_size,
            seq_len=d.seq_len,
            seed=RUN.seed,
        )
    )
    return twin


def _assert_same_params(a: LocalTrainer, b: LocalTrainer) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)


def _assert_shards_are_rank0s_rows(peer: LocalTrainer) -> None:
    """FSDP: rank 0's shard of each parameter is the first rows of its θl (the worker's are the rest, which
    only the comparison with the twin can see)."""
    for shard, p in zip(peer.sharded.local_shards(), peer.model.parameters()):
        assert shard.shape[0] == -(-p.shape[0] // 2) and torch.equal(shard, p[: shard.shape[0]])


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_a_two_rank_peer_trains_like_one_process_with_the_global_batch_and_resumes_with_another_nproc(
    tmp_path, sharding
):
    run = RUN.replace(inner=dataclasses.replace(RUN.inner, sharding=sharding))
    ranks = start_ranks(2, device="cpu", threads=1)
    try:
        peer = LocalTrainer(run, peer_index=1, ranks=ranks.ranks)
        assert (peer.sharded is not None) == (sharding == "fsdp")
        twin = _single_process_twin(peer_index=1, run=run)
        stats = peer.train(3)
        assert stats.samples == twin.train(3).samples == 3 * 2 * RUN.data.batch_size  # both ranks count
        _assert_same_params(peer, twin)
        if peer.sharded is not None:
            _assert_shards_are_rank0s_rows(peer)
        # a commit moves θl on rank 0 only; the worker gets it before the next steps
        for t in (peer, twin):
            t.commit(t.apply(t.pseudo_gradient(), None, 1), fragment=0)
        peer.train(2), twin.train(2)
        _assert_same_params(peer, twin)
        # a restart with one process resumes a checkpoint of the 2-rank peer at the peer's position (and back):
        # θl, AdamW state, step count and the data the peer had not drawn yet
        save_trainer(tmp_path / "two", peer, run_id="run")
        single = LocalTrainer(run, peer_index=1)
        assert resume_trainer(tmp_path / "two", single, run_id="run", round_no=1, state_hash=peer.state.state_hash)
        assert single.sampler.batches_drawn == 2 * 5  # both ranks' batches
        _assert_same_params(single, peer)
        # the whole AdamW state, in order
        for saved, kept in zip(
            single.optimizer.state_dict()["state"].values(), twin.optimizer.state_dict()["state"].values()
        ):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(saved[key], kept[key], rtol=1e-4, atol=1e-6)
        # a restart with two ranks resumes a one-process checkpoint that the worker never saw
        twin.train(2)  # the peer's batches 10 to 13
        save_trainer(tmp_path / "one", twin, run_id="run")
        assert resume_trainer(tmp_path / "one", peer, run_id="run", round_no=1, state_hash=twin.state.state_hash)
        assert peer.sampler.batches_drawn == 7  # each rank's, where the ranks themselves drew 5
        peer.train(2), twin.train(2)
        _assert_same_params(peer, twin)
        if peer.sharded is not None:
            _assert_shards_are_rank0s_rows(peer)
        assert not all(torch.equal(p, g) for p, g in zip(peer.model.parameters(), peer.global_params))
    finally:
        ranks.close()
    assert all(w.exitcode is not None for w in ranks.workers)


def test_ranks_draw_the_peers_batches_in_turn_and_resume_its_position_with_any_number_of_ranks():
    split = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def peer_sampler() -> BatchSampler:
        return BatchSampler(split, shard_index=1, num_shards=2, batch_size=2, seq_len=16, seed=0)

    one = peer_sampler()
    stream = [one.next_batch()[0] for _ in range(12)]  # what a one-process peer draws
    two = [RankSampler(peer_sampler(), rank=r, world_size=2) for r in range(2)]
    drawn = [[s.next_batch()[0] for _ in range(3)] for s in two]
    assert all(torch.equal(drawn[r][k], stream[2 * k + r]) for r in range(2) for k in range(3))
    state = two[0].state_dict()
    assert state["batches_drawn"] == 6 and state["shard_index"] == 1  # the peer's position, as one process records it

    four = [RankSampler(peer_sampler(), rank=r, world_size=4) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    assert all(torch.equal(s.next_batch()[0], stream[8 + r]) for r, s in enumerate(four))  # none drawn twice
    single = peer_sampler()
    single.load_state_dict(state)
    assert torch.equal(single.next_batch()[0], stream[6])
