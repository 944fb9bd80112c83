"""The join string: everything a peer needs to find and trust a run's coordinator.

``swarm://HOST:PORT?token=TOKEN&fp=SHA256HEX`` carries the coordinator's address, the join token
and the SHA-256 fingerprint of the coordinator's TLS certificate, which the peer pins.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

SCHEME = "swarm"
_COPY_HINT = "copy the join string exactly as `swarm coordinator` printed it"
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_HOST = re.compile(r"[A-Za-z0-9.\-_:%]+")
_TOKEN = re.compile(r"[A-Za-z0-9_\-.~]+")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_CHARS = 1024  # a real one is ~150
MAX_TOKEN_CHARS = 256
MAX_HOST_CHARS = 253  # DNS's limit, with labels of at most 63


class JoinStringError(ValueError):
    """A malformed join string; the message says what is wrong and what to do."""


@dataclass(frozen=True)
class JoinString:
    host: str
    port: int
    token: str
    fingerprint: str  # sha256 hex of the coordinator's DER certificate, lowercase

    @property
    def address(self) -> str:
        """HOST:PORT as gRPC and people write it (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        query = urllib.parse.urlencode({"token": self.token, "fp": self.fingerprint})
        return f"{SCHEME}://{self.address}?{query}"

    @classmethod
    def parse(cls, text: str) -> "JoinString":
        if not isinstance(text, str):
            raise JoinStringError(f"a join string must be text, got {type(text).__name__}; {_COPY_HINT}.")
        if len(text) > MAX_CHARS:
            raise JoinStringError(
                f"the join string is {len(text)} characters long, more than {MAX_CHARS}; {_COPY_HINT}."
            )
        text = text.strip()
        if not text.isascii() or not text.isprintable():
            raise JoinStringError(f"the join string contains non-ASCII or control characters; {_COPY_HINT}.")
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1].strip()  # quotes pasted along with the string
        if not text:
            raise JoinStringError(f"the join string is empty; {_COPY_HINT}.")
        prefix = f"{SCHEME}://"
        if not text.startswith(prefix):
            raise JoinStringError(f"a join string starts with {prefix!r}, got {text[:16]!r}; {_COPY_HINT}.")
        location, _, query_text = text[len(prefix) :].partition("?")
        netloc, _, path = location.partition("/")
        if path or "#" in query_text:
            raise JoinStringError(f"the join string has unexpected text after the address; {_COPY_HINT}.")
        host, port = _host_and_port(netloc)
        query = _query(query_text)
        token = query.get("token", "")
        fingerprint = query.get("fp", "").lower()
        if not token:
            raise JoinStringError(f"the join string has no token (token=...); {_COPY_HINT}.")
        if not _TOKEN.fullmatch(token) or len(token) > MAX_TOKEN_CHARS:
            raise JoinStringError(f"the join string's token contains invalid characters; {_COPY_HINT}.")
        if not fingerprint:
            raise JoinStringError(f"the join string has no certificate fingerprint (fp=...); {_COPY_HINT}.")
        if not _FINGERPRINT.fullmatch(fingerprint):
            raise JoinStringError(
                f"the join string's fingerprint must be 64 hex digits, got {len(fingerprint)} characters; {_COPY_HINT}."
            )
        return cls(host=host, port=port, token=token, fingerprint=fingerprint)


def _host_and_port(netloc: str) -> tuple[str, int]:
    if "@" in netloc:
        raise JoinStringError(f"the join string's address must not contain '@'; {_COPY_HINT}.")
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            raise JoinStringError(f"the join string's IPv6 address lacks its closing ']'; {_COPY_HINT}.")
        host, rest = netloc[1:end], netloc[end + 1 :]
        if not rest.startswith(":"):
            raise JoinStringError(f"the join string's address has no port (HOST:PORT); {_COPY_HINT}.")
        port_text = rest[1:]
    else:
        host, sep, port_text = netloc.rpartition(":")
        if not sep:
            raise JoinStringError(f"the join string's address has no port (HOST:PORT); {_COPY_HINT}.")
        if ":" in host:
            raise JoinStringError(f"the join string's IPv6 address must be in brackets ([::1]:PORT); {_COPY_HINT}.")
    if not host:
        raise JoinStringError(f"the join string has no host before the port; {_COPY_HINT}.")
    if not _HOST.fullmatch(host) or len(host) > MAX_HOST_CHARS or any(len(label) > 63 for label in host.split(".")):
        raise JoinStringError(f"the join string's host {host[:64]!r} is not a valid name or address; {_COPY_HINT}.")
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise JoinStringError(
            f"the join string's port must be a number from 1 to 65535, got {port_text[:16]!r}; {_COPY_HINT}."
        )
    return host, int(port_text)


def _query(query: str) -> dict[str, str]:
    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise JoinStringError(f"the join string's query (after '?') is malformed; {_COPY_HINT}.") from None
    result: dict[str, str] = {}
    for key, value in pairs:
        if key not in ("token", "fp"):
            raise JoinStringError(f"the join string has an unknown field {key!r}; {_COPY_HINT}.")
        if key in result:
            raise JoinStringError(f"the join string names {key!r} twice; {_COPY_HINT}.")
        result[key] = value
    return result
