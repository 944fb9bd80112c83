"""Join tokens end to end: `swarm token` (its main, in process) against a coordinator running on the same
state dir; wrong, expired, used-up, revoked and status tokens; a site-pinned token; live identities per token."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from coordinator.api import tokens
from coordinator.server import JOIN_STRING_FILE
from coordinator.store.database import Store
from coordinator.store.records import to_json
from swarm.app.cli import main
from swarm.config import RoundConfig, RunConfig
from swarm.control import tls
from swarm.control.client import CoordinatorRejected
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import FakeClient, FakeCoordinator, libp2p_identity

pytestmark = pytest.mark.timeout(60)

RUN = RunConfig(rounds=RoundConfig(min_peers=2))


@pytest.fixture(scope="module")
def libp2p():
    return libp2p_identity()


@pytest.fixture
def running(tmp_path):
    """A coordinator on tmp_path (engine and servicer, no network), with the files `swarm token` reads."""
    coordinator = FakeCoordinator(RUN, Store.in_dir(tmp_path))
    cert, _ = tls.ensure_certificate(tmp_path)
    join = JoinString(
        host="127.0.0.1", port=7000, token=coordinator.engine.run.token, fingerprint=tls.fingerprint(cert)
    )
    (tmp_path / JOIN_STRING_FILE).write_text(f"{join}\n")
    return coordinator, tmp_path


def swarm_token(capsys, *args: str) -> str:
    assert main(["token", *args]) == 0
    return capsys.readouterr().out.strip()


def join_with(coordinator, token: str, libp2p, **fields) -> tuple[FakeClient, pb.JoinResponse]:
    client = FakeClient(coordinator, token=token)
    return client, client.join(key=PeerKey.generate(), libp2p=libp2p, **fields)


def refusal(call) -> CoordinatorRejected:
    with pytest.raises(CoordinatorRejected) as info:
        call()
    return info.value


def test_a_created_token_joins_once_pins_its_site_and_revoking_it_ends_its_peers(running, libp2p, capsys) -> None:
    coordinator, state_dir = running
    text = swarm_token(capsys, "create", "--state-dir", str(state_dir), "--max-uses", "1", "--site", "lab-b")
    join = JoinString.parse(text)
    assert join.fingerprint == JoinString.parse((state_dir / JOIN_STRING_FILE).read_text().strip()).fingerprint
    token_id = join.token.split(".")[0]
    client, peer = join_with(coordinator, join.token, libp2p, site="claimed-elsewhere")
    assert {p.id: p.site for p in coordinator.status().peers} == {peer.peer_id: "lab-b"}
    used_up = refusal(lambda: join_with(coordinator, join.token, libp2p))
    assert used_up.code == grpc.StatusCode.PERMISSION_DENIED and f"token {token_id} was already used 1 times" in str(
        used_up
    )
    assert join.token not in (state_dir / "coordinator.sqlite3").read_bytes().decode(errors="replace")

    listed = swarm_token(capsys, "list", "--state-dir", str(state_dir))
    assert token_id in listed and "default" in listed and "uses 1/1" in listed
    swarm_token(capsys, "revoke", "--state-dir", str(state_dir), token_id)  # the coordinator keeps running
    hb = pb.HeartbeatRequest(peer_id=peer.peer_id, metrics=pb.PeerMetrics(state=pb.PEER_STATE_JOINING))
    gone = refusal(lambda: client.heartbeat(hb))
    assert gone.code == grpc.StatusCode.FAILED_PRECONDITION and f"join token {token_id} was revoked" in str(gone)
    assert {p.id: p.state for p in coordinator.status().peers} == {peer.peer_id: "evicted"}
    again = refusal(lambda: client.heartbeat(hb))  # every later call: restarting with that token will not help
    assert "was revoked" in str(again) and "ask the operator for a new join string" in str(again)
    assert "revoked" in swarm_token(capsys, "list", "--state-dir", str(state_dir))


def test_a_status_token_watches_but_cannot_join(running, libp2p, capsys) -> None:
    coordinator, state_dir = running
    token = JoinString.parse(swarm_token(capsys, "create", "--state-dir", str(state_dir), "--role", "status")).token
    token_id = token.split(".")[0]
    refused = refusal(lambda: join_with(coordinator, token, libp2p))
    assert refused.code == grpc.StatusCode.PERMISSION_DENIED
    assert str(refused) == (
        f"token {token_id} is a status token: it can watch this run but not join it; "
        "ask the operator for a peer join string."
    )
    assert coordinator.engine.status(token).run.run_id == coordinator.engine.run.run_id
    assert not coordinator.status().peers


def test_wrong_unknown_and_expired_tokens_are_refused(running, libp2p) -> None:
    coordinator, state_dir = running
    record, text = tokens.new_token(now=time.time() - 7200, expires_in_s=3600)
    coordinator.engine._store.put_token(record)
    expired = refusal(lambda: join_with(coordinator, text, libp2p))
    assert expired.code == grpc.StatusCode.PERMISSION_DENIED and f"token {record.id} expired" in str(expired)
    for wrong in (record.id + ".not-its-secret", "t-00000000.guess", "guessed-default-secret"):
        error = refusal(lambda: join_with(coordinator, wrong, libp2p))
        assert error.code == grpc.StatusCode.UNAUTHENTICATED and "ask the operator for the current join string" in str(
            error
        )
    join_with(coordinator, coordinator.engine.run.token, libp2p)  # the first join string still works


def test_token_commands_say_what_is_wrong_in_one_sentence(running, tmp_path, capsys) -> None:
    _, state_dir = running
    assert main(["token", "revoke", "--state-dir", str(state_dir), "t-nothere"]) == 2
    assert main(["token", "create", "--state-dir", str(state_dir), "--expires", "soon"]) == 2
    assert main(["token", "list", "--state-dir", str(tmp_path / "elsewhere")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        "swarm token: this run has no token 't-nothere'; `swarm token list` shows its tokens.",
        "swarm token: --expires 'soon' is not a duration; write it like 90s, 30m, 24h or 7d.",
        f"swarm token: {tmp_path / 'elsewhere'} holds no coordinator state; give the --state-dir the coordinator "
        "was started with.",
    ]


def test_a_created_token_holds_one_live_identity_and_the_same_key_rejoins(running, libp2p, capsys) -> None:
    coordinator, state_dir = running
    token = JoinString.parse(swarm_token(capsys, "create", "--state-dir", str(state_dir))).token
    token_id = token.split(".")[0]
    first_key = PeerKey.generate()
    joined = FakeClient(coordinator, token=token).join(key=first_key, libp2p=libp2p)
    second = refusal(lambda: join_with(coordinator, token, libp2p))
    assert second.code == grpc.StatusCode.PERMISSION_DENIED
    assert str(second) == (
        f"token {token_id} holds at most 1 identity at once and 1 is live; stop one of its peers (or wait for one "
        "to leave), or ask the operator for a join string whose token holds more (swarm token create "
        "--max-identities N)."
    )
    assert f"{token_id:<12} peer" in (listed := swarm_token(capsys, "list", "--state-dir", str(state_dir)))
    assert "identities 1/1" in listed

    again = FakeClient(coordinator, token=token)
    assert again.join(key=first_key, libp2p=libp2p).peer_id == joined.peer_id  # restarted: the same identity
    again.leave(joined.peer_id, "done")
    join_with(coordinator, token, libp2p)  # it left: its place is free
    assert "identities 1/1" in swarm_token(capsys, "list", "--state-dir", str(state_dir))


def test_max_identities_sets_a_tokens_limit_and_the_first_join_string_holds_any_number(running, libp2p, capsys) -> None:
    coordinator, state_dir = running
    token = JoinString.parse(
        swarm_token(capsys, "create", "--state-dir", str(state_dir), "--max-identities", "2")
    ).token
    for _ in range(2):
        join_with(coordinator, token, libp2p)
    assert "at most 2 identities at once and 2 are live" in str(refusal(lambda: join_with(coordinator, token, libp2p)))
    for _ in range(3):
        join_with(coordinator, coordinator.engine.run.token, libp2p)
    listed = swarm_token(capsys, "list", "--state-dir", str(state_dir)).splitlines()
    assert [line.split()[6] for line in listed if line.startswith("default")] == ["3/any"]
    assert main(["token", "create", "--state-dir", str(state_dir), "--max-identities", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "swarm token: --max-identities 0 is not from 1 to 100000; give how many peers may hold the token at once "
        "(1 per machine you hand it to)."
    )


def test_a_token_stored_without_an_identity_limit_holds_any_number(running, libp2p) -> None:
    """A store written by a release without the limit keeps admitting as it did."""
    coordinator, _ = running
    record, text = tokens.new_token(now=time.time())
    stored = json.loads(to_json(record))
    del stored["max_identities"]
    coordinator.engine._store._write("INSERT INTO tokens (id, data) VALUES (?, ?)", (record.id, json.dumps(stored)))
    assert coordinator.engine._store.get_token(record.id).max_identities is None
    for _ in range(3):
        join_with(coordinator, text, libp2p)
