"""A peer's start is timed step by step, its warm-up never breaks a start, and a restart takes a libp2p
identity made ahead that no process used."""

from __future__ import annotations

import re
import sys

import pytest

from peer.identity import fresh_libp2p_identity, make_spare_libp2p_identity
from peer.startup import StartupClock, seconds_since_launch, warm_imports
from swarm.net.libp2p_identity import IDENTITY_FILE, SPARE_FILE, Libp2pIdentity

pytestmark = pytest.mark.timeout(30)


def test_the_summary_names_every_step_and_adds_up_to_the_time_since_launch():
    clock = StartupClock()
    for step in ("join", "trainer", "DHT"):
        clock.mark(step)
    line = clock.summary()
    assert re.fullmatch(r"[\d.]+s after launch \(imports [\d.]+s, join [\d.]+s, trainer [\d.]+s, DHT [\d.]+s\)", line), line
    launched = seconds_since_launch()
    assert launched is not None and 0 < launched < 3600  # this test process started moments ago
    assert clock.since_launch() >= sum(seconds for _, seconds in clock.steps)


def test_a_module_that_cannot_be_imported_only_costs_the_warm_up():
    thread = warm_imports(("json", "no_such_module_for_swarm"))
    thread.join(timeout=10)
    assert not thread.is_alive() and "json" in sys.modules


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
