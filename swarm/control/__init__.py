"""The coordinator client, join strings and TLS pinning."""
