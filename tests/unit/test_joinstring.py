"""The join string round-trips, and every malformed variant says what is wrong and what to do."""

import pytest

from swarm.control.joinstring import JoinString, JoinStringError

pytestmark = pytest.mark.timeout(10)

FP = "ab" * 32
GOOD = f"swarm://coord.example.org:7000?token=tok-EN_123&fp={FP}"


def test_round_trip() -> None:
    join = JoinString.parse(GOOD)
    assert join == JoinString(host="coord.example.org", port=7000, token="tok-EN_123", fingerprint=FP)
    assert str(join) == GOOD
    assert JoinString.parse(str(join)) == join


def test_ipv6_host_in_brackets() -> None:
    join = JoinString(host="::1", port=7000, token="t", fingerprint=FP)
    assert str(join).startswith("swarm://[::1]:7000?")
    assert JoinString.parse(str(join)) == join
    assert join.address == "[::1]:7000"


def test_pasted_with_quotes_and_whitespace_and_uppercase_fingerprint() -> None:
    join = JoinString.parse(f"  '{GOOD.replace(FP, FP.upper())}'\n")
    assert join.fingerprint == FP


@pytest.mark.parametrize(
    "text, what",
    [
        ("", "empty"),
        ("http://host:7000?token=t&fp=" + FP, "starts with"),
        ("swarm://host?token=t&fp=" + FP, "no port"),
        ("swarm://host:0?token=t&fp=" + FP, "port"),
        ("swarm://host:70000?token=t&fp=" + FP, "port"),
        ("swarm://host:http?token=t&fp=" + FP, "port"),
        ("swarm://:7000?token=t&fp=" + FP, "no host"),
        ("swarm://::1:7000?token=t&fp=" + FP, "brackets"),
        ("swarm://[::1:7000?token=t&fp=" + FP, "closing"),
        ("swarm://ho st:7000?token=t&fp=" + FP, "host"),
        ("swarm://user@host:7000?token=t&fp=" + FP, "@"),
        ("swarm://host:7000/path?token=t&fp=" + FP, "unexpected text"),
        ("swarm://host:7000?fp=" + FP, "no token"),
        ("swarm://host:7000?token=&fp=" + FP, "no token"),
        ("swarm://host:7000?token=a b&fp=" + FP, "invalid characters"),
        ("swarm://host:7000?token=t", "no certificate fingerprint"),
        ("swarm://host:7000?token=t&fp=" + FP[:-1], "64 hex digits"),
        ("swarm://host:7000?token=t&fp=" + "zz" * 32, "64 hex digits"),
        ("swarm://host:7000?token=t&fp=" + FP + "&extra=1", "unknown field"),
        ("swarm://host:7000?token=t&token=u&fp=" + FP, "twice"),
        ("swarm://host:7000?token", "malformed"),
    ],
)
def test_malformed_variants_say_what_is_wrong(text: str, what: str) -> None:
    with pytest.raises(JoinStringError) as info:
        JoinString.parse(text)
    message = str(info.value)
    assert what in message
    assert "copy the join string exactly as `swarm coordinator` printed it" in message
    assert message.count(";") == 1 and message.endswith(".")  # one sentence: what is wrong; what to do


def test_error_is_a_value_error() -> None:
    assert issubclass(JoinStringError, ValueError)


FP = "ab" * 32
HOSTILE = [
    f"swarm://h:²?token=t&fp={FP}",
    f"swarm://h:{'9' * 4300}?token=t&fp={FP}",
    f"swarm://{'a' * 64}.example:1?token=t&fp={FP}",
    f"swarm://{'a.' * 200}b:1?token=t&fp={FP}",
    f"swarm://hôst:1?token=t&fp={FP}",
    f"swarm://h:1?token=t\x00&fp={FP}",
    f"swarm://h:1?token=%00&fp={FP}",
    f"swarm://h:1?token=%C3%A9&fp={FP}",
    f"swarm://h:1?token={'t' * 300}&fp={FP}",
    f"swarm://h:1?token=t&fp={FP}\x1b[2J",
    "swarm://" + "x" * 10_000_000,
    f"swarm://[::1:1?token=t&fp={FP}",
    f"swarm://h:٣?token=t&fp={FP}",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_join_strings_get_one_sentence(text: str) -> None:
    with pytest.raises(JoinStringError) as info:
        JoinString.parse(text)
    message = str(info.value)
    assert message.endswith(".") and "\n" not in message and len(message) < 300


def test_any_text_parses_or_gets_one_sentence() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(
        [
            "swarm://",
            "h",
            ":",
            "1",
            "?",
            "token=",
            "t",
            "&",
            "fp=",
            FP,
            "[",
            "]",
            "%",
            "²",
            "é",
            "\x00",
            "@",
            "/",
            "#",
            "9" * 50,
        ]
    )

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.one_of(st.text(max_size=200), st.lists(pieces, max_size=16).map("".join)))
    def one(text: str) -> None:
        try:
            JoinString.parse(text)
        except JoinStringError as e:
            assert str(e).endswith(".") and len(str(e)) < 300

    one()
