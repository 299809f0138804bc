"""Data: vocabulary, corpus loading and cleaning, token batching. Knows nothing of the network."""
