"""The original Transformer: model, search and training pieces.

`from transformer import Translator` is the Python API for translating (transformer/decoding/translation.py). It is
imported on first use, so that `import transformer.model` still loads nothing of decoding, data or Hydra.
"""

import importlib.util as _util
from pathlib import Path as _Path

__all__ = ["Translation", "Translator"]


def _check_data_package() -> None:
    """This framework's lower layer is the top-level package `data` (beside `transformer`); a user's own module
    of that name earlier on sys.path would be imported instead, and fail far from the cause. Say so here."""
    ours = _Path(__file__).resolve().parent.parent / "data" / "__init__.py"
    spec = _util.find_spec("data")
    found = None if spec is None or spec.origin is None else _Path(spec.origin).resolve()
    if found != ours:
        raise ImportError(f"another module named 'data' ({found or 'a namespace package'}) shadows this framework's "
                          f"data package ({ours.parent}): rename yours, or run from a directory without it")


_check_data_package()


def __getattr__(name: str):
    if name in __all__:
        from transformer.decoding import translation

        return getattr(translation, name)
    raise AttributeError(f"module 'transformer' has no attribute {name!r}")
