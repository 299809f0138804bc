"""The console scripts `transformer-train`, `transformer-translate` and `transformer-evaluate` (pyproject.toml):
each runs its entry script (train.py, translate.py, evaluate.py) exactly as `python <script> ARGS` does, from
any directory, so the scripts stay the one definition of each command and `python train.py` keeps working in
a checkout.

A wheel carries the scripts in the package (`transformer/scripts/`, pyproject.toml); an editable install or a
checkout has them beside the package. The installed copy is looked for first: the folder above an installed
package is site-packages, where another project's `train.py` may lie.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def train() -> None:
    _run("train.py")


def translate() -> None:
    _run("translate.py")


def evaluate() -> None:
    _run("evaluate.py")


def script_path(name: str) -> Path:
    """Where the entry script `name` is: installed with the package, or in the checkout above it."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "scripts" / name, package.parent / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(name)


def _run(name: str) -> None:
    try:
        script = script_path(name)
    except FileNotFoundError:
        package = Path(__file__).resolve().parent
        print(f"error: {name} is neither in {package / 'scripts'} (a wheel) nor in {package.parent} (a checkout): "
              "reinstall the project (pip install .)", file=sys.stderr)
        sys.exit(2)
    runpy.run_path(str(script), run_name="__main__")
