"""One round's exchange among a group: rendezvous, the all-reduce and its slices' reduction, the two-level exchange, results."""
