"""Bounds on what a request may carry, checked before the engine sees it.

Every string and list field of every request has a size cap, identifiers and hashes a character set,
numbers a range, and DHT addresses must parse as multiaddrs that end in ``/p2p/<id>``.  A request that
breaks one gets ``BadRequest`` with one sentence and one warning line in the log, at most one per second
per method (with a count of those suppressed meanwhile).  Fields this table does not name (a newer
protocol's) still get generic caps.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Optional

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from coordinator.api.errors import BadRequest
from swarm.core.trust import commit_rule
from swarm.core.trust.round_vote import MAX_SENT_VOTES

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 256 * 1024  # the server's receive limit: no honest request comes near it
MAX_LABEL_BYTES = 256  # names, sites, devices, versions, reasons
MAX_ERROR_BYTES = 1024
MAX_ID_CHARS = 128  # peer ids, DHT peer ids, tokens
MAX_HASH_CHARS = 128  # state hashes and model fingerprints (hex in practice)
MAX_GROUP = commit_rule.NAMED_GROUP_MAX  # peer ids in a reported group (a larger one: its digest and size)
# A RoundInfo about a round of more participants names only the requester's own entries (and the controller gives
# such a round equal slices: its members could not all see each other's shares).
LISTED_PARTICIPANTS = 256
MAX_DHT_MADDRS = 8  # kept per peer (membership keeps the first ones) and dialled at a restart
MAX_DHT_MADDRS_SENT = 64  # a multi-homed peer may list more than it keeps; beyond this it is refused
MAX_MADDR_CHARS = 256
MAX_COUNT = 10**15  # bytes, tokens, steps, samples, parameters
MAX_ROUND = 10**9
MAX_SECONDS = 10**10  # durations and rates
MAX_PAGE_TOKEN_CHARS = 32
MAX_OTHER_STRING_BYTES = 1024  # fields not named below
MAX_OTHER_BYTES = 4096
MAX_OTHER_LIST = 64
WARN_INTERVAL_S = 1.0

_ID = re.compile(r"[A-Za-z0-9_\-.~]*")
_HASH = re.compile(r"[0-9A-Za-z]*")
_DIGITS = re.compile(r"[0-9]*")

_LABELS = {"name", "site", "device", "swarm_version", "reason"}
_IDS = {"peer_id", "previous_peer_id", "dht_peer_id", "group", "token"}
_HASHES = {"state_hash", "model_fingerprint"}
_COUNTS = {"param_count", "inner_steps", "tokens", "bytes_sent", "bytes_received", "samples", "page_size"}
_ROUNDS = {"round", "state_round", "eval_round"}  # may be -1 ("none") or, for the engine to refuse, below
_LINKS = {"upload_mbit_s", "download_mbit_s", "rtt_ms"}  # NaN until measured, else in [0, MAX_SECONDS]
_DURATIONS = {"step_time_s", "tokens_per_s", "inner_time_s", "wall_time_s", "exchange_time_s"} | _LINKS
_MAYBE_NAN = {"loss", "eval_loss"} | _LINKS  # NaN: not measured yet
_LIST_CAPS = {
    "dht_maddrs": MAX_DHT_MADDRS_SENT,
    "group": MAX_GROUP,
    "group_votes": MAX_SENT_VOTES,
}  # else MAX_OTHER_LIST


@dataclass(frozen=True)
class Undecodable:
    """What a request that is not valid protobuf decodes to, so the servicer refuses it in one sentence."""

    type_name: str


def tolerant(deserialize: Callable[[bytes], Message]) -> Callable[[bytes], Any]:
    """``deserialize``, returning ``Undecodable`` instead of raising (gRPC would log a traceback)."""
    owner = getattr(deserialize, "__self__", None)
    type_name = owner.DESCRIPTOR.full_name if owner is not None and hasattr(owner, "DESCRIPTOR") else "request"

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, ValueError, TypeError, RecursionError):
            return Undecodable(type_name)

    return parse


def check_request(method_name: str, request: Any) -> None:
    """Raise BadRequest (one sentence, one rate-limited warning line) when ``request`` breaks a bound."""
    problem = _problem(request)
    if problem is None:
        return
    _WARNINGS.warn(method_name, problem)
    raise BadRequest(f"{method_name}: {problem}; send a well-formed request from a current swarm version.")


def parse_dht_maddr(text: str) -> Optional[str]:
    """``text`` when it is a multiaddr that ends in ``/p2p/<peer id>`` and fits the caps, else None."""
    from hivemind.utils.multiaddr import Multiaddr  # heavy: only where an address is to be parsed

    if not isinstance(text, str) or not text or len(text) > MAX_MADDR_CHARS or not text.isascii():
        return None
    try:
        protocols = Multiaddr(text).protocols()
    except Exception:  # multiaddr raises several kinds for several kinds of garbage
        return None
    return text if len(protocols) >= 2 and protocols[-1].name == "p2p" else None


def _problem(request: Any) -> Optional[str]:
    if isinstance(request, Undecodable):
        return f"the request is not a valid {request.type_name} message"
    if not isinstance(request, Message):
        return "the request is not a protobuf message"
    return _message_problem(request, prefix="")


def _message_problem(message: Message, prefix: str) -> Optional[str]:
    for field, value in message.ListFields():
        where = prefix + field.name
        if field.message_type is not None:
            items = value if field.is_repeated else [value]
            cap = _LIST_CAPS.get(field.name, MAX_OTHER_LIST)
            if len(items) > cap:
                return f"{where} has {len(items)} entries, more than {cap}"
            for item in items:
                problem = _message_problem(item, where + ".")
                if problem:
                    return problem
            continue
        problem = _field_problem(field, value, where)
        if problem:
            return problem
    return None


def _field_problem(field: FieldDescriptor, value: Any, where: str) -> Optional[str]:
    name = field.name
    if field.is_repeated:
        cap = _LIST_CAPS.get(name, MAX_OTHER_LIST)
        if len(value) > cap:
            return f"{where} has {len(value)} entries, more than {cap}"
        if name == "dht_maddrs":
            bad = next((m for m in value if parse_dht_maddr(m) is None), None)
            return None if bad is None else f"{where} holds {_shown(bad)}, not a multiaddr ending in /p2p/<peer id>"
        for item in value:
            problem = _scalar_problem(field, item, where)
            if problem:
                return problem
        return None
    return _scalar_problem(field, value, where)


def _scalar_problem(field: FieldDescriptor, value: Any, where: str) -> Optional[str]:
    name = field.name
    if isinstance(value, str):
        return _text_problem(name, value, where)
    if isinstance(value, bytes):
        return f"{where} is {len(value)} bytes, more than {MAX_OTHER_BYTES}" if len(value) > MAX_OTHER_BYTES else None
    if isinstance(value, bool):
        return None
    if field.enum_type is not None:
        known = field.enum_type.values_by_number
        return None if value in known else f"{where} is {value}, not a known {field.enum_type.name}"
    if isinstance(value, int):
        low, high = (
            (-1, MAX_ROUND) if name in _ROUNDS else (0, MAX_COUNT) if name in _COUNTS else (-MAX_COUNT, MAX_COUNT)
        )
        if name == "round":
            low = -MAX_ROUND  # the engine says why a negative round is wrong
        return None if low <= value <= high else f"{where} is {value}, outside [{low}, {high}]"
    if isinstance(value, float):
        if math.isnan(value):
            return None if name in _MAYBE_NAN or name not in _DURATIONS else f"{where} is NaN"
        if math.isinf(value):
            return f"{where} is {value}, not a finite number"
        if name in _DURATIONS and not 0 <= value <= MAX_SECONDS:
            return f"{where} is {value}, outside [0, {MAX_SECONDS}]"
    return None


def _text_problem(name: str, value: str, where: str) -> Optional[str]:
    size = len(value.encode("utf-8", "surrogatepass"))
    if name in _IDS or name in _HASHES or name == "page_token":
        pattern, cap, what = (
            (_ID, MAX_ID_CHARS, "letters, digits and _-.~")
            if name in _IDS
            else (_DIGITS, MAX_PAGE_TOKEN_CHARS, "digits")
            if name == "page_token"
            else (_HASH, MAX_HASH_CHARS, "letters and digits")
        )
        if size > cap:
            return f"{where} is {size} characters long, more than {cap}"
        return None if pattern.fullmatch(value) else f"{where} may only hold {what}"
    cap = MAX_ERROR_BYTES if name == "error" else MAX_LABEL_BYTES if name in _LABELS else MAX_OTHER_STRING_BYTES
    if size > cap:
        return f"{where} is {size} bytes, more than {cap}"
    allowed = "\n\t" if name == "error" else ""
    if any(unicodedata.category(c) in ("Cc", "Cs") and c not in allowed for c in value):
        return f"{where} contains control characters"
    return None


def _shown(text: str) -> str:
    return repr(text[:40] + ("…" if len(text) > 40 else ""))


class WarningLimiter:
    """One warning line per ``interval_s`` per method; the next line counts the ones it suppressed."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # guarded by _lock
        self._suppressed: dict[str, int] = {}

    def warn(self, method_name: str, problem: str) -> None:
        with self._lock:
            now = self._clock()
            last = self._last.get(method_name)
            if last is not None and now - last < self._interval_s:
                self._suppressed[method_name] = self._suppressed.get(method_name, 0) + 1
                return
            self._last[method_name] = now
            suppressed = self._suppressed.pop(method_name, 0)
        logger.warning(
            "%s: refused a malformed request: %s%s",
            method_name,
            problem,
            f" (and {suppressed} more since the last such line)" if suppressed else "",
        )


_WARNINGS = WarningLimiter()
