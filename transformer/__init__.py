"""The original Transformer: model, search and training pieces.

`from transformer import Translator` is the Python API for translating (transformer/translation.py). It is
imported on first use, so that `import transformer.model` still loads nothing of decoding, data or Hydra.
"""

__all__ = ["Translation", "Translator"]


def __getattr__(name: str):
    if name in __all__:
        from transformer import translation

        return getattr(translation, name)
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")
