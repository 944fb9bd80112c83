"""What the testbed builds, as plain data: its hosts, their addresses, sites and link rates, and the names of
every kernel object it creates (all start with the prefix, so teardown can find them after a crash)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

PREFIX = "swt-"
SWITCH = "sw"  # the namespace that holds the bridge every host's link plugs into
ROUTER = "gw"  # the NAT host's router: one leg on the bridge, one on the NAT host's private link
NAT_HOST = "nat"
WAN_SUBNET = "10.77.0"  # hosts on the bridge: .10, .11, ...; the router: .254
LAN_SUBNET = "10.77.1"  # behind the router: router .1, NAT host .2
ROUTER_ADDRESS = f"{WAN_SUBNET}.254"  # what the NAT host's connections come from, as its peers see them
MAX_NAT_HOSTS = 8  # NAT host i (nat, nat1, ...) sits behind router gw, gw1, ... on 10.77.(1+i).0/24, seen as .(254−i)


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """One emulated host: its name, address and link rates (Mbit/s; None: unshaped), and its site ("": none).
    Traffic between hosts of two different sites runs at the topology's ``cross_site_mbit``."""

    name: str
    address: str
    up_mbit: float | None
    down_mbit: float | None
    behind_nat: bool = False
    site: str = ""
    router: str = ""  # behind NAT: its router's host name (gw, gw1, ...)
    router_address: str = ""  # that router's address on the bridge: what the host's connections come from
    gateway: str = ""  # that router's address on the host's private link


def nat_host_spec(index: int, up_mbit: float | None, down_mbit: float | None) -> HostSpec:
    """NAT host ``index``: ``nat`` behind ``gw`` for 0 (as before there were several), ``nat<i>`` behind ``gw<i>``."""
    suffix = str(index) if index else ""
    lan = f"10.77.{1 + index}"
    return HostSpec(
        name=NAT_HOST + suffix,
        address=f"{lan}.2",
        up_mbit=up_mbit,
        down_mbit=down_mbit,
        behind_nat=True,
        router=ROUTER + suffix,
        router_address=f"{WAN_SUBNET}.{254 - index}",
        gateway=f"{lan}.1",
    )


@dataclass(frozen=True, kw_only=True)
class Topology:
    hosts: tuple[HostSpec, ...]
    prefix: str = PREFIX
    cross_site_mbit: float | None = None  # each way, per host, to and from hosts of other sites (None: as in-site)

    def namespace(self, host: str) -> str:
        return self.prefix + host

    def host(self, name: str) -> HostSpec:
        for spec in self.hosts:
            if spec.name == name:
                return spec
        known = ", ".join(h.name for h in self.hosts)
        raise ValueError(f"there is no testbed host {name!r}; the hosts are {known}")

    @property
    def has_nat(self) -> bool:
        return any(h.behind_nat for h in self.hosts)

    def other_sites(self, name: str) -> list[HostSpec]:
        """The hosts whose traffic with ``name`` crosses sites (none when it has no site or rates are uniform)."""
        me = self.host(name)
        if self.cross_site_mbit is None or not me.site:
            return []
        return [h for h in self.hosts if h.site and h.site != me.site and not h.behind_nat]


def host_names(count: int) -> list[str]:
    return [f"h{i}" for i in range(count)]


def make_topology(
    *,
    hosts: int,
    mbit: float | None = None,
    up_mbit: float | None = None,
    down_mbit: float | None = None,
    nat_host: bool = False,
    nat_hosts: int = 0,
    prefix: str = PREFIX,
    sites: Optional[Sequence[str]] = None,
    cross_site_mbit: float | None = None,
) -> Topology:
    """``hosts`` hosts h0, h1, ... on one bridge (plus ``nat`` behind a router when ``nat_host``, or ``nat_hosts``
    of them, each behind a router of its own: nat, nat1, ...), each with
    the same upload and download rate (``up_mbit``/``down_mbit`` override ``mbit`` per direction).
    ``sites``: one label per bridge host ("": none); with ``cross_site_mbit`` a host's traffic to and from
    hosts of another site runs at that rate each way, and the rest at its own."""
    if not 1 <= hosts <= 200:
        raise ValueError(f"--hosts must be between 1 and 200, got {hosts}")
    for label, rate in (
        ("mbit", mbit),
        ("up_mbit", up_mbit),
        ("down_mbit", down_mbit),
        ("cross_site_mbit", cross_site_mbit),
    ):
        if rate is not None and rate <= 0:
            raise ValueError(f"{label} must be a positive rate in Mbit/s, got {rate}")
    labels = list(sites) if sites is not None else [""] * hosts
    if len(labels) != hosts:
        raise ValueError(f"--sites needs one label per host ({hosts}), got {len(labels)}: {','.join(labels)}")
    if cross_site_mbit is not None and len({s for s in labels if s}) < 2:
        raise ValueError("a cross-site rate needs hosts in at least two sites; give --sites, e.g. a,a,b,b")
    up = up_mbit if up_mbit is not None else mbit
    down = down_mbit if down_mbit is not None else mbit
    specs = [
        HostSpec(name=name, address=f"{WAN_SUBNET}.{10 + i}", up_mbit=up, down_mbit=down, site=site)
        for i, (name, site) in enumerate(zip(host_names(hosts), labels))
    ]
    nats = max(nat_hosts, 1 if nat_host else 0)
    if not 0 <= nats <= MAX_NAT_HOSTS:
        raise ValueError(f"--nat-hosts must be between 0 and {MAX_NAT_HOSTS}, got {nats}")
    specs += [nat_host_spec(i, up, down) for i in range(nats)]
    return Topology(hosts=tuple(specs), prefix=prefix, cross_site_mbit=cross_site_mbit)
