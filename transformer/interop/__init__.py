"""Interop: our models to and from other toolkits. Hugging Face Marian / OPUS-MT import and export (marian.py)
and CTranslate2 export (ct2_export.py), which needs marian.py's refusals; their command line is
transformer/hf.py. It stands beside the capabilities: it may import data/ and the core (config, model,
checkpoint), and nothing of decoding/, evaluation/ or training/; only transformer/hf.py, benchmarks and tests
import it. The `transformers` and `ctranslate2` packages are imported where they are used (the `hf` extra).
"""
