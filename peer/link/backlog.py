"""Reporting the rounds a group decided while the coordinator was unreachable, once it is back."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from peer.link.coordinator_link import CoordinatorLink
from peer.state.state_store import PeerStateStore
from swarm.control.client import CoordinatorClient
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


def report_backlog(
    link: CoordinatorLink,
    client: CoordinatorClient,
    store: PeerStateStore,
    trainer: LocalTrainer,
    *,
    tag: Callable[[Optional[int]], str],
) -> bool:
    """Report the group's rounds in order and check that the coordinator confirms each decision. False on a
    contradiction: this peer must resync from the committed state (the rest of the backlog is dropped); until then
    it shows no committed state, and its disk is looked at again (its own vote may be the committed state)."""
    backlog = link.take_backlog()
    for entry in backlog:
        round_no = entry.request.round
        link.call(lambda: client.report_round(entry.request), f"report round {round_no}")
        decision = link.await_decision(round_no)
        confirmed = decision.committed_hash if decision.outcome == pb.ROUND_OUTCOME_COMMITTED else None
        if confirmed != entry.committed_hash:
            logger.error(
                "%s the coordinator decided %s where the group decided %s; resyncing",
                tag(round_no),
                confirmed or "void",
                entry.committed_hash or "void",
            )
            store.disk_tried = None
            store.stats.update(state_round=-1)
            return False
        logger.info("%s the coordinator confirmed the group's decision", tag(round_no))
        store.prune(below=min(round_no, trainer.round_no))
    store.confirmed(checkpoint=bool(backlog) and trainer.round_no == backlog[-1].request.round)
    return True
