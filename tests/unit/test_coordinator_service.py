"""The coordinator end to end over real gRPC + TLS on 127.0.0.1, driven by CoordinatorClient."""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from google.protobuf import json_format

from coordinator.server import JOIN_STRING_FILE, CoordinatorServer, serve
from coordinator.store.run_identity import with_data_fingerprint
from swarm.app.cli import main as cli_main
from swarm.config import RoundConfig, RunConfig
from swarm.control import tls
from swarm.control.client import CoordinatorClient, CoordinatorError, CoordinatorRejected, CoordinatorUnreachable
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey, verify_credential
from swarm.core.wire_protocol import PROTOCOL, release
from swarm.train.model.initial_state import run_identity
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import libp2p_identity, member_client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

RUN = RunConfig(rounds=RoundConfig(min_peers=2, max_rounds=3, inner_steps=5))
ROOT = Path(__file__).resolve().parents[2]
MODEL = run_identity(RUN)  # the same for every RoundConfig: the rounds do not change the model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorServer]:
    server = CoordinatorServer(run=RUN, state_dir=tmp_path_factory.mktemp("coordinator"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def client(server: CoordinatorServer) -> Iterator[CoordinatorClient]:
    """A client that has not joined (status only)."""
    with CoordinatorClient(server.join_string, request_timeout_s=5, connect_timeout_s=5) as client:
        yield client


@pytest.fixture
def members(server: CoordinatorServer):
    """``members(name)``: a client joined as a new peer, and its JoinResponse; all closed after the test."""
    made: list[CoordinatorClient] = []

    def join(name: str = "", **fields):
        client, joined = member_client(server.join_string, name=name, **fields)
        made.append(client)
        return client, joined

    yield join
    for client in made:
        client.close()


def ready(
    client: CoordinatorClient, peer_id: str, state_round: int = 0, state_hash: str = "h0"
) -> pb.HeartbeatResponse:
    """A ready peer's heartbeat; "h0" stands for θ0's hash, which the coordinator derives from the config."""
    return client.heartbeat(
        peer_id,
        state=pb.PEER_STATE_READY,
        state_round=state_round,
        state_hash=MODEL.initial_hash if state_hash == "h0" else state_hash,
        model_fingerprint=MODEL.model_fingerprint,
        param_count=1000,
        dht_peer_id="dht-" + peer_id,
        tokens=640,
        inner_steps=5,
        inner_time_s=3.0,
        wall_time_s=4.0,
        bytes_sent=100,
        bytes_received=90,
    )


def test_join_string_is_printed_to_the_state_dir(server: CoordinatorServer) -> None:
    text = (server._state_dir / JOIN_STRING_FILE).read_text().strip()
    join = JoinString.parse(text)
    assert join == server.join_string and join.host == "127.0.0.1" and join.port > 0


def test_bad_token_is_rejected_and_the_server_keeps_serving(server: CoordinatorServer) -> None:
    impostor = CoordinatorClient(dataclasses.replace(server.join_string, token="guessed"), request_timeout_s=5)
    with pytest.raises(CoordinatorRejected) as info:
        impostor.join(key=PeerKey.generate(), libp2p=libp2p_identity(), name="x")
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "ask the operator for the current join string" in str(info.value)
    impostor.close()
    with CoordinatorClient(server.join_string, request_timeout_s=5) as honest:
        key = PeerKey.generate()
        response = honest.join(key=key, libp2p=libp2p_identity(), name="honest", site="lab", device="cpu")
    assert response.peer_id == key.peer_id
    assert response.run_spec_json == with_data_fingerprint(RUN).to_json()  # the spec with the data pinned
    assert response.dht_initial_peers and response.dht_initial_peers[0].startswith("/ip4/127.0.0.1/tcp/")
    assert "/p2p/" in response.dht_initial_peers[0]
    slowed = response.lease_s / 15.0  # the operator's pace, slowed only while the coordinator's loop runs behind
    assert slowed in (1.0, 2.0, 4.0, 8.0) and response.heartbeat_interval_s == 2.0 * slowed


@pytest.mark.parametrize("protocol", [PROTOCOL - 1, 0], ids=["another-protocol", "a-release-before-the-field"])
def test_a_peer_of_another_wire_protocol_is_refused_at_join_with_the_fix_and_honest_peers_still_join(
    server: CoordinatorServer, protocol: int
) -> None:
    key = PeerKey.generate()
    with CoordinatorClient(server.join_string, request_timeout_s=5) as other:
        with pytest.raises(CoordinatorRejected) as info:
            other.join(key=key, libp2p=libp2p_identity(), name="other", swarm_version="0.0.9", protocol=protocol)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        shown = (
            f"0.0.9 with wire protocol {protocol}"
            if protocol
            else "0.0.9, a release that does not say its wire protocol,"
        )
        assert (
            f"this peer runs Swarm {shown} while the run's coordinator runs wire protocol {PROTOCOL}:"
            in info.value.details
        )
        assert "install the Swarm release the coordinator runs on this machine and join again" in info.value.details
        assert release() not in info.value.details  # nothing about the coordinator's software before a token
        assert key.peer_id not in {p.id for p in other.get_status().peers}  # it never became a member
    honest, joined = member_client(server.join_string, name="honest")
    honest.close()
    assert joined.protocol == PROTOCOL


def test_unknown_peer_heartbeat_is_unauthenticated(client: CoordinatorClient) -> None:
    with pytest.raises(CoordinatorRejected) as info:
        client.heartbeat("p-00000000", state=pb.PEER_STATE_READY)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "is not signed by a member of this run" in info.value.details


def test_two_ready_peers_open_round_one_and_commit_it(client: CoordinatorClient, members) -> None:
    (ca, a), (cb, b) = members("a"), members("b")
    ready(ca, a.peer_id)
    info = ready(cb, b.peer_id).round
    assert info.open_round == 1 and list(info.participants) == [b.peer_id]  # a heartbeat's answer: its own entry
    assert {a.peer_id, b.peer_id} <= set(cb.get_round(b.peer_id).participants)
    group = [a.peer_id, b.peer_id]  # a report names the group it averaged with
    ca.report_round(a.peer_id, 1, ok=True, state_hash="h1", inner_steps=5, loss=3.5, samples=40, group=group)
    cb.report_round(
        pb.ReportRoundRequest(  # a prebuilt request works too
            peer_id=b.peer_id, round=1, ok=True, state_hash="h1", inner_steps=5, loss=3.5, samples=40, group=group
        )
    )
    committed = ca.get_round(a.peer_id, 1)
    assert (committed.outcome, committed.committed_hash) == (pb.ROUND_OUTCOME_COMMITTED, "h1")
    # the holders are the libp2p ids proven at join, whatever a heartbeat said
    assert set(committed.holders) >= {_dht_id(a), _dht_id(b)}
    assert ca.get_round(a.peer_id).round == 2  # 0 asks for the current round
    assert ca.get_round(a.peer_id, round_no=1) == committed

    status = json_format.MessageToDict(client.get_status(), preserving_proto_field_name=True)
    run = status["run"]
    assert run["open_round"] == "2" and run["rounds_committed"] == "1" and run["committed_hash"] == "h1"
    assert (run["max_rounds"], run["inner_steps"], run["codec"], run["model_preset"]) == ("3", "5", "fp32", "tiny")
    assert run["param_count"] == str(MODEL.param_count) and run["loss"] == 3.5 and run["eval_loss"] == "NaN"
    peers = {p["id"]: p for p in status["peers"]}
    assert peers[a.peer_id]["state"] == "ready" and peers[a.peer_id]["rounds_joined"] == "1"
    assert peers[a.peer_id]["compute_utilization"] == 0.75
    metrics = peers[a.peer_id]["metrics"]  # the heartbeat's metrics, whole
    assert (metrics["dht_peer_id"], metrics["state_hash"]) == (_dht_id(a), MODEL.initial_hash)
    assert metrics["bytes_received"] == "90"  # (int64 as MessageToDict writes it)
    totals = status["totals"]
    assert int(totals["ddp_equivalent_bytes"]) >= 2 * 5 * 1 * 4 * MODEL.param_count
    assert totals["compute_utilization"] == 0.75 and int(totals["bytes_sent"]) >= 200


def test_leave_then_heartbeat_is_told_to_rejoin(members) -> None:
    client, peer = members("brief")
    client.leave(peer.peer_id, "done")
    with pytest.raises(CoordinatorRejected) as info:
        ready(client, peer.peer_id)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "left the run" in info.value.details


def test_a_channel_another_thread_closed_is_unreachable_for_now_then_reconnects(members) -> None:
    """The heartbeat and the round loop share one client; when one of them finds the coordinator down it
    closes the channel the other may be about to use. That call is a retryable 'unreachable' (a raw
    ValueError killed a peer's heartbeat thread in the chaos soak), and the next call reconnects."""
    client, peer = members("shared")
    client._channel.close()  # as another thread does between this thread's _connect and its call
    with pytest.raises(CoordinatorUnreachable, match="connection was closed"):
        client.get_round(peer.peer_id)
    assert client.get_round(peer.peer_id).live_peers >= 0


def test_unreachable_port_is_a_clear_retryable_error() -> None:
    with socket.socket() as bound_not_listening:
        bound_not_listening.bind(("127.0.0.1", 0))
        port = bound_not_listening.getsockname()[1]
        join = JoinString(host="127.0.0.1", port=port, token="t", fingerprint="0" * 64)
        with pytest.raises(CoordinatorUnreachable) as info:
            CoordinatorClient(join, connect_timeout_s=2).get_status()
    assert str(info.value) == (
        f"cannot reach the coordinator at 127.0.0.1:{port} (connection refused); "
        "check the address and that the coordinator is running."
    )


def test_wrong_fingerprint_is_an_impostor(server: CoordinatorServer) -> None:
    join = dataclasses.replace(server.join_string, fingerprint="1" * 64)
    with pytest.raises(CoordinatorRejected) as info:
        CoordinatorClient(join).get_status()
    assert isinstance(info.value, tls.TLSPinError) and isinstance(info.value, CoordinatorError)
    assert "may be an impostor" in str(info.value)


def test_restart_keeps_the_join_string_and_the_open_round(tmp_path: Path) -> None:
    first = CoordinatorServer(run=RUN, state_dir=tmp_path)
    join = first.start()
    try:
        (ca, a), (cb, b) = member_client(join), member_client(join)
        for c, p in ((ca, a), (cb, b)):
            ready(c, p.peer_id)
        for c, p in ((ca, a), (cb, b)):
            c.report_round(p.peer_id, 1, ok=True, state_hash="h1", group=[a.peer_id, b.peer_id])
        assert ca.get_status().run.open_round == 2
        cb.close()
    finally:
        first.stop()

    second = CoordinatorServer(run=RUN, state_dir=tmp_path)
    assert second.start() == join
    try:
        assert ca.get_status().run.open_round == 2
        # still a member, its key and session still good: the coordinator keeps them, and its signing key
        info = ready(ca, a.peer_id, state_round=1, state_hash="h1").round
        assert (info.round, info.last_committed_round) == (2, 1)
        assert ca.signer is not None and second.engine.public_key == a.coordinator_public_key
    finally:
        ca.close()
        second.stop()


def test_serve_prints_the_join_string_and_returns_when_the_run_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_fd, write_fd = os.pipe()  # serve's stdout, so the test can block on its one line
    monkeypatch.setattr(sys, "stdout", os.fdopen(write_fd, "w"))
    lines = os.fdopen(read_fd)
    result: list[int] = []
    run = RunConfig(rounds=RoundConfig(min_peers=1))
    thread = threading.Thread(target=lambda: result.append(serve(run, tmp_path, max_rounds=1)), daemon=True)
    thread.start()
    line = lines.readline()
    assert line.startswith("join: swarm://"), line
    client, peer = member_client(JoinString.parse(line.removeprefix("join: ")))
    with client:
        ready(client, peer.peer_id)
        info = client.report_round(peer.peer_id, 1, ok=True, state_hash="h1", group=[peer.peer_id]).round
        assert info.finished and info.outcome == pb.ROUND_OUTCOME_COMMITTED
        client.leave(peer.peer_id, "run finished")
    thread.join(timeout=20)
    assert result == [0]
    sys.stdout.close()
    assert lines.read() == ""  # exactly one line
    lines.close()


def _dht_id(joined: pb.JoinResponse) -> str:
    return verify_credential(
        joined.credential, joined.coordinator_public_key, run_id=joined.run_id, now=time.time()
    ).dht_peer_id


def test_serve_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from coordinator.server import serve; "
        "from swarm.config import RunConfig; "
        f"sys.exit(serve(RunConfig(), Path({str(tmp_path)!r})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("join: swarm://")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        process.kill()
        process.wait()


def test_a_started_coordinator_keeps_its_token_and_key_owner_only(server: CoordinatorServer) -> None:
    import stat

    from coordinator.store.database import STORE_FILE

    modes = {
        name: stat.S_IMODE((server._state_dir / name).stat().st_mode)
        for name in (JOIN_STRING_FILE, STORE_FILE, tls.KEY_FILE)
    }
    assert modes == dict.fromkeys(modes, 0o600)
    assert stat.S_IMODE(server._state_dir.stat().st_mode) == 0o700


def test_a_status_token_made_while_the_coordinator_runs_watches_over_grpc_but_cannot_join(
    server: CoordinatorServer, capsys: pytest.CaptureFixture
) -> None:
    assert cli_main(["token", "create", "--state-dir", str(server._state_dir), "--role", "status"]) == 0
    watcher = JoinString.parse(capsys.readouterr().out.strip())
    assert (watcher.host, watcher.port, watcher.fingerprint) == (
        server.join_string.host,
        server.join_string.port,
        server.join_string.fingerprint,
    )
    with CoordinatorClient(watcher, request_timeout_s=5) as client:
        assert client.get_status().run.run_id == server.engine.run.run_id
        with pytest.raises(CoordinatorRejected) as info:
            client.join(key=PeerKey.generate(), libp2p=libp2p_identity())
    token_id = watcher.token.split(".")[0]
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details.startswith(f"token {token_id} is a status token: it can watch this run but not join it")
