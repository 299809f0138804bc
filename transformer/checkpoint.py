"""Checkpoints: what one holds, atomic saves, safe loads, averaging, and the file layout of a run directory.

A checkpoint is a plain dict of tensors, numbers, strings, None, bools and nested
dicts/lists/tuples of them, so it loads with `torch.load(weights_only=True)`: loading never runs pickled
code. Layout of `run_dir/checkpoints/`:

    step-00012000.pt   numbered, every train.save_every_steps (the ones averaged and pruned)
    last.pt            the newest training state (resume reads this)
    averaged.pt        the mean of the last train.average_last numbered checkpoints (weights only)
    best.pt            the best by train.best_metric

What a training checkpoint holds is defined once, here: `TrainState` (the loop's counters) and
`training_checkpoint` (the weights, vocabulary, config and optimizer/scheduler/scaler/data states beside it);
train.py saves and resumes with them, evaluate.py reads `TrainState` for the cost columns of Table 2.

Command line (averages model weights; one-line errors, exit status 2):

    python -m transformer.checkpoint average OUT.pt IN1.pt IN2.pt ...
    python -m transformer.checkpoint average OUT.pt --last 5 --run-dir runs/base-wmt14-en-de
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import re
import sys
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from data.errors import WriteError, one_line
from data.files import atomic_write, crash_point, remove_quietly
from transformer.model import Transformer, TransformerConfig

FORMAT_VERSION = 1

_NUMBERED = re.compile(r"step-(\d+)\.pt")

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A user error about a checkpoint; `str(error)` is a one-line message naming the file and what to do."""


# ------------------------------------------------------------------------------- what a checkpoint holds


@dataclass(kw_only=True)
class TrainState:
    """The training loop's state beside the weights and optimizer: what resume needs to continue exactly,
    and what the run cost (Table 2's GPU-hours and FLOPs). Stored as top-level keys of the checkpoint."""

    step: int = 0  # updates done
    best: float | None = None  # the best validation value of train.best_metric so far
    stale: int = 0  # validations since the best one (train.patience)
    train_seconds: float = 0.0  # training time: updates only, validation and saving excluded (throughput)
    wall_seconds: float = 0.0  # the run's wall clock up to this checkpoint, all processes (train.max_time)
    # The measured costs (transformer/training/budget.py), so that a resumed run prices its work from the start:
    update_seconds: float = 0.0  # the slowest recent update
    validation_seconds: float = 0.0  # the slowest recent validation
    save_seconds: float = 0.0  # the latest checkpoint write
    decode_line_seconds: float = 0.0  # per line, at the latest BLEU validation
    train_tokens: int = 0  # target tokens trained on, all ranks together
    nonfinite: int = 0  # updates in a row skipped for a non-finite gradient norm (train.max_nonfinite)
    world_size: int = 1  # of the run that wrote the checkpoint ...
    update_freq: int = 1  # ... its forward passes per update ...
    max_tokens: int = 0  # ... and each pass's token budget per rank (0: not recorded by older checkpoints)
    device: str = "cpu"  # cpu | cuda
    # A stop signal came with update `step`: its validation and numbered checkpoint (if due) are the resume's first work.
    unfinished_update: bool = False

    @classmethod
    def read(cls, checkpoint: dict) -> TrainState:
        """The state stored in a loaded checkpoint; keys it lacks (older or averaged ones) keep their defaults,
        except wall_seconds, which older checkpoints did not keep: their training time stands for it (what
        train.max_time counted then), so a resumed run does not get a whole new budget."""
        state = cls(**{f.name: checkpoint[f.name] for f in fields(cls) if checkpoint.get(f.name) is not None})
        if checkpoint.get("wall_seconds") is None:
            state.wall_seconds = state.train_seconds
        return state


def checkpoint_dict(*, kind: str, step: int | None, model_config: dict | None, model: dict, spm_model,
                    config: dict | None, **extra) -> dict:
    """The layout of every checkpoint this framework writes (kind "train", "diagnostic", "averaged" or
    "imported"): the model's config and weights, its SentencePiece model (bytes, or the tensor a checkpoint
    holds), the run's config and the update; `extra` adds what the kind needs (a training run's state,
    optimizer and data position; the steps averaged; where a model was imported from)."""
    return {"format_version": FORMAT_VERSION, "kind": kind, "step": step, "model_config": model_config,
            "model": model, "spm_model": spm_model if isinstance(spm_model, torch.Tensor) else spm_tensor(spm_model),
            "config": config, **extra}


def training_checkpoint(*, state: TrainState, model: torch.nn.Module, model_config: dict, spm_model: bytes,
                        config: dict, optimizer, scheduler, scaler, data_state: dict, kind: str = "train") -> dict:
    """The dict of a training checkpoint (`kind` "train", or "diagnostic" for the one written before a
    non-finite stop): everything `load_training` gives back to resume."""
    run_state = {k: v for k, v in asdict(state).items() if k != "step"}
    return checkpoint_dict(kind=kind, step=state.step, model_config=model_config, model=model.state_dict(),
                           spm_model=spm_model, config=config, **run_state, optimizer=optimizer.state_dict(),
                           scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), data_state=data_state)


def load_training(checkpoint: dict, path, *, model: torch.nn.Module, optimizer, scheduler, scaler,
                  stream) -> TrainState:
    """Restore what `training_checkpoint` saved into the live objects; returns the loop's state."""
    load_model_state(model, checkpoint["model"], path, fix="use another run_dir, or delete that file")
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    # The next update's lr by this run's schedule, so that a train.lr_scale or warmup_steps changed on resume
    # applies from it (the optimizer holds the old schedule's; LambdaLR saves no functions): unchanged, the same.
    for group, base, rate in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * rate(scheduler.last_epoch)
    if checkpoint["scaler"] or not scaler.is_enabled():
        scaler.load_state_dict(checkpoint["scaler"])
    else:  # a bf16/fp32 run resumed with train.precision=fp16: its loss scale starts afresh
        log.info("%s has no fp16 loss scale (it was trained in another precision): starting at %g", path,
                 scaler.get_scale())
    stream.load_state_dict(checkpoint["data_state"])
    return TrainState.read(checkpoint)


# ---------------------------------------------------------------------------------------------- writing


def save(obj: dict, path: str | os.PathLike) -> None:
    """Write the checkpoint `obj` to `path` atomically (see `atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f), what="checkpoint")


def spm_tensor(model_proto: bytes) -> torch.Tensor:
    """The SentencePiece model as a uint8 tensor: bytes that `weights_only` loading accepts."""
    if not model_proto:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(model_proto), dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------- reading


def load(path: str | os.PathLike, map_location: Any = "cpu", *, mmap: bool = False) -> dict:
    """Load one of our checkpoints with `torch.load(weights_only=True)`; every failure is a CheckpointError.

    mmap=True maps tensor data instead of reading it (cheap: for peeking at `step` or `model_config`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} is not a file; pass a .pt file (in a run directory: checkpoints/last.pt)"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a raw pickle: we refuse it
            obj = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zips, EOF, bad offsets, refused globals: torch raises many types
        detail = one_line(e, limit=160)
        if isinstance(e, pickle.UnpicklingError) and "global" in str(e).lower():
            raise CheckpointError(
                f"refused to load {path}: it contains pickled code or objects that are not plain tensors "
                f"({detail}); only load checkpoints you trust"
            ) from None
        raise CheckpointError(
            f"could not read checkpoint {path}: the file is truncated, corrupted or not written by torch.save "
            f"({detail}); use another checkpoint"
        ) from None
    if not isinstance(obj, dict) or "format_version" not in obj or "model" not in obj:
        raise CheckpointError(
            f"{path} is a foreign checkpoint (no format_version/model keys): this framework reads only the "
            "checkpoints it writes: use one written by its train.py"
        )
    version = obj["format_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{path} is a foreign checkpoint (format_version {version!r} is not an integer)")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}, newer than this code reads ({FORMAT_VERSION}); "
            "upgrade the framework"
        )
    return obj


def spm_bytes(state: dict) -> bytes:
    """The SentencePiece model stored in a loaded checkpoint (see `spm_tensor`)."""
    proto = state.get("spm_model")
    if not isinstance(proto, torch.Tensor) or proto.dtype != torch.uint8 or proto.numel() == 0:
        raise CheckpointError("the checkpoint holds no SentencePiece model (spm_model); it cannot be used alone: "
                              "use a checkpoint written by this framework's train.py")
    return proto.numpy().tobytes()


# -------------------------------------------------------------------------------------------- averaging


def average(paths: list[str | os.PathLike]) -> dict:
    """An "averaged" checkpoint: the element-wise mean of the models' weights (no optimizer state).

    Floating tensors are summed in float64 and cast back to their dtype; integer buffers, the model
    config, the SentencePiece model and the run config come from the last path. `step` is the newest of
    the steps, `averaged_steps` lists them in the order given. Loads one checkpoint at a time, memory-mapped:
    only the weights are read, not the optimizer state beside them (2/3 of a training checkpoint).
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    sums: dict[str, torch.Tensor] = {}
    steps: list[int] = []
    reference = None  # (path, what must match) of the first checkpoint
    for path in paths:
        ckpt = last = None  # one checkpoint in memory at a time
        ckpt = load(path, mmap=True)
        if not isinstance(ckpt.get("step"), int):
            raise CheckpointError(f"{path} has no training step; it cannot be averaged")
        steps.append(ckpt["step"])
        signature = _architecture(ckpt)
        if reference is None:
            reference = (path, signature)
        else:
            _check_same_architecture(reference[0], reference[1], path, signature)
        for name, tensor in ckpt["model"].items():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                if name in sums:
                    sums[name] += tensor.double()
                else:
                    sums[name] = tensor.to(torch.float64, copy=True)
        last = ckpt
    averaged_model = {}
    for name, tensor in last["model"].items():
        if name in sums:
            averaged_model[name] = (sums[name] / len(paths)).to(tensor.dtype)
        else:
            averaged_model[name] = tensor  # integer buffers (and non-tensor extra state): the last one's
    return checkpoint_dict(kind="averaged", step=max(steps), model_config=last.get("model_config"),
                           model=averaged_model, spm_model=last.get("spm_model"), config=last.get("config"),
                           averaged_steps=steps)


def _architecture(ckpt: dict) -> dict:
    """What two checkpoints must share to be averaged: parameter names and shapes, config, vocabulary."""
    return {
        "shapes": {
            name: tuple(t.shape) if isinstance(t, torch.Tensor) else None for name, t in ckpt["model"].items()
        },
        "model_config": ckpt.get("model_config"),
        "spm_model": ckpt.get("spm_model"),
    }


def _check_same_architecture(path_a, a: dict, path_b, b: dict) -> None:
    shapes_a, shapes_b = a["shapes"], b["shapes"]
    if shapes_a.keys() != shapes_b.keys():
        differing = sorted(shapes_a.keys() ^ shapes_b.keys())
        raise CheckpointError(
            f"cannot average {path_a} and {path_b}: different architectures (parameters "
            f"{', '.join(differing[:5])}{' ...' if len(differing) > 5 else ''} are in only one)"
        )
    for name, shape in shapes_a.items():
        if shape != shapes_b[name]:
            raise CheckpointError(
                f"cannot average {path_a} and {path_b}: different architectures ({name} has shape "
                f"{shape} vs {shapes_b[name]})"
            )
    if a["model_config"] != b["model_config"]:
        raise CheckpointError(f"cannot average {path_a} and {path_b}: their model configs differ")
    spm_a, spm_b = a["spm_model"], b["spm_model"]
    if isinstance(spm_a, torch.Tensor) and isinstance(spm_b, torch.Tensor) and not torch.equal(spm_a, spm_b):
        raise CheckpointError(f"cannot average {path_a} and {path_b}: they use different vocabularies")


# ------------------------------------------------------------------------------------ run-directory layout


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def numbered_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def last_path(run_dir: str | os.PathLike) -> Path:
    return checkpoint_dir(run_dir) / "last.pt"


def averaged_path(run_dir: str | os.PathLike) -> Path:
    return checkpoint_dir(run_dir) / "averaged.pt"


def best_path(run_dir: str | os.PathLike) -> Path:
    return checkpoint_dir(run_dir) / "best.pt"


def run_dir_of(checkpoint_path: str | os.PathLike) -> Path | None:
    """The run directory a checkpoint file belongs to (run_dir/checkpoints/x.pt), or None for a loose file."""
    path = Path(checkpoint_path).resolve()
    return path.parent.parent if path.parent.name == "checkpoints" else None


def list_numbered(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The numbered checkpoints of a run as (step, path), oldest first."""
    return _numbered_in(checkpoint_dir(run_dir))


def _numbered_in(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NUMBERED.fullmatch(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def prune(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete the oldest numbered checkpoints beyond the newest `keep_last` (<= 0: keep all); returns them."""
    if keep_last <= 0:
        return []
    doomed = [path for _, path in list_numbered(run_dir)[:-keep_last]]
    for path in doomed:
        crash_point("mid-prune")
        remove_quietly(path)
    return doomed


def make_run_dir(run_dir: str | os.PathLike, *, clean: bool) -> None:
    """Create run_dir and its checkpoints folder now, not at the first save, so a bad run_dir fails at once;
    with `clean` (rank 0 only), delete what interrupted checkpoint writes left."""
    for directory in (Path(run_dir), checkpoint_dir(run_dir)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise CheckpointError(f"cannot create {directory}: {error.strerror or error}; choose another run_dir") \
                from None
    for stale in remove_temporaries(run_dir) if clean else ():
        log.warning("removed %s, left by a checkpoint write that was interrupted", stale)


def remove_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of checkpoint writes that a crash interrupted (`.<name>.<hex>.tmp`);
    returns them. Call only while no other process writes checkpoints to this run directory."""
    directory = checkpoint_dir(run_dir)
    stale = sorted(directory.glob(".*.tmp")) if directory.is_dir() else []
    for path in stale:
        remove_quietly(path)
    return stale


def load_model_state(model: torch.nn.Module, state_dict: dict, path: str | os.PathLike, *, fix: str) -> None:
    """`model.load_state_dict(state_dict)`, with a one-line CheckpointError when the checkpoint's weights do
    not fit the model (missing, unexpected or differently shaped tensors); `fix` says what to do."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    shapes = [f"{name} is {list(state_dict[name].shape)} in the checkpoint but {list(tensor.shape)} here"
              for name, tensor in expected.items()
              if isinstance(state_dict.get(name), torch.Tensor) and state_dict[name].shape != tensor.shape]
    problems = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) \
        + ([f"unexpected {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''}"] if unexpected else []) \
        + shapes[:2] + (["..."] if len(shapes) > 2 else [])
    if not problems:
        try:
            model.load_state_dict(state_dict)
            return
        except (RuntimeError, TypeError, ValueError) as e:
            problems = [one_line(e, limit=160)]
    raise CheckpointError(f"the weights in {path} do not fit the model ({'; '.join(problems)}): {fix}")


def model_of(state: dict, path: str | os.PathLike, *, vocab_size: int | None = None) -> Transformer:
    """The model of a loaded checkpoint (train mode, on the CPU, in the precision of its weights): its config
    and weights checked against each other, and against the vocabulary's `vocab_size` when given. The one way
    from a checkpoint to a model (translation, export, evaluation); a one-line CheckpointError otherwise."""
    config = state.get("model_config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} has no model_config: it was not written by this framework's train.py; "
                              "use another checkpoint")
    try:
        model = Transformer(TransformerConfig(**config))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path} has an invalid model_config ({one_line(error, limit=120)}); use another "
                              "checkpoint") from None
    if vocab_size is not None and model.config.vocab_size != vocab_size:
        raise CheckpointError(f"{path}: its model has {model.config.vocab_size} token embeddings but its "
                              f"vocabulary {vocab_size} pieces; the file is inconsistent: use another")
    load_model_state(model, state["model"], path, fix="the file is damaged or foreign: use another checkpoint")
    return model


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint file to translate with, given a .pt file or a run directory.

    In a run directory (or its checkpoints/ folder): averaged.pt when its `step` is at least last.pt's,
    else last.pt; with neither, the newest numbered checkpoint.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (expected a .pt file or a run directory)")
    directory = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    averaged, last = directory / "averaged.pt", directory / "last.pt"
    if averaged.is_file() and last.is_file():
        return averaged if _step_of(averaged) >= _step_of(last) else last
    if averaged.is_file():
        return averaged
    if last.is_file():
        return last
    numbered = _numbered_in(directory)
    if numbered:
        return numbered[-1][1]
    if (directory / "imported.pt").is_file():  # a run directory made by `python -m transformer.hf import`
        return directory / "imported.pt"
    raise CheckpointError(
        f"no checkpoint in {path}: looked for {averaged}, {last} and {directory}/step-*.pt; "
        "pass a run directory that has trained, or a .pt file"
    )


def _step_of(path: Path) -> int:
    """The `step` stored in a checkpoint, read without loading its tensors (memory-mapped)."""
    step = load(path, mmap=True).get("step")
    if not isinstance(step, int):
        raise CheckpointError(f"{path} has no training step; pass the .pt file you want explicitly")
    return step


def latest_resumable(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: last.pt; if it is unreadable, the newest readable numbered one
    (with a warning); None when there is no last.pt (a fresh run).

    Raises CheckpointError when last.pt is unreadable and no numbered checkpoint can replace it: starting
    over silently would overwrite the run.
    """
    last = last_path(run_dir)
    if not last.exists():
        return None
    try:
        load(last, mmap=True)
        return last
    except CheckpointError as e:
        problem = str(e)
    for step, path in reversed(list_numbered(run_dir)):
        try:
            load(path, mmap=True)
        except CheckpointError:
            continue
        log.warning("%s; resuming from %s (step %d) instead", problem, path, step)
        return path
    raise CheckpointError(
        f"{problem}; no readable numbered checkpoint either: delete {checkpoint_dir(run_dir)} to start over "
        "or choose another run_dir"
    )


# ------------------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transformer.checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    avg = commands.add_parser("average", help="average the model weights of several checkpoints")
    avg.add_argument("out", help="the averaged checkpoint to write")
    avg.add_argument("inputs", nargs="*", help="checkpoints to average")
    avg.add_argument("--last", type=int, help="average the newest N numbered checkpoints of --run-dir")
    avg.add_argument("--run-dir", help="the run directory for --last")
    args = parser.parse_args(argv)

    try:
        if args.inputs and (args.last is not None or args.run_dir is not None):
            raise CheckpointError("give either input checkpoints or --last N --run-dir DIR, not both")
        if args.inputs:
            paths = [Path(p) for p in args.inputs]
        elif args.last is not None and args.run_dir is not None:
            if args.last <= 0:
                raise CheckpointError(f"--last must be positive, got {args.last}")
            numbered = list_numbered(args.run_dir)
            if not numbered:
                raise CheckpointError(f"no numbered checkpoints in {checkpoint_dir(args.run_dir)}")
            paths = [path for _, path in numbered[-args.last :]]
            if len(paths) < args.last:
                print(f"warning: only {len(paths)} numbered checkpoints in {args.run_dir}", file=sys.stderr)
        else:
            raise CheckpointError("give input checkpoints, or --last N --run-dir DIR")
        averaged = average(paths)
        save(averaged, args.out)
    except (CheckpointError, WriteError) as e:  # WriteError: a full disk, an unwritable folder
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: the average of steps {', '.join(map(str, averaged['averaged_steps']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
