"""The WAN testbed's plan, before any kernel object exists: host names, addresses, rates, and the sentence
a bad request gets."""

from __future__ import annotations

import pytest
from testbed import make_topology
from testbed.network import teardown

pytestmark = pytest.mark.timeout(10)


def test_hosts_get_distinct_addresses_and_the_rates_asked_for() -> None:
    topology = make_topology(hosts=3, mbit=100, up_mbit=20, nat_host=True, prefix="swt-unit-")
    assert [h.name for h in topology.hosts] == ["h0", "h1", "h2", "nat"]
    assert len({h.address for h in topology.hosts}) == 4
    assert all(h.up_mbit == 20 and h.down_mbit == 100 for h in topology.hosts)
    assert topology.namespace("h1") == "swt-unit-h1"
    assert [h.name for h in topology.hosts if h.behind_nat] == ["nat"]


def test_each_nat_host_sits_behind_a_router_of_its_own() -> None:
    nats = [h for h in make_topology(hosts=1, nat_hosts=3).hosts if h.behind_nat]
    assert [(h.name, h.router, h.address, h.gateway, h.router_address) for h in nats] == [
        ("nat", "gw", "10.77.1.2", "10.77.1.1", "10.77.0.254"),  # the one --nat-host has always built
        ("nat1", "gw1", "10.77.2.2", "10.77.2.1", "10.77.0.253"),
        ("nat2", "gw2", "10.77.3.2", "10.77.3.1", "10.77.0.252"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "sentence"),
    [
        ({"hosts": 0}, "--hosts must be between 1 and 200, got 0"),
        ({"hosts": 2, "mbit": -5}, "mbit must be a positive rate in Mbit/s, got -5"),
        ({"hosts": 2, "nat_hosts": 9}, "--nat-hosts must be between 0 and 8, got 9"),
    ],
)
def test_a_bad_request_is_named(kwargs: dict, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence):
        make_topology(**kwargs)


def test_an_unknown_host_names_the_hosts_there_are() -> None:
    with pytest.raises(ValueError, match="there is no testbed host 'h7'; the hosts are h0, h1"):
        make_topology(hosts=2).host("h7")


def test_teardown_refuses_an_empty_prefix() -> None:
    with pytest.raises(ValueError, match="non-empty prefix"):
        teardown("")


def test_sites_pick_the_hosts_whose_traffic_crosses_sites() -> None:
    topology = make_topology(hosts=5, mbit=1000, sites=["", "a", "a", "b", "b"], cross_site_mbit=20)
    assert [h.name for h in topology.other_sites("h1")] == ["h3", "h4"]
    assert [h.name for h in topology.other_sites("h4")] == ["h1", "h2"]
    assert topology.other_sites("h0") == []  # no site (the coordinator's host): every link at its own rate
    assert make_topology(hosts=2, sites=["a", "b"]).other_sites("h0") == []  # no cross-site rate: uniform


@pytest.mark.parametrize(
    ("kwargs", "sentence"),
    [
        ({"hosts": 3, "sites": ["a", "b"]}, "--sites needs one label per host \\(3\\), got 2: a,b"),
        ({"hosts": 2, "sites": ["a", "a"], "cross_site_mbit": 20}, "needs hosts in at least two sites"),
        ({"hosts": 2, "sites": ["a", "b"], "cross_site_mbit": 0}, "cross_site_mbit must be a positive rate"),
    ],
)
def test_bad_sites_are_named(kwargs: dict, sentence: str) -> None:
    with pytest.raises(ValueError, match=sentence):
        make_topology(**kwargs)
