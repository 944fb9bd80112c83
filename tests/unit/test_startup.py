"""A peer's start is timed step by step, its warm-up never breaks a start, and a restart takes a libp2p
identity made ahead that no process used."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peer.identity import fresh_libp2p_identity, make_spare_libp2p_identity
from peer.startup import StartupClock, seconds_since_launch
from swarm.net.link.libp2p_identity import IDENTITY_FILE, SPARE_FILE, Libp2pIdentity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(30)]


def test_the_summary_names_every_step_and_adds_up_to_the_time_since_launch():
    clock = StartupClock()
    for step in ("join", "trainer", "DHT"):
        clock.mark(step)
    line = clock.summary()
    steps = r"imports [\d.]+s, join [\d.]+s, trainer [\d.]+s, DHT [\d.]+s"
    assert re.fullmatch(rf"[\d.]+s after launch \({steps}; [\d.]+ CPU-s\)", line), line
    launched = seconds_since_launch()
    assert launched is not None and 0 < launched < 3600  # this test process started moments ago
    assert clock.since_launch() >= sum(seconds for _, seconds in clock.steps)


def test_a_restart_takes_the_spare_identity_the_start_before_made_and_never_reuses_one(tmp_path):
    first = fresh_libp2p_identity(tmp_path)  # no spare yet: made now
    make_spare_libp2p_identity(tmp_path)
    spare_id = Libp2pIdentity(tmp_path / SPARE_FILE).peer_id
    second = fresh_libp2p_identity(tmp_path)
    assert second.peer_id == spare_id != first.peer_id
    assert not (tmp_path / SPARE_FILE).exists(), "a spare is taken once"
    assert fresh_libp2p_identity(tmp_path).peer_id not in (first.peer_id, second.peer_id)
    assert [p.name for p in tmp_path.iterdir()] == [IDENTITY_FILE]


def test_a_damaged_spare_is_replaced_by_a_new_key(tmp_path):
    (tmp_path / SPARE_FILE).write_bytes(b"half a key")
    identity = fresh_libp2p_identity(tmp_path)
    assert identity.peer_id == Libp2pIdentity(tmp_path / IDENTITY_FILE).peer_id
    assert not (tmp_path / SPARE_FILE).exists()


def test_an_identity_made_without_hivemind_is_one_hivemind_reads_and_names_the_same(tmp_path):
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    ours = fresh_libp2p_identity(tmp_path)
    stored = crypto_pb2.PrivateKey.FromString((tmp_path / IDENTITY_FILE).read_bytes())
    assert stored.key_type == crypto_pb2.RSA
    assert PeerID.from_identity((tmp_path / IDENTITY_FILE).read_bytes()).to_base58() == ours.peer_id
    # and a key hivemind wrote is read here byte for byte as protobuf encodes it
    theirs = tmp_path / "hivemind.key"
    written = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=RSAPrivateKey().to_bytes())
    theirs.write_bytes(written.SerializeToString())
    assert Libp2pIdentity(theirs).peer_id == PeerID.from_identity(theirs.read_bytes()).to_base58()
    assert (
        ours.public_key
        == crypto_pb2.PublicKey(
            key_type=crypto_pb2.RSA, data=crypto_pb2.PublicKey.FromString(ours.public_key).data
        ).SerializeToString()
    )


def test_a_key_file_that_is_not_a_libp2p_rsa_key_is_refused(tmp_path):
    from swarm.net.link.libp2p_identity import KeyDecodeError, decode_key, encode_key

    assert decode_key(encode_key(0, b"x" * 300)) == (0, b"x" * 300)
    for damaged in (b"", b"\x08", b"\x08\x00\x12\x05abc", b"\x10\x00\x12\x01a", encode_key(0, b"ab") + b"!"):
        with pytest.raises(KeyDecodeError):
            decode_key(damaged)
    (tmp_path / "ed.key").write_bytes(encode_key(1, b"\x00" * 64))
    with pytest.raises(ValueError):
        Libp2pIdentity(tmp_path / "ed.key")


def test_a_peer_signs_its_join_before_hivemind_or_the_dht_modules_are_imported():
    # hivemind (and the scipy it imports) costs a restart ~0.5 s: the peer imports it while it builds its trainer;
    # sympy comes with torch.distributed.fsdp (~2 CPU-s), which only an FSDP peer needs
    code = (
        "import sys, peer.run, peer.daemon, peer.identity, peer.link.heartbeat, peer.state.state_store, swarm.app.cli; "
        "from swarm.net.deferred_imports import _Deferred; "
        "loaded = {m.split('.')[0] for m, mod in list(sys.modules.items()) if not isinstance(mod, _Deferred)}; "
        "print(sorted(loaded & {'hivemind', 'scipy', 'transformers', 'rich', 'sympy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.timeout(120)
def test_hivemind_imports_without_scipy_optimize_until_it_is_used():
    # hivemind imports scipy.optimize (~0.3 s of a restart) for a function Swarm never calls; the stand-in
    # swarm.net puts in its place survives torch's scan of sys.modules and loads the real module on first use
    code = (
        "import sys, swarm.net, hivemind; print('scipy.optimize._optimize' in sys.modules); "
        "from hivemind.averaging.load_balancing import load_balance_peers; "
        "print(load_balance_peers(10, [1.0, 2.0, None]), 'scipy.optimize._optimize' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["False", "(0, 7, 3) True"], out.stdout


@pytest.mark.timeout(120)
def test_a_trainer_builds_trains_and_checkpoints_without_importing_dynamo():
    # torch.optim imports torch._dynamo (~1.3 CPU-s of every restart) unless the trainer keeps it away
    code = (
        "import sys, torch; from swarm.config import RunConfig; from swarm.train.trainer import LocalTrainer; "
        "t = LocalTrainer(RunConfig(), peer_index=0); t.train(2); "
        "t.load_optimizer_state_dict(t.optimizer_state_dict()); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", "the trainer imported torch._dynamo"
