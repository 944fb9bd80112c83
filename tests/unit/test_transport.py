"""Starting a peer's DHT transport: a bootstrap peer that does not answer is a clear error, not a hang."""

from __future__ import annotations

import pytest

from swarm.transport import Transport, TransportStartFailed

pytestmark = pytest.mark.timeout(120)


def test_a_dht_whose_bootstrap_peer_is_gone_fails_to_start_with_a_message():
    gone = Transport(initial_peers=[])
    maddrs = gone.visible_maddrs
    gone.shutdown()

    with pytest.raises(TransportStartFailed, match="the DHT did not start through"):
        Transport(initial_peers=maddrs, start_timeout_s=30)

    again = Transport(initial_peers=[])  # and a transport still starts in this process afterwards
    again.shutdown()
