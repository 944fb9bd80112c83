"""The gRPC face of the coordinator: translate each request, call the engine, map refusals to statuses.

No decisions here; see ``coordinator.engine`` and the pure modules it calls.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence, TypeVar

import grpc

from coordinator.engine import CoordinatorEngine
from coordinator.errors import Rejection
from coordinator.limits import check_request
from coordinator.views import status_page
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
        self, engine: CoordinatorEngine, *, dht_initial_peers: Sequence[str], heartbeat_interval_s: float
    ) -> None:
        self._engine = engine
        self._dht_initial_peers = list(dht_initial_peers)
        self._heartbeat_interval_s = heartbeat_interval_s

    @_rpc
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        peer, info = self._engine.join(
            request.token, name=request.name, site=request.site, device=request.device,
            swarm_version=request.swarm_version, previous_peer_id=request.previous_peer_id,
        )
        return pb.JoinResponse(
            peer_id=peer.peer_id,
            run_id=self._engine.run.run_id,
            run_spec_json=self._engine.run.run_spec_json,
            dht_initial_peers=self._dht_initial_peers,
            heartbeat_interval_s=self._heartbeat_interval_s,
            lease_s=self._engine.lease_s,
            peer_index=peer.peer_index,
            round=info,
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(round=self._engine.heartbeat(request), lease_s=self._engine.lease_s)

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._engine.leave(request.peer_id, request.reason)
        return pb.LeaveResponse()

    @_rpc
    def ReportRound(self, request: pb.ReportRoundRequest, context) -> pb.ReportRoundResponse:
        return pb.ReportRoundResponse(round=self._engine.report(request))

    @_rpc
    def GetRound(self, request: pb.GetRoundRequest, context) -> pb.RoundInfo:
        return self._engine.round_info(request.peer_id, request.round)

    @_rpc
    def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        return status_page(self._engine.status(request.token), page_size=request.page_size,
                           page_token=request.page_token)
