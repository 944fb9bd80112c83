"""The command line, the demo and the status view: the only layer that imports peer/ and coordinator/."""
