"""Decoding: text in, text out. The Translator (translation.py: a model or an ensemble with its vocabulary
and search settings, the Python API `from transformer import Translator`), a corpus of any size translated in
resumable, rank-sharded chunks (corpus_translation.py), and the source noise of noised back-translation
(noise.py). It drives the core's search (transformer/search.py) and may import data/ and the core
(config, model, kernels, checkpoint, search, distributed); nothing of evaluation/, training/ or interop/.
"""
