"""The generation of Swarm's peer-to-peer wire formats: how an exchange cuts and frames its slices.

Two peers of different generations cannot average together, so a coordinator admits only peers of its
own generation (``JoinRequest.protocol``), a peer leaves a coordinator of another (``JoinResponse.protocol``),
and every member posts it with its rendezvous entry (``swarm.net.exchange.rendezvous.Member.protocol``). Raise it with
any change that makes an exchange of the new code fail against the old.
"""

from __future__ import annotations

import functools

# 2: the butterfly in stripes (swarm.core.average.butterfly_bounds), one claim message per groupmate
# 3: ternary@<density> below 1/32 in blocks of up to 8,192 elements (sparse_ternary_codec.block_for): its slices'
#    bounds and payloads differ from 2's
# 4: a DHT entry signs the expiration it is stored with (swarm.core.trust.signed_entry.EXPIRES_AT): a peer of 3 refuses
#    every entry of 4 (an unknown field), and a peer of 4 every entry of 3 (no signed expiration)
# 5: a RoundInfo about a round of more than 256 participants names only the requester's own entries of its lists
#    (RoundInfo.participant_count says how many there are): a peer of 4 would take them for the whole plan
PROTOCOL = 5


@functools.cache
def release() -> str:
    """This installation's Swarm release (shown beside the protocol; "0+unknown" from a source checkout)."""
    try:
        from importlib.metadata import version

        return version("swarm-train")
    except Exception:  # running from a source checkout
        return "0+unknown"


def mismatch(peer: int, coordinator: int, *, peer_version: str = "", fix: str = "") -> str:
    """One sentence for a peer and a coordinator of different generations (0: from before the field). The
    coordinator's release is not named: a refused caller has not shown a token yet."""

    def named(protocol: int) -> str:
        return f"wire protocol {protocol}" if protocol else "a release that does not say its wire protocol"

    if peer_version:
        runs = f"Swarm {peer_version} with {named(peer)}" if peer else f"Swarm {peer_version}, {named(peer)},"
    else:
        runs = named(peer)
    return (
        f"this peer runs {runs} while the run's coordinator runs {named(coordinator)}: peers of different"
        f" protocols cannot average together; {fix or INSTALL_THE_COORDINATORS}"
    )


INSTALL_THE_COORDINATORS = "install the Swarm release the coordinator runs on this machine and join again."
ASK_THE_OPERATOR = "ask the run's operator which Swarm release the coordinator runs, install it here and join again."
