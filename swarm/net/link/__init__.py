"""Reaching other peers: libp2p identity and addresses, reachability, relaying, link probes and link estimates."""
