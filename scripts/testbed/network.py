"""Builds and tears down the testbed's kernel objects: one namespace per host, veth links to a bridge in a
namespace of its own, shaping on both ends of each link (``tbf``; ``htb`` with a class for other sites'
hosts when the topology has a cross-site rate), and a MASQUERADE router for the NAT host.

Nothing is created in the root namespace: links, qdiscs and iptables rules all live inside namespaces
named with the prefix, so deleting those namespaces removes everything, even after a crash, and the hosts
have no route to anything but each other.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from testbed.topology import SWITCH, HostSpec, Topology

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts"  # where ``python -m testbed...`` is found
_KILL_GRACE_S = 3.0
_UNSHAPED_MBIT = 10_000  # an htb class needs a rate: in-site traffic of a host without one
_IN_SITE, _CROSS_SITE = "1:10", "1:20"  # the htb classes of a site-aware link


class TestbedError(RuntimeError):
    """A command that builds the testbed failed; the message names it and what the kernel said."""


def missing_privileges(*, nat: bool = True) -> str | None:
    """Why the testbed cannot be built here, in one sentence, or None when it can."""
    if os.geteuid() != 0:
        return "the WAN testbed needs root (CAP_NET_ADMIN) to create network namespaces; run it as root"
    for tool in ("ip", "tc") + (("iptables",) if nat else ()):
        if shutil.which(tool) is None:
            return f"the WAN testbed needs the '{tool}' command; install it (apt-get install iproute2 iptables)"
    return None


def _sh(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _ip(namespace: str, *args: str) -> None:
    _sh("ip", "-n", namespace, *args)


def _in(namespace: str, *argv: str) -> str:
    return _sh("ip", "netns", "exec", namespace, *argv)


def _burst(mbit: float) -> int:
    """~4 ms of traffic, at least 32 KiB so a full-size segment always fits."""
    return max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))


def _shape(namespace: str, device: str, mbit: float | None) -> None:
    """Egress of ``device`` at ``mbit``: the token bucket holds ~4 ms of traffic and the queue ~50 ms, like a
    modest WAN router."""
    if mbit is None:
        return
    _sh(
        "tc",
        "-n",
        namespace,
        "qdisc",
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(_burst(mbit)),
        "latency",
        "50ms",
    )


def _shape_by_site(
    namespace: str, device: str, mbit: float | None, cross_mbit: float, others: list[str], match: str
) -> None:
    """Egress of ``device`` in two htb classes: traffic whose ``match`` ("dst" or "src") address is one of
    ``others`` (hosts of other sites) at ``cross_mbit``, the rest at ``mbit``. Each class queues ~50 ms."""
    tc = ("tc", "-n", namespace)
    _sh(*tc, "qdisc", "replace", "dev", device, "root", "handle", "1:", "htb", "default", _IN_SITE.split(":")[1])
    for classid, rate in ((_IN_SITE, mbit or _UNSHAPED_MBIT), (_CROSS_SITE, cross_mbit)):
        burst = str(_burst(rate))
        _sh(
            *tc,
            "class",
            "add",
            "dev",
            device,
            "parent",
            "1:",
            "classid",
            classid,
            "htb",
            "rate",
            f"{rate}mbit",
            "burst",
            burst,
            "cburst",
            burst,
            "quantum",
            "1514",
        )
        limit = str(max(64 * 1024, int(rate * 1e6 / 8 * 0.05)))
        _sh(*tc, "qdisc", "add", "dev", device, "parent", classid, "bfifo", "limit", limit)
    for address in others:
        _sh(
            *tc,
            "filter",
            "add",
            "dev",
            device,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            "match",
            "ip",
            match,
            f"{address}/32",
            "flowid",
            _CROSS_SITE,
        )


def _upstream(topology: Topology, host: HostSpec) -> tuple[str, str]:
    """The namespace and device of the far end of ``host``'s link (the bridge's port, or the router's leg)."""
    if host.behind_nat:
        return topology.namespace(host.router), "lan0"
    return topology.namespace(SWITCH), host.name


def shape_host(topology: Topology, host: HostSpec, up_mbit: float | None, down_mbit: float | None) -> None:
    """Shape ``host``'s link: its upload on its own end, its download on the bridge's end; traffic with other
    sites' hosts at the topology's cross-site rate. Replaces what was there (None: that direction unshaped)."""
    ns, (upstream, upstream_dev) = topology.namespace(host.name), _upstream(topology, host)
    others = [h.address for h in topology.other_sites(host.name)]
    for namespace, device, rate, match in ((ns, "eth0", up_mbit, "dst"), (upstream, upstream_dev, down_mbit, "src")):
        subprocess.run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True)
        if others:
            _shape_by_site(namespace, device, rate, topology.cross_site_mbit, others, match)
        else:
            _shape(namespace, device, rate)


def cross_site_bytes_sent(topology: Topology, host: str) -> int:
    """Bytes (IP packets, headers included) ``host`` has sent to other sites' hosts since its link was shaped."""
    return _class_bytes_sent(topology, host, _CROSS_SITE)


def in_site_bytes_sent(topology: Topology, host: str) -> int:
    """Bytes (IP packets, headers included) ``host`` has sent to every host not of another site (its own site's,
    and hosts without a site) since its link was shaped; 0 when its link has no per-site classes."""
    return _class_bytes_sent(topology, host, _IN_SITE)


def _class_bytes_sent(topology: Topology, host: str, classid: str) -> int:
    if not topology.other_sites(host):
        return 0
    out = _sh("tc", "-n", topology.namespace(host), "-s", "class", "show", "dev", "eth0", "classid", classid)
    found = re.search(r"Sent (\d+) bytes", out)
    return int(found.group(1)) if found else 0


def namespaces(prefix: str) -> list[str]:
    out = _sh("ip", "netns", "list")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _new_namespace(name: str) -> None:
    _sh("ip", "netns", "add", name)
    _ip(name, "link", "set", "lo", "up")


def _link_host(topology: Topology, host: HostSpec) -> None:
    """The host's eth0 on the bridge (or, behind NAT, on the router's private leg), shaped both ways."""
    ns = topology.namespace(host.name)
    upstream, upstream_dev = _upstream(topology, host)
    _ip(upstream, "link", "add", upstream_dev, "type", "veth", "peer", "name", "eth0", "netns", ns)
    if not host.behind_nat:
        _ip(upstream, "link", "set", upstream_dev, "master", "br0")
    _ip(upstream, "link", "set", upstream_dev, "up")
    _ip(ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
    _ip(ns, "link", "set", "eth0", "up")
    if host.behind_nat:
        _ip(ns, "route", "add", "default", "via", host.gateway)
    shape_host(topology, host, host.up_mbit, host.down_mbit)


def _build_router(topology: Topology, host: HostSpec) -> None:
    """The NAT host's router, which masquerades its private side and forwards nothing new inward: the NAT host
    behind it can connect out, and nobody can connect in."""
    router, switch = topology.namespace(host.router), topology.namespace(SWITCH)
    _new_namespace(router)
    _ip(switch, "link", "add", host.router, "type", "veth", "peer", "name", "eth0", "netns", router)
    _ip(switch, "link", "set", host.router, "master", "br0")
    _ip(switch, "link", "set", host.router, "up")
    _ip(router, "addr", "add", f"{host.router_address}/24", "dev", "eth0")
    _ip(router, "link", "set", "eth0", "up")
    _in(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    tag = ("-m", "comment", "--comment", topology.prefix + "nat")
    _in(router, "iptables", "-P", "FORWARD", "DROP")
    _in(router, "iptables", "-A", "FORWARD", "-i", "lan0", "-o", "eth0", "-j", "ACCEPT", *tag)
    _in(
        router, "iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT", *tag
    )
    lan = host.gateway.rsplit(".", 1)[0]
    _in(
        router,
        "iptables",
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-s",
        f"{lan}.0/24",
        "-o",
        "eth0",
        "-j",
        "MASQUERADE",
        *tag,
    )


def build(topology: Topology) -> None:
    """Create every namespace, link, qdisc and rule of ``topology``; on failure, remove what was made."""
    if namespaces(topology.prefix):
        raise TestbedError(
            f"a testbed with prefix {topology.prefix!r} is already up; take it down first (scripts/wan_testbed.py down)"
        )
    try:
        switch = topology.namespace(SWITCH)
        _new_namespace(switch)
        _ip(switch, "link", "add", "br0", "type", "bridge")
        _ip(switch, "link", "set", "br0", "up")
        for host in topology.hosts:
            _new_namespace(topology.namespace(host.name))
        nat_hosts = [h for h in topology.hosts if h.behind_nat]
        for host in nat_hosts:
            _build_router(topology, host)
        for host in topology.hosts:
            _link_host(topology, host)
        for host in nat_hosts:
            _ip(topology.namespace(host.router), "addr", "add", f"{host.gateway}/24", "dev", "lan0")
    except BaseException:
        teardown(topology.prefix)
        raise


def _kill_processes(namespace: str) -> None:
    """End the processes running inside one of the testbed's own namespaces (TERM, then KILL)."""
    try:
        pids = [int(p) for p in _sh("ip", "netns", "pids", namespace).split()]
    except TestbedError:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _KILL_GRACE_S
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
            time.sleep(0.05)
        if not alive:
            return
        pids = alive


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def teardown(prefix: str) -> list[str]:
    """Remove every namespace whose name starts with ``prefix`` (and so every link, qdisc and rule in them),
    ending the processes inside first. Idempotent; returns the namespaces it removed."""
    if not prefix:
        raise ValueError("teardown needs a non-empty prefix, or it would remove every namespace")
    removed = []
    for name in namespaces(prefix):
        _kill_processes(name)
        _sh("ip", "netns", "delete", name)
        removed.append(name)
    return removed


def leftovers(prefix: str) -> list[str]:
    """Everything on this machine that still carries ``prefix``: namespaces, and links, qdiscs and iptables
    rules in the root namespace. Empty after a clean teardown."""
    found = [f"namespace {n}" for n in namespaces(prefix)]
    found += [f"link {line.strip()}" for line in _sh("ip", "-o", "link").splitlines() if prefix in line]
    found += [f"qdisc {line.strip()}" for line in _sh("tc", "qdisc", "show").splitlines() if prefix in line]
    if shutil.which("iptables-save"):
        found += [f"iptables {line}" for line in _sh("iptables-save").splitlines() if prefix in line]
    return found


class Testbed:
    """The testbed as a context manager: built on enter, torn down on exit (also when the body raised)."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def __enter__(self) -> Testbed:
        build(self.topology)
        return self

    def __exit__(self, *exc: object) -> None:
        teardown(self.topology.prefix)

    def address(self, host: str) -> str:
        return self.topology.host(host).address

    def set_rate(self, host: str, *, up_mbit: float | None, down_mbit: float | None) -> None:
        """Change ``host``'s link rates while the testbed runs (its cross-site rate stays): a link that
        degrades or recovers mid-run. Connections stay open; queued packets beyond the new rate are dropped."""
        shape_host(self.topology, self.topology.host(host), up_mbit, down_mbit)

    def cross_site_bytes_sent(self, host: str) -> int:
        return cross_site_bytes_sent(self.topology, host)

    def in_site_bytes_sent(self, host: str) -> int:
        return in_site_bytes_sent(self.topology, host)

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as a command that runs inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.topology.namespace(self.topology.host(host).name), *argv]

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_argv(host, argv), **_with_repo_env(kwargs))

    def spawn(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.exec_argv(host, argv), **_with_repo_env(kwargs))


def _with_repo_env(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run from the repository root with it and scripts/ on PYTHONPATH, so ``python -m swarm...`` finds this
    checkout and ``python -m testbed...`` the testbed."""
    env = dict(kwargs.pop("env", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), str(SCRIPTS), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return {"cwd": REPO_ROOT, "env": env, **kwargs}
