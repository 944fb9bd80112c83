"""What a peer tells: its stats, progress lines, round log and /metrics."""
