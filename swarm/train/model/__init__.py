"""The run's model: built from the config, placed on a peer, its round 0, its held-out loss and the final file."""
