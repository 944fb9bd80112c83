"""Networking on hivemind: transport, rendezvous, all-reduce, votes, state transfer. Imports swarm.config, swarm.core and swarm.train."""
