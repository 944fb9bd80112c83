"""A multi-GPU peer's ranks on the CPU (gloo, 2 ranks): this test process is rank 0, as ``swarm peer
--nproc 2`` is, and one spawned worker trains in lockstep with it."""

import copy
import dataclasses

import pytest
import torch

from peer.ranks import start_ranks
from swarm.train.data import BatchSampler, shard
from swarm.train.trainer import LocalTrainer
from tests.unit.test_inner_loop import RUN

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]


def _single_process_twin(peer_index: int) -> LocalTrainer:
    """One process with the 2-rank peer's global batch: rank 0's batch, then rank 1's."""
    run = RUN.replace(data=dataclasses.replace(RUN.data, batch_size=2 * RUN.data.batch_size))
    twin = LocalTrainer(run, peer_index=peer_index)
    d = RUN.data
    split = shard(twin.corpus.train, shard_index=twin.shard_index, num_shards=d.num_shards)
    samplers = [BatchSampler(split, shard_index=r, num_shards=2, batch_size=d.batch_size, seq_len=d.seq_len,
                             seed=RUN.seed) for r in range(2)]

    def next_batch():
        (x0, y0), (x1, y1) = (s.next_batch() for s in samplers)
        return torch.cat([x0, x1]), torch.cat([y0, y1])

    twin.sampler.next_batch = next_batch
    twin.rank_samplers = samplers
    return twin


def _assert_same_params(a: LocalTrainer, b: LocalTrainer) -> None:
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)


def test_a_two_rank_peer_trains_like_one_process_with_the_global_batch():
    ranks = start_ranks(2, device="cpu", threads=1)
    try:
        peer = LocalTrainer(RUN, peer_index=1, ranks=ranks.ranks)
        twin = _single_process_twin(peer_index=1)
        stats = peer.train(3)
        assert stats.samples == twin.train(3).samples == 3 * 2 * RUN.data.batch_size  # both ranks count
        _assert_same_params(peer, twin)
        # a commit moves θl on rank 0 only; the worker gets it before the next steps
        for t in (peer, twin):
            t.commit(t.apply(t.pseudo_gradient(), None, 1), fragment=0)
        peer.train(2), twin.train(2)
        _assert_same_params(peer, twin)
        # a resume replaces rank 0's θl, AdamW state and step count, which the worker never saw
        twin.train(2)
        with torch.no_grad():
            for p, q in zip(peer.model.parameters(), twin.model.parameters()):
                p.copy_(q)
        peer.optimizer.load_state_dict(copy.deepcopy(twin.optimizer.state_dict()))  # as read from a file
        peer.inner_steps_done = twin.inner_steps_done
        peer.sampler.batches_drawn = twin.rank_samplers[0].batches_drawn  # 7 where the peer's ranks drew 5
        peer.train(2), twin.train(2)
        _assert_same_params(peer, twin)
        assert not all(torch.equal(p, g) for p, g in zip(peer.model.parameters(), peer.global_params))
    finally:
        ranks.close()
    assert all(w.exitcode is not None for w in ranks.workers)
