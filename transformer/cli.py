"""What the three entry points share: composing the Hydra config, logging to stderr, one-line user errors.

We compose with Hydra's compose API instead of `@hydra.main`, so that no `outputs/DATE/TIME` folders
are created, the run directory is ours (`run_dir`), and a bad override prints one line, not Hydra's
multi-line report.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

log = logging.getLogger("transformer")


class ConfigError(Exception):
    """A configuration the user must change; the message is one line that says how."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types whose message is meant for the user (printed as one line, exit status 2)."""
    from data.errors import DataError
    from transformer.checkpoint import CheckpointError
    from transformer.distributed import PeerFailure

    return (ConfigError, DataError, CheckpointError, PeerFailure, HydraException, OmegaConfBaseException)


def compose_config(overrides: Sequence[str], *, config_name: str = "config") -> DictConfig:
    """The config of `configs/<config_name>.yaml` with command-line `overrides` (Hydra syntax).

    `cfg.choices` records the group options chosen (model, data, experiment, ...), for naming runs.
    """
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
        # Hydra's `+key=value` adds a key; every key we read is already in the config, so an added one is a
        # typo that would be silently ignored (`++key=value` of an existing key is a plain override).
        added = [o for o in overrides if o.startswith("+")]
        if added:
            base = compose(config_name, overrides=[o for o in overrides if not o.startswith("+")])
            for override in added:
                key = override.lstrip("+").split("=", 1)[0]
                absent = object()
                if OmegaConf.select(base, key, default=absent) is absent:
                    raise ConfigError(f"unknown config key '{key}' ({override}): every key is in "
                                      f"configs/{config_name}.yaml; check the spelling")
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    cfg.choices = choices
    OmegaConf.set_struct(cfg, True)
    return cfg


def setup_logging(*, quiet: bool = False) -> None:
    """Logs go to stderr (stdout is reserved for results: translations, scores)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    for noisy in ("datasets", "huggingface_hub", "fsspec", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def one_line(error: BaseException) -> str:
    """The first meaningful line of an error message (Hydra's are multi-line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    text = lines[0]
    if "Could not override" in text or "Key '" in text and "not in struct" in text:
        text += " (check the key's spelling; see configs/config.yaml for every key)"
    if "Could not find" in text:
        options = [line for line in lines[1:] if not line.startswith(("Config search path", "provider="))]
        if options:
            text += " — " + " ".join(options).replace("Available options in", "options in")
    return text


def main_with_user_errors(main: Callable[[list[str]], int | None]) -> Callable[[], None]:
    """Wrap an entry point: user errors print `error: <one line>` on stderr and exit with status 2."""

    @functools.wraps(main)
    def wrapper() -> None:
        try:
            status = main(sys.argv[1:])
        except user_errors() as error:
            print(f"error: {one_line(error)}", file=sys.stderr)
            from transformer.distributed import PeerFailure

            if isinstance(error, PeerFailure):  # the broken process group's destructor can abort (gloo) or hang
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
            sys.exit(2)
        sys.exit(status or 0)

    return wrapper
