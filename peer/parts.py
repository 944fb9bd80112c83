"""What a peer is built from: the coordinator client, the DHT transport, the round's group and the state
transfer. ``PeerParts`` makes the real ones; the peer's unit tests pass in-process fakes instead."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from peer import identity
from peer.faults import FaultPlan
from peer.link.coordinator_link import PeerExit
from peer.link.retry import with_retry
from swarm.config import RunConfig
from swarm.control.client import CoordinatorClient
from swarm.core.state import GlobalState
from swarm.core.trust import credential
from swarm.net.link.libp2p_identity import Libp2pIdentity
from swarm.net.link.p2p_address import choose_p2p_address, is_loopback, only_loopback, unreachable_sentence

if TYPE_CHECKING:  # hivemind's modules: imported by the parts that use them, while the trainer builds
    from swarm.net.bulk.transport import Transport
    from swarm.net.exchange.group import DhtGroup

logger = logging.getLogger(__name__)


class StateTransfer(Protocol):
    def publish(self, state: GlobalState) -> None: ...

    def download(
        self, holders: list[str], *, round_no: int, expected_hash: str, like: GlobalState
    ) -> tuple[GlobalState, int]: ...


class HivemindStateTransfer:
    """Serves this peer's committed state to the run's members and downloads the committed one from holders,
    showing ``member``'s credential."""

    def __init__(self, transport: Transport, *, run_id: str, timeout_s: float, member: credential.Member) -> None:
        from swarm.net.bulk.state_server import StateServer

        self.transport, self.run_id, self.timeout_s, self.member = transport, run_id, timeout_s, member
        self.server = StateServer(transport, run_id=run_id, member=member)

    def publish(self, state: GlobalState) -> None:
        self.server.publish(state)

    def download(
        self, holders: list[str], *, round_no: int, expected_hash: str, like: GlobalState
    ) -> tuple[GlobalState, int]:
        """The committed state of ``round_no`` (raises StateUnavailable); its hash is checked."""
        from swarm.net.bulk.state_transfer import download_state

        return download_state(
            self.transport,
            member=self.member,
            run_id=self.run_id,
            holders=holders,
            round_no=round_no,
            expected_hash=expected_hash,
            like=like,
            timeout_s=self.timeout_s,
        )


class PeerParts:
    def client(self, join) -> CoordinatorClient:
        return CoordinatorClient(join)

    def libp2p_identity(self, state_dir: Path) -> Libp2pIdentity:
        return identity.fresh_libp2p_identity(state_dir)

    def spare_libp2p_identity(self, state_dir: Path) -> None:
        """Make the next start's libp2p identity now (a background thread during this start)."""
        identity.make_spare_libp2p_identity(state_dir)

    def transport(
        self,
        options,
        initial_peers: list[str],
        *,
        stop: threading.Event,
        tag: str,
        identity: Libp2pIdentity,
        member: credential.Member,
    ) -> Transport:
        """Join the DHT through the coordinator's node with the libp2p identity proven at join, retrying while
        it is unreachable (a coordinator restarting as this peer starts); gives up after join_timeout_s.
        It listens and announces as ``choose_p2p_address`` says, so that groupmates on other machines can
        reach it."""
        # the group's and the state transfer's hivemind modules: imported in this (the DHT start's) thread, not the
        # trainer build's
        import swarm.net.bulk.state_transfer  # noqa: F401
        import swarm.net.exchange.group  # noqa: F401
        from swarm.net.bulk.transport import Transport, TransportStartFailed
        from swarm.net.dht_entries import validator_for

        address = choose_p2p_address(
            coordinator_host=options.join.host, p2p_host=options.p2p_host, announce_host=options.announce_host
        )
        transport = with_retry(
            lambda: Transport(
                initial_peers=initial_peers,
                host=address.listen_host,
                port=options.p2p_port,
                announce_host=address.announce_host,
                identity_path=str(identity.path),
                # from its first moment the node stores and passes on members' signed entries only
                record_validators=[validator_for(member)],
                tcp_congestion=options.tcp_congestion,
            ),
            what=f"{tag} DHT start",
            stop=stop,
            give_up_after_s=options.join_timeout_s,
            first_backoff_s=1.0,
            retry_on=TransportStartFailed,
        )
        if transport is None and stop.is_set():
            # the peer is stopping: a signal, or its start failed for another reason (its data, its device) and
            # ``leave`` stopped this thread; that reason is what the peer reports, not the DHT
            raise PeerExit(0)
        if transport is None:
            logger.error(
                "%s could not join the DHT through %s for %.0fs; check that the coordinator is running "
                "and that this machine can reach its DHT port",
                tag,
                initial_peers,
                options.join_timeout_s,
            )
            raise PeerExit(2)
        from swarm.net.link.relay import use_relay

        transport.relay = transport.run(use_relay(transport.p2p, initial_peers), timeout_s=30)
        _say_where_reachable(transport, address, options, tag)
        return transport

    def group(
        self,
        transport: Transport,
        run: RunConfig,
        *,
        run_id: str,
        peer_id: str,
        peer_index: int,
        planned: Callable[[int], Optional[set[str]]],
        faults: FaultPlan,
        member: Optional[credential.Member] = None,
        processes=dict,
    ) -> DhtGroup:
        """``member``: the peer's key and credential after the join (``CoordinatorLink.member``); ``processes``:
        the planned peers' current libp2p ids (``CoordinatorLink.current_processes``)."""
        from swarm.net.exchange.group import DhtGroup

        return DhtGroup(
            transport,
            run,
            run_id=run_id,
            peer_id=peer_id,
            peer_index=peer_index,
            planned=planned,
            faults=faults,
            member=member,
            processes=processes,
        )

    def state_transfer(
        self, transport: Transport, *, run_id: str, timeout_s: float, member: Optional[credential.Member] = None
    ) -> HivemindStateTransfer:
        """``member``: the peer's key and credential after the join (``CoordinatorLink.member``)."""
        return HivemindStateTransfer(transport, run_id=run_id, timeout_s=timeout_s, member=member)


def _say_where_reachable(transport, address, options, tag: str) -> None:
    """Log where groupmates reach this peer; warn when only this machine can while the coordinator is elsewhere."""
    visible = transport.visible_maddrs
    logger.info("%s listening on %s, reachable for groupmates at %s", tag, address.listen_host, ", ".join(visible))
    if only_loopback(visible) and not is_loopback(options.join.host):
        logger.warning(
            "%s %s%s",
            tag,
            unreachable_sentence(visible),
            f", and listen there (--p2p-host {address.listen_host} listens on this machine only)"
            if is_loopback(address.listen_host)
            else "",
        )
