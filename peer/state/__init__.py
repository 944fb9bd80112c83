"""What a peer keeps on disk: checkpoints, resuming from them, the state store, and the final file."""
