"""What the three entry points share: composing the Hydra config, logging to stderr, one-line user errors.

`hydra_app(config_name, run)` is each entry point's `__main__` and console script (`transformer-train`, ...). A plain run (`python train.py key=value`)
composes its config with Hydra's compose API, so that a bad override prints one line, not Hydra's multi-line
report; with one of Hydra's own flags (`--help`, `--cfg job`, `-m`/`--multirun`, ...) it is a real
`@hydra.main` app. Either way no `outputs/`, `multirun/` or `.hydra/` folders appear (configs/app.yaml) and
the run directory is ours (`run_dir`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from typing import Callable, Sequence

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from data.errors import ConfigError, DataError, WriteError, one_line
from transformer import config as schema
from transformer.checkpoint import CheckpointError
from transformer.config import DecodeConfig, config_dir
from transformer.distributed import PeerFailure



# ---------------------------------------------------------------------------------------------- schemas


def _schema(obj) -> DictConfig:
    """`OmegaConf.structured(obj)` with its type checks, but writable: Hydra merges the YAML files and the
    overrides into the schema, which OmegaConf marks read-only (every node) for a frozen dataclass."""
    node = OmegaConf.structured(obj)

    def writable(config: DictConfig) -> None:
        OmegaConf.set_readonly(config, None)
        for key in config:
            child = config._get_node(key)
            if isinstance(child, DictConfig):
                writable(child)

    writable(node)
    return node


def register() -> None:
    """Register the schemas (`<job>_schema`, e.g. `config_schema`, first in each job's defaults list) with
    Hydra's ConfigStore, and the `sweep_dir` resolver of configs/app.yaml. Idempotent. The presets of every
    group, the model's included, are the YAML files of configs/, merged onto these schemas (which check them)."""
    from hydra.core.config_store import ConfigStore  # here: the dataclasses are used without Hydra too

    if not OmegaConf.has_resolver("sweep_dir"):  # configs/app.yaml: where a multirun writes multirun.yaml
        OmegaConf.register_new_resolver("sweep_dir", lambda run_dir: run_dir or "runs")
    store = ConfigStore.instance()
    for name, job in schema.JOBS.items():
        store.store(name=f"{name}_schema", node=_schema(job))


def to_job(cfg: DictConfig, job: str = "config"):
    """The composed config as its job's frozen dataclass; range checks raise a one-line ConfigError."""
    container = OmegaConf.to_container(cfg, resolve=True)
    for key in ("choices", "job_num", "overrides"):  # added by transformer/cli.py (naming runs, decode_request)
        container.pop(key, None)
    try:
        return OmegaConf.to_object(OmegaConf.merge(_schema(schema.JOBS[job]), container))
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:  # e.g. a dataclass refusing a key: name it in one line
        raise ConfigError(str(error).splitlines()[0]) from None


log = logging.getLogger("transformer")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types whose message is meant for the user (printed as one line, exit status 2)."""
    return (ConfigError, DataError, WriteError, CheckpointError, PeerFailure, HydraException, OmegaConfBaseException)


def compose_config(overrides: Sequence[str], *, config_name: str = "config") -> DictConfig:
    """The config of `configs/<config_name>.yaml` with command-line `overrides` (Hydra syntax).

    `cfg.choices` records the group options chosen (model, data, experiment, ...), for naming runs.
    """
    for override in overrides:  # Hydra's own message for these is "Error parsing override"
        if "=" not in override and not override.startswith("-"):
            hint = (f"to use that checkpoint or run directory, write checkpoint={override}"
                    if config_name in ("translate", "evaluate") else "e.g. experiment=quickstart")
            raise ConfigError(f"'{override}' is not a key=value override: {hint}")
    register()
    script = {"config": "train.py"}.get(config_name, f"{config_name}.py")
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
        except OverrideParseException as error:  # e.g. LexerNoViableAltException for an unbalanced quote
            raise ConfigError(unparsable_override(error)) from None
        except HydraException as error:  # "Could not override 'x'": a key this entry point does not have
            unknown = re.match(r"Could not override '([^']+)'", str(error))
            if unknown is None:
                raise
            raise ConfigError(f"Could not override '{unknown[1]}': {script} has no such key; its keys are "
                              f"{schema.JOBS[config_name].__name__}'s in transformer/config.py (`python {script} "
                              "--help` lists them): check the spelling") from None
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
                                      f"transformer/config.py ({schema.JOBS[config_name].__name__}); check the "
                                      "spelling")
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra/")}
    with open_dict(cfg):
        del cfg["hydra"]
        cfg.choices = choices
        cfg.overrides = list(overrides)
    return cfg


def unparsable_override(error: OverrideParseException) -> str:
    """Hydra's override-grammar error (several lines, the parser's class name first) as one line that says how
    to quote a value on the command line."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    override = first.split(": ", 1)[-1] if "Exception: " in first else first
    return (f"cannot parse the override {override}: a quote is unbalanced or the value holds a character Hydra "
            "reads as syntax (space , [ ] { } ( ) ' \" = :); quote the value for Hydra and the whole override for "
            "the shell, e.g. 'key=\"a value, with commas\"' (a quote inside the value: \\' or \\\")")


def decode_request(cfg: DictConfig, decode: DecodeConfig) -> tuple[DecodeConfig | None, dict]:
    """(decode, settings) for `Translator.load(..., decode=decode, **settings)` from translate.py's or
    evaluate.py's command line: a checkpoint decodes with its run's own search settings (`run_decode`), except
    for the decode.* keys given on the command line; `decode=<preset>` (e.g. decode=greedy) sets them all."""
    keys = [o.lstrip("+").split("=", 1)[0] for o in cfg.get("overrides") or [] if not o.startswith("~")]
    if "decode" in keys:
        return decode, {}
    given = [key.removeprefix("decode.") for key in keys if key.startswith("decode.")]
    return None, {key: getattr(decode, key) for key in given}


def setup_logging(*, quiet: bool = False) -> None:
    """Logs go to stderr (stdout is reserved for results: translations, scores)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING if quiet else logging.INFO)
    for noisy in ("datasets", "huggingface_hub", "fsspec", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main_with_user_errors(main: Callable[[list[str]], int | None]) -> Callable[[], None]:
    """Wrap an entry point: user errors print `error: <one line>` on stderr and exit with status 2."""

    @functools.wraps(main)
    def wrapper() -> None:
        sys.exit(_with_user_errors(main, sys.argv[1:]) or 0)

    return wrapper


def _with_user_errors(main: Callable, *args) -> int | None:
    """`main(*args)`; a user error prints `error: <one line>` on stderr and exits with status 2."""
    try:
        return main(*args)
    except user_errors() as error:
            print(f"error: {one_line(error)}", file=sys.stderr)
            if isinstance(error, PeerFailure):  # the broken process group's destructor can abort (gloo) or hang
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(2)
            sys.exit(2)


# Hydra's own command-line flags: with one of them the entry point is handed to `@hydra.main`.
HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-m", "--multirun", "-i", "--info", "-p", "--package",
               "--resolve", "-sc", "--shell-completion", "--version")


def hydra_app(config_name: str, run: Callable[[DictConfig], int]) -> None:
    """Run an entry point from the command line: `run(cfg)` with the composed `configs/<config_name>.yaml`.

    Multirun (`-m key=a,b`): Hydra's basic launcher calls `run` once per combination, one after another;
    `cfg.job_num` is the job's number (None outside multirun), for the job's own run directory.
    """
    argv = sys.argv[1:]
    if not any(arg.split("=", 1)[0] in HYDRA_FLAGS for arg in argv):
        sys.exit(_with_user_errors(lambda: run(compose_config(argv, config_name=config_name))) or 0)
    register()
    configs = _with_user_errors(config_dir)

    @hydra.main(config_path=str(configs), config_name=config_name, version_base=None)
    def task(cfg: DictConfig) -> int:
        hydra_cfg = HydraConfig.get()
        with open_dict(cfg):
            cfg.choices = {k: v for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra/")}
            cfg.job_num = hydra_cfg.job.num if hydra_cfg.mode == RunMode.MULTIRUN else None
            cfg.overrides = list(hydra_cfg.overrides.task)
        status = _with_user_errors(run, cfg)
        if status:
            sys.exit(status)
        return 0

    task()
