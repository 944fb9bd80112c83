"""What the control plane's per-call signatures cost: the same calls with and without them, side by side.

One engine (its SQLite store in a temporary directory, as the coordinator keeps it) and two servicers over
it, in this process: the real one, which checks every member call's signature, and a copy whose
``_authenticate`` does nothing (it exists in this script only; the coordinator has no such switch).
``--peers`` peers join through the real servicer; then each of ``--calls`` calls goes once through each
servicer, in alternating order, from the next peer in turn:

- signed: the peer signs its metadata (``CallSigner.metadata``), then the real servicer handles it (which checks
  the signature, the session and that the peer's join token is not revoked: a lookup in the store);
- unsigned: the copy handles the same request without metadata.

``ratio_p50`` is the signed call's p50 over the unsigned one's, per method: Heartbeat (the call every
peer makes every interval) and GetRound (the cheapest signed call, so the worst ratio).  Also timed
alone: the peer's signing, the coordinator's whole check (reading the proof from the metadata and
``engine.authenticate``) and, of that, the Ed25519 verification alone (``CallProof.verify``).  No gRPC, no TLS: over the network each call also pays those (see
scripts/bench_coordinator.py for the whole call).  Run it as

    python scripts/bench_signing.py --peers 200 --calls 3000 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from coordinator.api.rate_limit import JoinLimits, Rate  # noqa: E402
from coordinator.api.servicer import CoordinatorServicer  # noqa: E402
from coordinator.engine import CoordinatorEngine  # noqa: E402
from coordinator.store.database import Store  # noqa: E402
from swarm.config import RoundConfig, RunConfig  # noqa: E402
from swarm.control import signing  # noqa: E402
from swarm.core.trust.credential import PeerKey  # noqa: E402
from swarm.net.link.libp2p_identity import Libp2pIdentity  # noqa: E402
from swarm.v1 import coordinator_pb2 as pb  # noqa: E402


class Context:
    """The part of grpc.ServicerContext the servicer reads."""

    def __init__(self, metadata: Any = None) -> None:
        self.metadata = metadata or []

    def invocation_metadata(self) -> Any:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


class UncheckedServicer(CoordinatorServicer):
    """The servicer without the signature check: the baseline of this measurement, nothing else."""

    def _authenticate(self, method: str, request: Any, context: Any) -> None:
        pass


def joined_peers(
    servicer: CoordinatorServicer, token: str, count: int, libp2p: Libp2pIdentity
) -> tuple[list[tuple[str, signing.CallSigner]], str]:
    """``count`` peers joined as real peers join (sharing one libp2p identity): ids and signers, and the
    run's initial state hash."""
    peers, initial_hash = [], ""
    for i in range(count):
        key = PeerKey.generate()
        nonce = servicer.Challenge(pb.ChallengeRequest(), Context()).nonce
        joined = servicer.Join(
            signing.signed_join(token=token, nonce=nonce, key=key, libp2p=libp2p, name=f"p{i}"), Context()
        )
        peers.append((joined.peer_id, signing.CallSigner(key, joined.session)))
        initial_hash = joined.round.last_committed_hash
    return peers, initial_hash


def measure(
    method: str,
    make: Callable[[str], Any],
    peers: list,
    calls: int,
    checked: CoordinatorServicer,
    unchecked: CoordinatorServicer,
    engine: CoordinatorEngine,
) -> dict:
    signed, unsigned, sign, check, verify = [], [], [], [], []
    for i in range(calls):
        peer_id, signer = peers[i % len(peers)]
        request = make(peer_id)
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            started = time.perf_counter()
            if which == 0:
                metadata = signer.metadata(method, request)
                signed_at = time.perf_counter()
                getattr(checked, method)(request, Context(metadata))
                signed.append(time.perf_counter() - started)
                sign.append(signed_at - started)
                started = time.perf_counter()
                proof = signing.CallProof.from_metadata(method, metadata, request)
                engine.authenticate(proof, peer_id)
                check.append(time.perf_counter() - started)
                started = time.perf_counter()
                proof.verify(signer.key.public_key, now=time.time())
                verify.append(time.perf_counter() - started)
            else:
                getattr(unchecked, method)(request, Context())
                unsigned.append(time.perf_counter() - started)
    p50 = {
        name: statistics.median(values) * 1000
        for name, values in (
            ("signed", signed),
            ("unsigned", unsigned),
            ("sign", sign),
            ("check", check),
            ("verify", verify),
        )
    }
    return {
        "signed_p50_ms": round(p50["signed"], 4),
        "unsigned_p50_ms": round(p50["unsigned"], 4),
        "ratio_p50": round(p50["signed"] / p50["unsigned"], 3),
        "client_sign_p50_ms": round(p50["sign"], 4),
        "coordinator_check_p50_ms": round(p50["check"], 4),
        "of_which_verify_p50_ms": round(p50["verify"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=200, help="peers joined before measuring")
    parser.add_argument("--calls", type=int, default=3000, help="calls per method, each made signed and unsigned")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-signing-") as directory:
        engine = CoordinatorEngine(
            Store.in_dir(Path(directory)),
            config=RunConfig(rounds=RoundConfig(min_peers=1)),
            lease_s=3600.0,
            heartbeat_interval_s=1.0,
            signing_key=PeerKey.generate(),
        )
        many = Rate(per_s=1e6, burst=1_000_000)
        limits = JoinLimits(challenges_per_address=many, joins_per_address=many, joins_per_token=many)
        checked = CoordinatorServicer(engine, dht_initial_peers=[], join_limits=limits)
        unchecked = UncheckedServicer(engine, dht_initial_peers=[], join_limits=limits)
        peers, initial_hash = joined_peers(
            checked, engine.run.token, args.peers, Libp2pIdentity.create(Path(directory) / "p2p-identity.key")
        )

        def beat(peer_id):
            metrics = pb.PeerMetrics(state=pb.PEER_STATE_JOINING, state_hash=initial_hash, param_count=1000)
            return pb.HeartbeatRequest(peer_id=peer_id, metrics=metrics)

        result = {"peers": args.peers, "calls": args.calls}
        for method, make in (("Heartbeat", beat), ("GetRound", lambda peer_id: pb.GetRoundRequest(peer_id=peer_id))):
            result[method] = measure(method, make, peers, args.calls, checked, unchecked, engine)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:12s} {value}")


if __name__ == "__main__":
    main()
