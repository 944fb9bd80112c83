"""A WAN testbed on one Linux machine: emulated hosts in network namespaces on a shaped bridge, a NAT host,
and a userspace delay proxy. Needs root (CAP_NET_ADMIN); ``scripts/wan_testbed.py`` is its command line."""

from testbed.network import Testbed, leftovers, missing_privileges, teardown
from testbed.topology import ROUTER_ADDRESS, HostSpec, Topology, make_topology

__all__ = [
    "ROUTER_ADDRESS",
    "HostSpec",
    "Testbed",
    "Topology",
    "leftovers",
    "make_topology",
    "missing_privileges",
    "teardown",
]
