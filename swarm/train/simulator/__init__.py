"""The simulator: virtual peers on one process running the round protocol, and a model of a round on a network."""
