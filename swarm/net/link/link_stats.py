"""Measured links: what one exchange timed on its sends and receives (``LinkTimings``), and this peer's running
estimates of its upload and download throughput and its round-trip time to groupmates (``LinkEstimates``).

Throughput is payload over the seconds the transfers took, never over the exchange's wall time (which holds
codec work and waiting for slow groupmates). Transfers too small or too short to time are left out, so a
tiny slice cannot report an absurd rate; concurrent transfers count their overlapping seconds once, so a
peer that sends to several groupmates at once reports its link's rate, not the sum of parallel streams'.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

EWMA_ALPHA = 0.3  # weight of the newest exchange: smooths the noise of a link that stays what it is
STEP_FACTOR = 3.0  # a sample this many times above or below the estimate is a changed link: taken as it is
MIN_TRANSFER_BYTES = 64 * 1024  # smaller transfers time latency and stream setup, not throughput
MIN_TRANSFER_S = 0.001  # shorter ones are below the clock's useful resolution
MAX_GROUPMATES = 1024  # links kept; the least recently measured goes first


@dataclass(frozen=True)
class Transfer:
    """Bytes that went to (upload) or came from (download) one groupmate between two ``time.perf_counter``
    readings."""

    peer: str  # the groupmate's peer id (in the exchange, first its libp2p id)
    bytes: int
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def timed(self) -> bool:
        """Whether this transfer is long enough to say something about throughput."""
        return self.bytes >= MIN_TRANSFER_BYTES and self.seconds >= MIN_TRANSFER_S


@dataclass(frozen=True)
class LinkTimings:
    """What one exchange measured; keyed by groupmates' peer ids."""

    uploads: list[Transfer] = field(default_factory=list)
    downloads: list[Transfer] = field(default_factory=list)
    rtt_s: dict[str, float] = field(default_factory=dict)  # a tiny request and its reply, per (earlier) groupmate

    @classmethod
    def named(
        cls, uploads: list[Transfer], downloads: list[Transfer], *, rtt_s: dict[str, float], group: Sequence[Any]
    ) -> "LinkTimings":
        """Transfers recorded by libp2p id, renamed to the group's peer ids; those with anyone else dropped."""
        names = {m.dht_peer_id: m.peer_id for m in group}
        return cls(
            uploads=[Transfer(names[t.peer], t.bytes, t.started, t.ended) for t in uploads if t.peer in names],
            downloads=[Transfer(names[t.peer], t.bytes, t.started, t.ended) for t in downloads if t.peer in names],
            rtt_s=rtt_s,
        )


def throughput_mbit_s(transfers: Iterable[Transfer]) -> Optional[float]:
    """Megabits per second over the timed transfers, their overlapping seconds counted once; None when none
    is long enough to time."""
    timed = sorted((t for t in transfers if t.timed()), key=lambda t: t.started)
    if not timed:
        return None
    busy_s, end = 0.0, -math.inf
    for t in timed:
        busy_s += max(0.0, t.ended - max(t.started, end))
        end = max(end, t.ended)
    return sum(t.bytes for t in timed) * 8 / busy_s / 1e6


class TransferLog:
    """Per exchange key, the timed transfers with groupmates by libp2p id; owned by the transport's event loop."""

    def __init__(self) -> None:
        self._by_key: dict[str, tuple[list[Transfer], list[Transfer]]] = {}  # key -> (uploads, downloads)

    def sent(self, key: str, libp2p_id: str, size: int, first_byte: float) -> None:
        """A send of ``size`` bytes whose first byte went at ``first_byte`` was acknowledged just now."""
        self._by_key.setdefault(key, ([], []))[0].append(Transfer(libp2p_id, size, first_byte, time.perf_counter()))

    def received(
        self, key: str, libp2p_id: str, chunk_sizes: list[int], arrivals: list[float], *, opened: Optional[float] = None
    ) -> None:
        """A slice's chunks and when each arrived: timed from ``opened`` (its stream opened, before the first
        byte came) or else from the first's arrival on, so that chunk's bytes don't count."""
        if opened is None:
            chunk_sizes, opened = chunk_sizes[1:], arrivals[0]
        self._by_key.setdefault(key, ([], []))[1].append(Transfer(libp2p_id, sum(chunk_sizes), opened, arrivals[-1]))

    def timings(self, key: str, *, rtt_s: dict[str, float], group: Sequence[Any]) -> LinkTimings:
        return LinkTimings.named(*self._by_key.get(key, ([], [])), rtt_s=rtt_s, group=group)

    def forget(self, key: str) -> None:
        self._by_key.pop(key, None)


class Ewma:
    """An exponentially weighted moving average; NaN until the first sample. A sample ``STEP_FACTOR`` times
    above or below the average replaces it: a link that became 10× slower is a new link, not noise, and the
    controller must see it within a round, not after the average has crept down over five."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha = alpha
        self.value = math.nan

    def add(self, sample: Optional[float]) -> None:
        if sample is None or not math.isfinite(sample) or sample < 0:
            return
        if math.isnan(self.value) or not self.value / STEP_FACTOR <= sample <= self.value * STEP_FACTOR:
            self.value = sample
        else:
            self.value = self.alpha * sample + (1 - self.alpha) * self.value


@dataclass
class Link:
    """Estimates for the link to one groupmate."""

    upload_mbit_s: Ewma = field(default_factory=Ewma)
    download_mbit_s: Ewma = field(default_factory=Ewma)
    rtt_s: Ewma = field(default_factory=Ewma)


class LinkEstimates:
    """This peer's link estimates, EWMA over exchanges: overall and per groupmate. Owned by the thread that
    runs the exchanges."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha = alpha
        self.upload = Ewma(alpha)
        self.download = Ewma(alpha)
        self.links: dict[str, Link] = {}

    def observe(self, timings: LinkTimings) -> None:
        self.upload.add(throughput_mbit_s(timings.uploads))
        self.download.add(throughput_mbit_s(timings.downloads))
        for t in timings.uploads:
            self._link(t.peer).upload_mbit_s.add(throughput_mbit_s([t]))
        for t in timings.downloads:
            self._link(t.peer).download_mbit_s.add(throughput_mbit_s([t]))
        for peer, seconds in timings.rtt_s.items():
            self._link(peer).rtt_s.add(seconds)

    def groupmate(self, peer_id: str) -> Optional[Link]:
        return self.links.get(peer_id)

    @property
    def upload_mbit_s(self) -> float:
        return self.upload.value

    @property
    def download_mbit_s(self) -> float:
        return self.download.value

    @property
    def rtt_ms(self) -> float:
        """Median over groupmates of each one's RTT estimate; NaN when none was measured."""
        known = [link.rtt_s.value for link in self.links.values() if not math.isnan(link.rtt_s.value)]
        return 1000 * statistics.median(known) if known else math.nan

    def _link(self, peer_id: str) -> Link:
        link = self.links.pop(peer_id, None) or Link(Ewma(self.alpha), Ewma(self.alpha), Ewma(self.alpha))
        self.links[peer_id] = link  # the most recently measured last
        if len(self.links) > MAX_GROUPMATES:
            self.links.pop(next(iter(self.links)))
        return link
