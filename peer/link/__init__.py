"""The peer's link to the coordinator: its calls and retries, the heartbeat, the round plans, and deciding a round with or without it."""
