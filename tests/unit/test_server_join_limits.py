"""A coordinator started with its own join limits applies them (a load test raises them; see
scripts/bench_coordinator.py)."""

from pathlib import Path

import pytest

from coordinator.api.rate_limit import JoinLimits, Rate
from coordinator.server import CoordinatorServer
from swarm.config import RoundConfig, RunConfig
from swarm.control.client import CoordinatorBusy, CoordinatorClient
from swarm.core.trust.credential import PeerKey
from tests.unit.fake_swarm import libp2p_identity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_the_join_limits_given_to_the_server_are_the_ones_it_enforces(tmp_path: Path) -> None:
    limits = JoinLimits(joins_per_address=Rate(per_s=1e-3, burst=2))  # the default takes 10 at once
    server = CoordinatorServer(run=RunConfig(rounds=RoundConfig(min_peers=1)), state_dir=tmp_path, join_limits=limits)
    join = server.start()
    libp2p = libp2p_identity()  # shared: an RSA key takes a while to make
    try:
        with CoordinatorClient(join, request_timeout_s=5, connect_timeout_s=5) as client:
            for _ in range(2):
                client.join(key=PeerKey.generate(), libp2p=libp2p)
            with pytest.raises(CoordinatorBusy, match="too many joins from ipv4:127.0.0.1"):
                client.join(key=PeerKey.generate(), libp2p=libp2p)
            assert len(client.get_status().peers) == 2
    finally:
        server.stop()
