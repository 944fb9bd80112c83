"""Training: the model, the data, the local trainer, the round runner and the simulator. Imports swarm.config and swarm.core."""
