"""Data: vocabulary, corpus loading and cleaning, token batching. Knows nothing of the network.

`quickstart_corpus` stands apart from that pipeline: it writes the quickstart's generated corpus, which the
pipeline then reads like any other; no pipeline module imports it.
"""
