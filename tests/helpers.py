"""What several test modules share, defined once: random tiny models and token rows, the generated corpus
of the training tests and how to train on it, and how to run an entry point or a process group.

(`tests/conftest.py` holds the fixtures: `corpus`, `tiny_run`, `one_torch_thread`, ...)
"""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the entry scripts of the checkout
    sys.path.insert(0, str(ROOT))

import evaluate  # noqa: E402
import train  # noqa: E402
import translate  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.cli import main_with_user_errors  # noqa: E402
from transformer.model import Transformer, TransformerConfig  # noqa: E402

PAD, UNK, BOS, EOS = 0, 1, 2, 3
VOCAB = 40  # the random models' vocabulary
TOL = 1e-5


# ---------------------------------------------------------------------------------- random tiny models


SMALL = dict(d_model=16, heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)  # tiny_model(**SMALL): 1+1 layers, width 16
# Sources on which two untrained SMALL models of one vocabulary (conftest's `disagreeing_checkpoints`) disagree.
DISAGREEING_SOURCES = ["the cat sees a dog", "a dog sees the cat", "the small cat sleeps", "dogs see cats"]


def tiny_config(**overrides) -> TransformerConfig:
    """2+2 layers, d_model 32, 4 heads, d_ff 64, vocabulary 40, no dropout; `overrides` change any field."""
    shape = dict(vocab_size=VOCAB, d_model=32, heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=0.0)
    return TransformerConfig(**{**shape, **overrides})


def tiny_model(seed: int = 0, *, random_norms: bool = True, **overrides) -> Transformer:
    """A random `tiny_config(**overrides)` model drawn after `torch.manual_seed(seed)`, in eval mode. Its
    LayerNorms start as the identity; `random_norms` draws their weights and biases too, so that they count
    in comparisons against an independent computation."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    if random_norms:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.LayerNorm):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.5, 0.5)
    return model.eval()


def padded(lengths: list[int], *, first: int | None = None, last: int | None = None, seed: int = 1) -> torch.Tensor:
    """Rows of random ordinary tokens of the given lengths, right-padded with PAD; optionally BOS-first or EOS-last."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.full((len(lengths), max(lengths)), PAD)
    for i, n in enumerate(lengths):
        rows[i, :n] = torch.randint(4, VOCAB, (n,), generator=g)
        if first is not None:
            rows[i, 0] = first
        if last is not None:
            rows[i, n - 1] = last
    return rows


def assert_cached_decoding_matches_full_forward(model, src, tgt_in):
    """Step-by-step decoding with the cache gives the full forward pass's logits at every step; returns the
    last cache."""
    full = model(src, tgt_in)
    encoder_out = model.encode(src)
    cache = model.init_cache(encoder_out)
    for t in range(tgt_in.shape[1]):
        logits, cache = model.decode(tgt_in[:, t : t + 1], encoder_out, cache)
        assert cache.length == t + 1
        assert (logits[:, 0] - full[:, t]).abs().max() <= TOL, f"step {t}"
    return cache


# ------------------------------------------------------------------------ training runs on a generated corpus

D_MODEL = 16  # the training tests' model: 1+1 layers of width 16
PIECES = 400  # their vocabulary: room for 256 byte pieces, the specials and every character (~320 here)


class Corpus:
    """A generated corpus with its vocabulary and encoded cache, and the overrides of a tiny run on it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.prefixes = {"train": directory / "corpus" / "train", "valid": directory / "corpus" / "valid"}
        self.spm_model = directory / "prep" / "spm.model"
        self.cache_dir = directory / "cache"

    def overrides(self, run_dir: Path, changes: dict | None = None, *, vocab: bool = True) -> list[str]:
        values = {
            "run_dir": run_dir, "device": "cpu", "seed": 1,
            "model": "tiny", "model.d_model": D_MODEL, "model.heads": 2, "model.d_ff": 32,
            "model.encoder_layers": 1, "model.decoder_layers": 1, "model.dropout": 0.1,
            "data.dataset": "null", "data.subset": "null",
            "data.train_prefix": self.prefixes["train"], "data.valid_prefix": self.prefixes["valid"],
            "data.vocab_size": PIECES, "data.spm_model": self.spm_model if vocab else "null",
            "data.cache_dir": self.cache_dir, "data.num_workers": 1,
            "train.max_tokens": 512, "train.update_freq": 1, "train.warmup_steps": 4, "train.max_steps": 4,
            "train.log_every_steps": 1, "train.valid_every_steps": 1000, "train.save_every_steps": 1000,
            "train.save_every_minutes": 0, "train.keep_last": 10, "train.average_last": 1,
            "train.valid_bleu_lines": 0, "train.best_metric": "loss",
        }
        values.update(changes or {})
        return [f"{key}={value}" for key, value in values.items()]


def run(corpus: Corpus, run_dir: Path, changes: dict | None = None) -> dict:
    """Train in this process; returns last.pt."""
    assert train_main(corpus.overrides(run_dir, changes)) == 0
    return ckpt.load(ckpt.last_path(run_dir))


def write_made_up_french(corpus: Corpus, prefix: Path, lines: int = 60) -> Path:
    """A corpus of another pair at `prefix`: the first `lines` English sentences of the generated training corpus
    with a made-up French side (each word reversed), as <prefix>.en and <prefix>.fr."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    english = corpus.prefixes["train"].with_suffix(".en").read_text(encoding="utf-8").splitlines()[:lines]
    prefix.with_suffix(".en").write_text("".join(line + "\n" for line in english), encoding="utf-8")
    prefix.with_suffix(".fr").write_text("".join(" ".join(w[::-1] for w in line.split()) + "\n" for line in english),
                                         encoding="utf-8")
    return prefix


class FakeClock:
    """A time.monotonic() that stands still until the run does work: each update, validation and checkpoint
    write moves it on by a fixed number of seconds (`costs`). A train.max_time run on it decides as it would on
    a machine whose work always took exactly those times, whatever this machine's speed or load."""

    def __init__(self, *, update: float, validation: float, save: float, start: float = 1000.0):
        self.now, self.costs = start, {"update": update, "validation": validation, "save": save}

    def __call__(self) -> float:
        return self.now

    def spend(self, kind: str) -> None:
        self.now += self.costs[kind]


def run_on_fake_clock(clock: FakeClock, patch=setattr) -> None:
    """Make train.py's runs in this process read `clock` (`patch`: monkeypatch.setattr in a test, setattr in
    a child process): time.monotonic is replaced, and an update (at its `settle`), a validation (its
    metrics) and a checkpoint write each spend their cost on the clock before they run."""
    import time

    from transformer.training import update, validation

    def spending(kind, function):
        def spend_then_run(*args, **kwargs):
            clock.spend(kind)
            return function(*args, **kwargs)
        return spend_then_run

    patch(time, "monotonic", clock)
    patch(update, "settle", spending("update", update.settle))
    patch(validation, "run_metrics", spending("validation", validation.run_metrics))
    patch(ckpt, "save", spending("save", ckpt.save))


def subprocess_env(*, buffered: bool = False, **extra: str) -> dict:
    """This environment for a child process: offline, one thread, no torchrun variables, `extra` added; stdout
    unbuffered unless `buffered` (as a user's is: what a test of flushing needs, since CI sets
    PYTHONUNBUFFERED).

    One thread is OMP_NUM_THREADS and MKL_NUM_THREADS both: a child that inherits MKL_NUM_THREADS=2 runs its
    float32 matmuls on two MKL threads (another summation order) while `train_main` runs this process's on
    one, and runs compared bit for bit differ (seen with MKL_NUM_THREADS=2 set for the suite)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    env.update(extra)
    if buffered:
        env.pop("PYTHONUNBUFFERED")
    return env


def tiny_run_sources(tiny_run, count: int) -> list[str]:
    """The first `count` source lines of the tiny run's test split."""
    source, _ = tiny_run.files("test")
    return source.read_text(encoding="utf-8").splitlines()[:count]


def translate_py(args: list[str], lines: list[str], capsys, monkeypatch) -> list[str]:
    """translate.py in this process (quiet), the lines on stdin: its stdout lines."""
    stdin = "".join(line + "\n" for line in lines).encode("utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    capsys.readouterr()
    assert translate.main(["device=cpu", "quiet=true", *args]) == 0
    return capsys.readouterr().out.splitlines()


def tensorboard_scalars(run_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def assert_training_states_equal(a: dict, b: dict) -> None:
    """Bit-identical weights, Adam moments and step counts, schedule position and data position."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"model weight {name} differs"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optimizer"]["state"][index][key]), f"optimizer {key} of {index} differs"
    assert a["scheduler"] == b["scheduler"]
    assert a["data_state"] == b["data_state"]


def first_update_gradients(state: dict) -> list[torch.Tensor]:
    """The gradients of a run's first update, in parameter order, read from a checkpoint saved right after
    it: Adam's first moment after one step is (1 - β1)·g (tests/core/test_cuda.py compares GPU with CPU by them)."""
    beta1 = state["optimizer"]["param_groups"][0]["betas"][0]
    moments = state["optimizer"]["state"]
    return [moments[i]["exp_avg"].float().cpu() / (1 - beta1) for i in sorted(moments)]


def train_main(overrides: list[str], *, threads: int = 1) -> int:
    """`train.main(overrides)` in this process at `threads` threads (one: the count torchrun gives each
    rank, so that runs compare bit for bit); then put back what it sets for the whole process: the thread
    count, the SIGTERM/SIGINT handlers (Ctrl-C must still stop pytest) and the root logger's handlers and
    level."""
    signals = (signal.SIGTERM, signal.SIGINT)
    previous_threads, handlers = torch.get_num_threads(), [signal.getsignal(sig) for sig in signals]
    root = logging.getLogger()
    root_handlers, root_level = root.handlers[:], root.level
    torch.set_num_threads(threads)
    try:
        return train.main(overrides)
    finally:
        torch.set_num_threads(previous_threads)
        for sig, handler in zip(signals, handlers):
            signal.signal(sig, handler)
        root.handlers[:] = root_handlers
        root.setLevel(root_level)


# --------------------------------------------------------------------------------- entry points, processes


def output_lines(text: str) -> list[str]:
    """The lines of a program's output: every line ends with "\\n" (none at all is no lines)."""
    assert text == "" or text.endswith("\n"), repr(text[-80:])
    return text.split("\n")[:-1]


def run_translate(args: list[str], capsys, monkeypatch, stdin: bytes | str = b"") -> tuple[list[str], str]:
    """translate.main in this process with `stdin` as standard input: (stdout lines, stderr)."""
    if isinstance(stdin, str):
        stdin = stdin.encode("utf-8")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    capsys.readouterr()
    assert translate.main(["device=cpu", *args]) == 0
    captured = capsys.readouterr()
    return output_lines(captured.out), captured.err


def run_evaluate(args: list[str], capsys) -> list[str]:
    """evaluate.main in this process: its stdout lines (one per metric)."""
    capsys.readouterr()
    assert evaluate.main(["device=cpu", *args]) == 0
    return output_lines(capsys.readouterr().out)


def score_of(line: str) -> float:
    """The score in a sacreBLEU-style result line: `NAME|signature = 34.97 ...`."""
    return float(line.split(" = ", 1)[1].split()[0])


def user_error(module, args: list[str], capsys, monkeypatch) -> str:
    """Run an entry point as its `__main__` does and return its one-line error (exit status 2)."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *args])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a sentence\n"), encoding="utf-8"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main_with_user_errors(module.main)()
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == ""
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
