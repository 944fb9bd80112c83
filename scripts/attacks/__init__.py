"""The scenarios of ``scripts/attack.py``: each starts a real swarm with the CLI, attacks it, and judges the run by
what a user sees (status, history, the final models)."""
