"""Training data: the corpora, their tokens and fingerprint, and the batches prepared ahead of a step."""
