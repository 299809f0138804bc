"""Crash soak: SIGKILL a small training run again and again, resume it each time, and prove that no
checkpoint is ever unreadable and that the final weights are bit-identical to an uninterrupted run.

    python tools/crash_soak.py --kills 20                  # the documented soak (docs/RELIABILITY.md)
    python tools/crash_soak.py --kills 12 --json out.json  # what tests/training/test_reliability.py runs in CI

Kills alternate between random moments (a SIGKILL from this process after a random delay: start-up, a
forward pass, the middle of a checkpoint write, ...) and the named points inside checkpoint writes that
`data.files.CRASH_POINTS` lists, reached through the test-only `TRANSFORMER_CRASH_AT=<point>:<n>`
hook (the run kills itself the n-th time it gets there). After every kill each `.pt` file in
`run_dir/checkpoints` must load and `latest_resumable` must find one; the next run resumes with the same
command. At the end, one run without kills finishes the training, and `last.pt` (weights, Adam state,
schedule, data position), every kept numbered checkpoint, `best.pt` and `averaged.pt` must equal those of
the uninterrupted run bit for bit.

How: this process imports train.py once and forks one child per run (a fork starts in milliseconds, a fresh
interpreter in seconds). The children are ordinary processes that SIGKILL ends with no clean-up, as a node
failure or the kernel's OOM killer would. This process does no torch computation of its own (it only loads
checkpoints to check them; data preparation runs in a child too), which is what makes forking it safe.
Every run uses one thread, so all runs compute in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import train  # noqa: E402
from data import files  # noqa: E402
from data.errors import one_line  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.cli import user_errors  # noqa: E402

CRASH_ENV = "TRANSFORMER_CRASH_AT"


def warm_imports() -> None:
    """Import here, once, what every run would import (the children inherit it): without this a child
    spends seconds importing torch._dynamo (Adam's constructor), datasets and tensorboard. None of these
    imports starts a thread, so forking stays safe."""
    import datasets  # noqa: F401
    import sacrebleu  # noqa: F401
    import torch._dynamo  # noqa: F401
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    import data.batching  # noqa: F401
    import data.pipeline  # noqa: F401


class SoakFailure(AssertionError):
    """A broken promise: an unreadable checkpoint, a resume that failed, or final weights that differ."""


@dataclass
class Kill:
    index: int
    how: str                      # "random" or a crash point of data.files.CRASH_POINTS
    count: int | None = None      # the n-th time the point is reached
    phase: str | None = None      # random: "start-up" (delay from the fork) or "training" (from the first update)
    delay_s: float | None = None
    killed: bool = False          # the SIGKILL landed (False: the run got past the point or the delay)
    resumed_from: int | None = None  # step of the checkpoint the run started from (None: a fresh start)
    last_step_after: int | None = None
    readable: int = 0             # checkpoint files checked after the kill (all loaded)
    temporaries: int = 0          # leftover temporary files of interrupted writes (removed by the next run)


@dataclass
class Report:
    kills: list[Kill] = field(default_factory=list)
    reference_seconds: float = 0.0
    startup_seconds: float = 0.0
    soak_seconds: float = 0.0
    steps: int = 0
    identical: bool = False
    compared: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- children


def start_child(argv: list[str], log_path: Path, crash_at: str | None = None) -> int:
    """Fork a child that runs `train.main(argv)` with its output in `log_path`; returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        if crash_at:
            os.environ[CRASH_ENV] = crash_at
        else:
            os.environ.pop(CRASH_ENV, None)
        torch.set_num_threads(1)
        code = train.main(argv) or 0
    except user_errors() as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        code = 2
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_child(pid: int, should_kill=None) -> int:
    """Wait for the child, SIGKILLing it as soon as `should_kill()` says so; returns the wait status."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if should_kill is not None and should_kill():
            os.kill(pid, signal.SIGKILL)
            return os.waitpid(pid, 0)[1]
        time.sleep(0.002)


class AfterFirstUpdate:
    """True `delay` seconds after the run's log first shows an update line (then training is under way)."""

    def __init__(self, log_path: Path, delay: float):
        self.log_path, self.delay, self.at = log_path, delay, None
        self.seen_at: float | None = None

    def __call__(self) -> bool:
        if self.seen_at is None:
            try:
                seen = "| update " in self.log_path.read_text(errors="replace")
            except OSError:
                seen = False
            if not seen:
                return False
            self.seen_at = time.monotonic()
        return time.monotonic() - self.seen_at >= self.delay


def was_sigkilled(status: int) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def run_to_end(argv: list[str], log_path: Path) -> tuple[float, float]:
    """Run without a kill; returns (seconds until the first update was logged, seconds in all)."""
    started = time.monotonic()
    watch = AfterFirstUpdate(log_path, delay=float("inf"))
    status = wait_child(start_child(argv, log_path), watch)
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        raise SoakFailure(f"run failed (status {status}); its log {log_path} ends:\n{tail(log_path)}")
    ended = time.monotonic()
    return (watch.seen_at or ended) - started, ended - started


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --------------------------------------------------------------------------------------------- checks


def check_readable(run_dir: Path) -> tuple[int, int]:
    """Every checkpoint file loads and there is one to resume from; returns (files loaded, temporaries)."""
    directory = ckpt.checkpoint_dir(run_dir)
    files = sorted(p for p in directory.glob("*.pt")) if directory.is_dir() else []
    for path in files:
        try:
            ckpt.load(path)
        except ckpt.CheckpointError as error:
            raise SoakFailure(f"unreadable checkpoint after a kill: {error}") from None
    try:
        ckpt.latest_resumable(run_dir)
    except ckpt.CheckpointError as error:
        raise SoakFailure(f"nothing to resume from after a kill: {error}") from None
    temporaries = len(list(directory.glob(".*.tmp"))) if directory.is_dir() else 0
    return len(files), temporaries


def differences(a: dict, b: dict, what: str, *, training: bool) -> list[str]:
    """Where two checkpoints differ (empty: bit-identical in everything that training state holds)."""
    out = []
    if a["step"] != b["step"]:
        out.append(f"{what}: step {a['step']} != {b['step']}")
    if a["model"].keys() != b["model"].keys():
        return out + [f"{what}: different parameter names"]
    out += [f"{what}: weight {name} differs" for name in a["model"]
            if not torch.equal(a["model"][name], b["model"][name])]
    if a.get("averaged_steps") != b.get("averaged_steps"):
        out.append(f"{what}: averaged steps {a.get('averaged_steps')} != {b.get('averaged_steps')}")
    if training:
        for key in ("scheduler", "data_state", "best", "stale", "train_tokens"):
            if a[key] != b[key]:
                out.append(f"{what}: {key} {a[key]!r} != {b[key]!r}")
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        if a["optimizer"]["param_groups"] != b["optimizer"]["param_groups"] or sa.keys() != sb.keys():
            out.append(f"{what}: optimizer param groups differ")
        else:
            out += [f"{what}: Adam {key} of parameter {i} differs" for i in sa for key in sa[i]
                    if not torch.equal(sa[i][key], sb[i][key])]
    return out


def compare_runs(reference: Path, soaked: Path) -> list[str]:
    """The checkpoints both runs must hold, compared; returns the names compared. Raises on a difference."""
    ref_numbered = [p.name for _, p in ckpt.list_numbered(reference)]
    soak_numbered = [p.name for _, p in ckpt.list_numbered(soaked)]
    if ref_numbered != soak_numbered:
        raise SoakFailure(f"kept numbered checkpoints differ: {ref_numbered} vs {soak_numbered}")
    names = ["last.pt", "best.pt", "averaged.pt", *ref_numbered]
    problems = []
    for name in names:
        a = ckpt.load(ckpt.checkpoint_dir(reference) / name)
        b = ckpt.load(ckpt.checkpoint_dir(soaked) / name)
        problems += differences(a, b, name, training=a["kind"] == "train")
    if problems:
        raise SoakFailure("the soaked run differs from the uninterrupted one: " + "; ".join(problems[:10]))
    return names


# --------------------------------------------------------------------------------------------- the soak


def run_overrides(data_overrides: list[str], run_dir: Path, steps: int) -> list[str]:
    """A 1+1-layer, d_model=16 model that saves a numbered checkpoint every update (so kills often land in
    checkpoint writes), prunes to 3, averages 2 and validates every 4 updates (best.pt)."""
    return [
        f"run_dir={run_dir}", "device=cpu", "seed=1", "model=tiny", "model.d_model=16", "model.heads=2",
        "model.d_ff=32", "model.encoder_layers=1", "model.decoder_layers=1", "model.dropout=0.1",
        *data_overrides,
        "train.max_tokens=512", "train.update_freq=1", "train.warmup_steps=4", f"train.max_steps={steps}",
        "train.log_every_steps=1", "train.valid_every_steps=4", "train.save_every_steps=1",
        "train.save_every_minutes=0", "train.keep_last=3", "train.average_last=2", "train.valid_bleu_lines=0",
        "train.best_metric=loss",
    ]


def prepare_corpus(workdir: Path) -> list[str]:
    """A generated corpus, its vocabulary and encoded cache (built in a child); the data overrides."""
    from quickstart.corpus import write_corpus

    corpus = workdir / "corpus"
    write_corpus(corpus, train=300, valid=16, test=0, seed=1)
    data = [
        "data.dataset=null", "data.subset=null", f"data.train_prefix={corpus / 'train'}",
        f"data.valid_prefix={corpus / 'valid'}", "data.vocab_size=400", f"data.cache_dir={workdir / 'cache'}",
        "data.num_workers=1",
    ]
    prep = workdir / "prep"
    run_to_end([*run_overrides([*data, "data.spm_model=null"], prep, 1), "prepare_only=true"], workdir / "prep.log")
    return [*data, f"data.spm_model={prep / 'spm.model'}"]


def plan(kills: int, steps: int, rng: random.Random) -> list[tuple[str, int | None]]:
    """Random moments and named points, alternating; every named point at least once when kills >= 2 × points.
    A named point's count n stays small so that the kills spread over the run rather than exhausting it."""
    points = list(files.CRASH_POINTS)
    rng.shuffle(points)
    spread = max(1, steps // max(kills, 1))
    out = []
    for i in range(kills):
        if i % 2 == 0:
            out.append(("random", None))
        else:
            out.append((points[(i // 2) % len(points)], rng.randint(1, spread)))
    return out


def soak(workdir: Path, *, kills: int, seed: int = 0, steps: int | None = None, log=print) -> Report:
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    warm_imports()
    rng = random.Random(seed)
    steps = steps or max(24, 3 * kills)
    report = Report(steps=steps)
    data = prepare_corpus(workdir)

    reference, soaked = workdir / "reference", workdir / "soaked"
    report.startup_seconds, report.reference_seconds = run_to_end(run_overrides(data, reference, steps),
                                                                  workdir / "reference.log")
    update_seconds = (report.reference_seconds - report.startup_seconds) / steps
    log(f"uninterrupted run: {steps} updates in {report.reference_seconds:.1f} s "
        f"({report.startup_seconds:.1f} s to the first update)")
    argv = run_overrides(data, soaked, steps)
    started_soak = time.monotonic()
    schedule = plan(kills, steps, rng)
    attempt = 0
    while sum(k.killed for k in report.kills) < kills:
        if attempt >= 3 * kills:
            raise SoakFailure(f"only {sum(k.killed for k in report.kills)} of {kills} kills landed in "
                              f"{attempt} runs: raise --steps")
        how, count = schedule[attempt % len(schedule)]
        attempt += 1
        kill = Kill(index=attempt, how=how, count=count)
        last = ckpt.last_path(soaked)
        resume = ckpt.latest_resumable(soaked)
        kill.resumed_from = ckpt.load(resume, mmap=True)["step"] if resume is not None else None
        log_path = workdir / f"run-{attempt:03d}.log"
        if kill.resumed_from == steps and how != "random":  # training is over: only start-up remains to hit
            kill.how = how = "random"
            kill.count = count = None
        if how == "random" and (rng.random() < 0.2 or kill.resumed_from == steps):
            kill.phase, kill.delay_s = "start-up", rng.uniform(0.0, report.startup_seconds)
            deadline = time.monotonic() + kill.delay_s
            status = wait_child(start_child(argv, log_path), lambda: time.monotonic() >= deadline)
        elif how == "random":
            # Within the time steps / kills updates take: the kills spread over about half of the run.
            kill.phase, kill.delay_s = "training", rng.uniform(0.0, steps / kills * update_seconds)
            status = wait_child(start_child(argv, log_path), AfterFirstUpdate(log_path, kill.delay_s))
        else:
            status = wait_child(start_child(argv, log_path, crash_at=f"{how}:{count}"))
        kill.killed = was_sigkilled(status)
        if not kill.killed and not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            raise SoakFailure(f"run {attempt} ({how}) failed by itself (status {status}): "
                              f"{log_path}:\n{tail(log_path)}")
        kill.readable, kill.temporaries = check_readable(soaked)
        kill.last_step_after = ckpt.load(last, mmap=True)["step"] if last.exists() else None
        report.kills.append(kill)
        where = f"{how}:{count}" if count else f"random, {kill.phase} +{kill.delay_s:.2f} s"
        outcome = "SIGKILL" if kill.killed else "finished first"
        log(f"run {attempt:3d}  {where:<26} {outcome:<15} from update {kill.resumed_from}  last.pt at "
            f"{kill.last_step_after}  {kill.readable} checkpoints readable, {kill.temporaries} temporaries")

    run_to_end(argv, workdir / "final.log")
    report.soak_seconds = time.monotonic() - started_soak
    leftovers = list(ckpt.checkpoint_dir(soaked).glob(".*.tmp"))
    if leftovers:
        raise SoakFailure(f"temporary files left after the final run: {leftovers}")
    report.compared = compare_runs(reference, soaked)
    report.identical = True
    log(f"{sum(k.killed for k in report.kills)} kills in {len(report.kills)} runs; final run bit-identical to the "
        f"uninterrupted one ({', '.join(report.compared)}); {report.soak_seconds:.0f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs that must land (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--steps", type=int, default=None, help="updates of the run (default max(24, 3 × kills))")
    parser.add_argument("--workdir", type=Path, default=None, help="where runs go (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.workdir is None:
        import tempfile

        args.workdir = Path(tempfile.mkdtemp(prefix="crash_soak-"))
    print(f"work directory: {args.workdir}", flush=True)
    try:
        report = soak(args.workdir, kills=args.kills, seed=args.seed, steps=args.steps,
                      log=lambda line: print(line, flush=True))
    except SoakFailure as failure:
        print(f"FAILED: {failure}", flush=True)
        return 1
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
