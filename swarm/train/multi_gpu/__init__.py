"""A multi-GPU peer: its ranks, how rank 0 keeps them in step, and FSDP sharding."""
