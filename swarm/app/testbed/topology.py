"""What the testbed builds, as plain data: its hosts, their addresses and link rates, and the names of
every kernel object it creates (all start with the prefix, so teardown can find them after a crash)."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "swt-"
SWITCH = "sw"  # the namespace that holds the bridge every host's link plugs into
ROUTER = "gw"  # the NAT host's router: one leg on the bridge, one on the NAT host's private link
NAT_HOST = "nat"
WAN_SUBNET = "10.77.0"  # hosts on the bridge: .10, .11, ...; the router: .254
LAN_SUBNET = "10.77.1"  # behind the router: router .1, NAT host .2
ROUTER_ADDRESS = f"{WAN_SUBNET}.254"  # what the NAT host's connections come from, as its peers see them


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """One emulated host: its name, address and link rates (Mbit/s; None: unshaped)."""

    name: str
    address: str
    up_mbit: float | None
    down_mbit: float | None
    behind_nat: bool = False


@dataclass(frozen=True, kw_only=True)
class Topology:
    hosts: tuple[HostSpec, ...]
    prefix: str = PREFIX

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


def host_names(count: int) -> list[str]:
    return [f"h{i}" for i in range(count)]


def make_topology(*, hosts: int, mbit: float | None = None, up_mbit: float | None = None,
                  down_mbit: float | None = None, nat_host: bool = False, prefix: str = PREFIX) -> Topology:
    """``hosts`` hosts h0, h1, ... on one bridge (plus ``nat`` behind a router when ``nat_host``), each with
    the same upload and download rate (``up_mbit``/``down_mbit`` override ``mbit`` per direction)."""
    if not 1 <= hosts <= 200:
        raise ValueError(f"--hosts must be between 1 and 200, got {hosts}")
    for label, rate in (("mbit", mbit), ("up_mbit", up_mbit), ("down_mbit", down_mbit)):
        if rate is not None and rate <= 0:
            raise ValueError(f"{label} must be a positive rate in Mbit/s, got {rate}")
    up = up_mbit if up_mbit is not None else mbit
    down = down_mbit if down_mbit is not None else mbit
    specs = [HostSpec(name=name, address=f"{WAN_SUBNET}.{10 + i}", up_mbit=up, down_mbit=down)
             for i, name in enumerate(host_names(hosts))]
    if nat_host:
        specs.append(HostSpec(name=NAT_HOST, address=f"{LAN_SUBNET}.2", up_mbit=up, down_mbit=down, behind_nat=True))
    return Topology(hosts=tuple(specs), prefix=prefix)
