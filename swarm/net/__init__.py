"""Networking on hivemind: transport, rendezvous, all-reduce, votes, state transfer. Imports swarm.config, swarm.core and swarm.train."""

from swarm.net.deferred_imports import defer_scipy_optimize

defer_scipy_optimize()  # before any module here imports hivemind
