"""The generation of Swarm's peer-to-peer wire formats: how an exchange cuts and frames its slices.

Two peers of different generations cannot average together, so a coordinator admits only peers of its
own generation (``JoinRequest.protocol``), a peer leaves a coordinator of another (``JoinResponse.protocol``),
and every member posts it with its rendezvous entry (``swarm.net.rendezvous.Member.protocol``). Raise it with
any change that makes an exchange of the new code fail against the old.
"""

from __future__ import annotations

# 2: the butterfly in stripes (swarm.core.average.butterfly_bounds), one claim message per groupmate (session 16)
PROTOCOL = 2


def release() -> str:
    """This installation's Swarm release (shown beside the protocol; "0+unknown" from a source checkout)."""
    try:
        from importlib.metadata import version

        return version("swarm-train")
    except Exception:  # running from a source checkout
        return "0+unknown"


def mismatch(peer: int, coordinator: int, *, peer_version: str = "", coordinator_version: str = "") -> str:
    """One sentence for a peer and a coordinator of different generations (0: from before the field)."""
    shown = peer_version != coordinator_version  # the same release number says nothing here

    def named(protocol: int, version: str) -> str:
        release = f"Swarm {version}, " if version and shown else ""
        return f"{release}wire protocol {protocol}" if protocol else f"{release}a release that does not say its protocol"

    return (f"this peer runs {named(peer, peer_version)} and the run's coordinator {named(coordinator, coordinator_version)}:"
            " peers of different protocols cannot average together; install the coordinator's Swarm release on"
            " this machine and join again.")
