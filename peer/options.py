"""How a peer is run: the command line's choices (``swarm peer --help``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from peer.faults import FaultPlan
from swarm.control.joinstring import JoinString
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL


@dataclass(frozen=True, kw_only=True)
class PeerOptions:
    join: JoinString
    device: str = "cpu"
    nproc: int = 1  # ranks training this peer data-parallel (one per GPU; gloo processes on a CPU)
    state_dir: Path = Path("swarm-peer")
    site: str = ""
    name: str = ""
    threads: Optional[int] = None  # torch intra-op threads; None keeps torch's default
    # None: all interfaces, or loopback when the coordinator is (swarm.net.link.p2p_address)
    p2p_host: Optional[str] = None
    p2p_port: int = 0
    announce_host: Optional[str] = None  # None: the address of the route to the coordinator
    uplink_mbit: float = 0.0  # the operator's word for this machine's uplink: paces the bulk sends (0: unpaced)
    tcp_congestion: str = CONGESTION_CONTROL  # the bulk connections' congestion control ("system": the default)
    poll_s: float = 0.2  # how often a waiting peer asks the coordinator about the round
    state_timeout_s: float = 120.0
    join_timeout_s: float = 120.0  # give up joining when the coordinator stays unreachable this long
    faults: FaultPlan = field(default_factory=FaultPlan)  # deterministic fault injection (tests, chaos)
    checkpoint_every_rounds: int = 5  # 0: never, and votes are not written either (a checkpoint is still
    # written when the peer exits)
    leave_grace_s: float = 10.0  # a leaving peer still waits this long for its round's decision
    final_serve_s: float = 30.0  # after the run, keep serving the final state this long at most while live
    # peers still download it
