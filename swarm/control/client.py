"""The peer's and the status CLI's client for the coordinator's control plane (gRPC over pinned TLS).

Every call has a deadline.  Failures come as ``CoordinatorUnreachable`` (retry later; the peer keeps
training) or ``CoordinatorRejected`` (the coordinator said no; its one sentence says what to do).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import grpc

from swarm.control import signing, tls
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey
from swarm.core.wire_protocol import PROTOCOL, release
from swarm.v1 import coordinator_pb2 as pb
from swarm.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# CANCELLED: only when close() (or a reconnect) cut a call short; the coordinator never cancels.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)

_SIGNED = ("Heartbeat", "Leave", "ReportRound", "GetRound")  # a member's calls, signed by its key


class CoordinatorError(Exception):
    """Any failure to get an answer from the coordinator."""


class CoordinatorUnreachable(CoordinatorError):
    """No answer (refused, timed out, unavailable): worth retrying later."""


class CoordinatorBusy(CoordinatorUnreachable):
    """The coordinator asked this client to slow down (too many joins from its address or token): retry later."""


class CoordinatorRejected(CoordinatorError):
    """The coordinator answered no; retrying the same request will not help."""

    def __init__(self, details: str, code: grpc.StatusCode) -> None:
        super().__init__(details)
        self.details = details
        self.code = code


class CoordinatorImpostor(CoordinatorRejected, tls.TLSPinError):
    """The server at the join string's address presented a certificate the join string does not pin."""

    def __init__(self, details: str) -> None:
        super().__init__(details, grpc.StatusCode.UNAUTHENTICATED)


class CoordinatorClient:
    """Thread-safe; connects on first use and reconnects (re-checking the certificate) after a failure."""

    def __init__(self, join: JoinString, *, request_timeout_s: float = 10.0, connect_timeout_s: float = 10.0) -> None:
        self.join_string = join
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._channel: Optional[grpc.Channel] = None
        self._stub: Optional[pb_grpc.CoordinatorStub] = None
        self.signer: Optional[signing.CallSigner] = None  # set by join: signs every member call

    # --- calls ----------------------------------------------------------------------------------

    def join(
        self,
        *,
        key: PeerKey,
        libp2p: signing.Libp2pSigner,
        site: str = "",
        device: str = "",
        name: str = "",
        swarm_version: Optional[str] = None,
        protocol: int = PROTOCOL,
    ) -> pb.JoinResponse:
        """Join over a fresh challenge, signed by ``key`` and ``libp2p``; every later call of this client is
        then signed by ``key`` in the session the coordinator returned."""
        version = release() if swarm_version is None else swarm_version
        for attempt in range(2):
            nonce = self._call("Challenge", pb.ChallengeRequest()).nonce
            request = signing.signed_join(
                token=self.join_string.token,
                nonce=nonce,
                key=key,
                libp2p=libp2p,
                site=site,
                device=device,
                name=name,
                swarm_version=version,
                protocol=protocol,
            )
            try:
                response = self._call("Join", request)
            except CoordinatorRejected as e:
                if e.code == grpc.StatusCode.ABORTED and attempt == 0:
                    continue  # the challenge went stale (a coordinator restart): once more with a fresh one
                raise
            self.signer = signing.CallSigner(key, response.session)
            return response
        raise AssertionError("unreachable")

    def heartbeat(self, request: pb.HeartbeatRequest | str, **metrics: Any) -> pb.HeartbeatResponse:
        """Send a HeartbeatRequest, or build one from a peer id and its PeerMetrics fields (state, round, ...)."""
        if isinstance(request, str):
            request = pb.HeartbeatRequest(peer_id=request, metrics=pb.PeerMetrics(**metrics))
        return self._call("Heartbeat", request)

    def leave(self, peer_id: str, reason: str = "") -> pb.LeaveResponse:
        return self._call("Leave", pb.LeaveRequest(peer_id=peer_id, reason=reason))

    def report_round(
        self, request: pb.ReportRoundRequest | str, round_no: int = 0, **fields: Any
    ) -> pb.ReportRoundResponse:
        """Send a ReportRoundRequest, or build one from a peer id, the round and its fields (ok, ...)."""
        if isinstance(request, str):
            request = pb.ReportRoundRequest(peer_id=request, round=round_no, **fields)
        return self._call("ReportRound", request)

    def get_round(self, peer_id: str, round_no: int = 0) -> pb.RoundInfo:
        """Round ``round_no``, or with 0 the open one (the latest decided when none is open)."""
        return self._call("GetRound", pb.GetRoundRequest(peer_id=peer_id, round=round_no))

    def get_status(self, *, page_size: int = 0, page_token: str = "") -> pb.GetStatusResponse:
        """One page of the run's status; ``next_page_token`` names the next ("" on the last)."""
        return self._call(
            "GetStatus", pb.GetStatusRequest(token=self.join_string.token, page_size=page_size, page_token=page_token)
        )

    def get_history(self, *, after_round: int = 0, max_rounds: int = 0) -> pb.GetHistoryResponse:
        """The decided rounds after ``after_round``; ``more`` says whether to ask again after the last one."""
        return self._call(
            "GetHistory",
            pb.GetHistoryRequest(token=self.join_string.token, after_round=after_round, max_rounds=max_rounds),
        )

    def close(self) -> None:
        with self._lock:
            self._drop_channel()

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------------

    def _call(self, method: str, request: Any) -> Any:
        stub = self._connect()
        signer = self.signer
        metadata = signer.metadata(method, request) if signer is not None and method in _SIGNED else None
        try:
            return getattr(stub, method)(request, timeout=self.request_timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code in _RETRYABLE:
                if code == grpc.StatusCode.UNAVAILABLE:
                    with self._lock:
                        if self._stub is stub:  # the next call re-fetches and re-checks the certificate
                            self._drop_channel()
                raise self._unreachable(f"{_code_words(code)}: {details}" if details else _code_words(code)) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                # gRPC's own size limit: the request is too big, and will be too big next time too
                raise CoordinatorRejected(
                    f"the {method} request is too large for the coordinator ({details}); "
                    "shorten the names and labels it carries.",
                    code,
                ) from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise CoordinatorBusy(details or "the coordinator is busy; retry later") from None
            raise CoordinatorRejected(details or f"the coordinator refused {method} ({code.name})", code) from None
        except ValueError:
            # "Cannot invoke RPC on closed channel": another thread (the heartbeat, the round loop) found the
            # coordinator unavailable and dropped this channel between our _connect and the call.
            with self._lock:
                if self._stub is stub:
                    self._drop_channel()
            raise self._unreachable("the connection was closed while the coordinator was unavailable") from None

    def _connect(self) -> pb_grpc.CoordinatorStub:
        with self._lock:
            if self._stub is not None:
                return self._stub
            j = self.join_string
            try:
                self._channel = tls.pinned_channel(j.host, j.port, j.fingerprint, timeout_s=self.connect_timeout_s)
            except tls.TLSPinError as e:
                raise CoordinatorImpostor(str(e)) from None
            except ConnectionRefusedError:
                raise self._unreachable("connection refused") from None
            except TimeoutError:
                raise self._unreachable(f"no answer within {self.connect_timeout_s:g}s") from None
            except OSError as e:  # DNS failure, unreachable network, TLS handshake failure
                raise self._unreachable(e.strerror or str(e) or type(e).__name__) from None
            self._stub = pb_grpc.CoordinatorStub(self._channel)
            return self._stub

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def _unreachable(self, why: str) -> CoordinatorUnreachable:
        return CoordinatorUnreachable(
            f"cannot reach the coordinator at {self.join_string.address} ({why}); "
            "check the address and that the coordinator is running."
        )


def _code_words(code: grpc.StatusCode) -> str:
    return {
        grpc.StatusCode.DEADLINE_EXCEEDED: "no answer before the deadline",
        grpc.StatusCode.CANCELLED: "the call was cancelled",
    }.get(code, "unavailable")
