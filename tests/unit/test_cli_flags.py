"""Every bad flag of the `swarm` command gets one sentence and exit 2, before anything starts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from swarm.app.cli import main

pytestmark = pytest.mark.timeout(30)

JOIN = "swarm://127.0.0.1:1?token=t&fp=" + "ab" * 32


def _refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["coordinator", "--port", "-1"], "--port must be from 0 to 65535, got -1."),
        (["coordinator", "--port", "70000"], "--port must be from 0 to 65535, got 70000."),
        (["coordinator", "--dht-port", "99999"], "--dht-port must be from 0 to 65535"),
        (["coordinator", "--lease-s", "inf"], "--lease-s must be from"),
        (["coordinator", "--lease-s", "nan"], "--lease-s must be from"),
        (["coordinator", "--max-rounds", "0"], "--max-rounds must be from 1"),
        (["coordinator", "--inner-steps", "9223372036854775807"], "--inner-steps must be from 1"),
        (["coordinator", "--host", "a\nb"], "--host must be at most 256 bytes of printable text."),
        (["peer", "--join", JOIN, "--p2p-port", "65536"], "--p2p-port must be from 0 to 65535"),
        (["peer", "--join", JOIN, "--threads", "0"], "--threads must be from 1"),
        (["peer", "--join", JOIN, "--name", "n" * 300], "--name must be at most 256 bytes"),
        (["peer", "--join", JOIN, "--join-timeout-s", "-5"], "--join-timeout-s must be from"),
        (["peer", "--join", JOIN, "--max-restarts", "-1"], "--max-restarts must be from 0"),
        (
            ["peer", "--join", JOIN, "--tcp-congestion", "no-such-control"],
            "--tcp-congestion no-such-control: not one of"
            if sys.platform.startswith("linux")
            else "--tcp-congestion no-such-control: this system does not let",
        ),
        (["status", JOIN, "--interval", "0"], "--interval must be from"),
        (["demo", "--peers", "100000"], "--peers must be from 1 to 64"),
        (["coordinator", "--port", "abc"], "invalid int value: 'abc'"),
    ],
)
def test_a_bad_flag_gets_one_sentence_and_exit_2(argv: list[str], words: str, capsys) -> None:
    assert words in _refused(argv, capsys)


def test_a_state_dir_that_is_a_file_is_named(tmp_path: Path, capsys) -> None:
    file = tmp_path / "not-a-dir"
    file.write_text("x")
    for command in (["coordinator"], ["peer", "--join", JOIN], ["demo"]):
        assert "is a file; give a directory" in _refused([*command, "--state-dir", str(file)], capsys)


def test_a_bad_join_string_or_config_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["status", "swarm://h:²?token=t&fp=" + "ab" * 32]) == 2
    assert main(["coordinator", "--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "non-ASCII" in err and "is a directory" in err


def test_a_congestion_control_this_process_may_not_pick_is_named_with_the_fix(monkeypatch, capsys) -> None:
    """Linux lets an unprivileged process pick only the controls in net.ipv4.tcp_allowed_congestion_control
    (EPERM for the others, as for cubic on this machine when not root)."""
    import errno

    import swarm.net.bulk.tcp_congestion as congestion

    monkeypatch.setattr(congestion, "try_congestion", lambda name: PermissionError(errno.EPERM, "not permitted"))
    assert _refused(["peer", "--join", JOIN, "--tcp-congestion", "cubic"], capsys) == (
        "swarm: error: --tcp-congestion cubic: this system has it but lets this process use only the controls in "
        "net.ipv4.tcp_allowed_congestion_control; add cubic there (as root), run with CAP_NET_ADMIN, or give "
        "'system'."
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_CONGESTION is Linux's")
def test_a_connection_that_cannot_pick_its_control_keeps_the_default_and_says_so_once(caplog) -> None:
    import socket

    import swarm.net.bulk.tcp_congestion as congestion
    from swarm.net.bulk.tcp_congestion import set_congestion

    congestion._warned.discard("no-such-control")  # once per process: an earlier test may have warned
    default = [socket.socket() for _ in range(2)]
    try:
        before = default[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        for sock in default:
            set_congestion(sock, "no-such-control")
        assert default[1].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16) == before
    finally:
        for sock in default:
            sock.close()
    # levelno: hivemind, imported by other tests of the same process, renames the level "WARN"
    assert [r.levelno for r in caplog.records if "keep the system's TCP congestion" in r.message] == [logging.WARNING]
