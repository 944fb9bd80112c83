"""The gRPC face of the coordinator: translate each request, call the engine, map refusals to statuses.

No decisions here; see ``coordinator.engine`` and the pure modules it calls.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Optional, Sequence, TypeVar

import grpc

from coordinator.api import auth, tokens
from coordinator.api.challenges import Challenges
from coordinator.api.errors import RateLimited, Rejection, StaleChallenge, WrongProtocol
from coordinator.api.limits import check_request
from coordinator.api.rate_limit import JoinLimits, RateLimiter, client_address
from coordinator.engine import CoordinatorEngine
from swarm.control import signing
from swarm.core.wire_protocol import PROTOCOL, mismatch
from swarm.v1 import coordinator_pb2 as pb
from swarm.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)


def _rpc(method: F) -> F:
    """Turn a Rejection into its gRPC status with the one-sentence message; never leak a traceback."""

    @functools.wraps(method)
    def wrapper(self: "CoordinatorServicer", request, context: grpc.ServicerContext):
        try:
            check_request(method.__name__, request)
            return method(self, request, context)
        except Rejection as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except Exception as e:  # a bug: log it here, tell the caller in one sentence
            logger.exception("%s failed", method.__name__)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"the coordinator failed to handle {method.__name__} ({type(e).__name__}); see its log.",
            )

    return wrapper  # type: ignore[return-value]


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        engine: CoordinatorEngine,
        *,
        dht_initial_peers: Sequence[str],
        challenges: Optional[Challenges] = None,
        join_limits: JoinLimits = JoinLimits(),
    ) -> None:
        self._engine = engine
        self._dht_initial_peers = list(dht_initial_peers)
        self._challenges = challenges or Challenges()
        self._challenges_per_address = RateLimiter(join_limits.challenges_per_address)
        self._joins_per_address = RateLimiter(join_limits.joins_per_address)
        self._joins_per_token = RateLimiter(join_limits.joins_per_token)

    def _authenticate(self, method: str, request, context) -> None:
        """Refuse the call unless it is signed by the key of the peer it names (see swarm.control.signing)."""
        self._engine.authenticate(self._proof(method, request, context), request.peer_id)

    @staticmethod
    def _proof(method: str, request, context) -> Optional[signing.CallProof]:
        """The call's signature as its metadata carries it (None: none), for the engine to check."""
        return signing.CallProof.from_metadata(method, context.invocation_metadata(), request)

    @_rpc
    def Challenge(self, request: pb.ChallengeRequest, context) -> pb.ChallengeResponse:
        address = client_address(context.peer())
        if not self._challenges_per_address.allow(address):
            raise RateLimited(f"too many joins from {address}; wait a few seconds and join again.")
        return pb.ChallengeResponse(nonce=self._challenges.issue(time.monotonic()), expires_in_s=self._challenges.ttl_s)

    @_rpc
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        address, token_id = client_address(context.peer()), tokens.split(request.token)[0]
        if not self._joins_per_address.allow(address):
            raise RateLimited(f"too many joins from {address}; wait a few seconds and join again.")
        if not self._joins_per_token.allow(token_id[:64]):
            raise RateLimited(f"too many joins with token {token_id[:64]}; wait a few seconds and join again.")
        if request.protocol != PROTOCOL:  # refused before it can void a round of the peers it would be grouped with
            raise WrongProtocol(mismatch(request.protocol, PROTOCOL, peer_version=request.swarm_version[:64]))
        if not self._challenges.take(request.nonce, time.monotonic()):
            raise StaleChallenge()
        claim = auth.verify_join(request)
        peer, info = self._engine.join(
            request.token,
            public_key=claim.public_key,
            dht_peer_id=claim.dht_peer_id,
            name=request.name,
            site=request.site,
            device=request.device,
            swarm_version=request.swarm_version,
        )
        pace = self._engine.pace()
        return pb.JoinResponse(
            peer_id=peer.peer_id,
            run_id=self._engine.run.run_id,
            run_spec_json=self._engine.run.run_spec_json,
            dht_initial_peers=self._dht_initial_peers,
            heartbeat_interval_s=pace.heartbeat_interval_s,
            lease_s=pace.lease_s,
            peer_index=peer.peer_index,
            round=info,
            session=peer.session,
            credential=self._engine.issue_credential(peer.peer_id),
            coordinator_public_key=self._engine.public_key,
            protocol=PROTOCOL,
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        return self._engine.signed_heartbeat(request, self._proof("Heartbeat", request, context))

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._authenticate("Leave", request, context)
        self._engine.leave(request.peer_id, request.reason)
        return pb.LeaveResponse()

    @_rpc
    def ReportRound(self, request: pb.ReportRoundRequest, context) -> pb.ReportRoundResponse:
        self._authenticate("ReportRound", request, context)
        return pb.ReportRoundResponse(round=self._engine.report(request))

    @_rpc
    def GetRound(self, request: pb.GetRoundRequest, context) -> pb.RoundInfo:
        self._authenticate("GetRound", request, context)
        return self._engine.round_info(request.peer_id, request.round)

    @_rpc
    def GetRoundEncoded(self, request: pb.GetRoundRequest, context) -> bytes:
        """GetRound's answer already encoded, which the server sends as it is (``coordinator.server``)."""
        return self._engine.round_info_encoded(
            request.peer_id, request.round, self._proof("GetRound", request, context), signed=True
        )

    @_rpc
    def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        return self._engine.status(request.token, page_size=request.page_size, page_token=request.page_token)

    @_rpc
    def GetHistory(self, request: pb.GetHistoryRequest, context) -> pb.GetHistoryResponse:
        return self._engine.history(request.token, after_round=request.after_round, max_rounds=request.max_rounds)
