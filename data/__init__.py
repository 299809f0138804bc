"""Data: vocabulary, corpus loading and cleaning, token batching. Knows nothing of the network.

The quickstart's generated corpus is not made here: quickstart/corpus.py writes it as plain parallel text,
which the pipeline then reads like any other.
"""
