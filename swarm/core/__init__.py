"""Pure torch math: averaging, the outer optimizer, codecs and error feedback, streaming fragments, the global state and its hash, the commit rule. Imports only swarm.config."""
