import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def share_cores_between_workers() -> None:
    """Under pytest-xdist each worker gets its share of the cores as threads (one each on two cores), for itself
    and the processes it starts, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set. Two workers of two threads on
    two cores spend the difference spinning: the decoding, evaluation and core tests took 12 % longer so
    (docs/BENCHMARKS.md). Runs before torch is imported, which reads them once."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and not {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} & set(os.environ):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(max(1, cores // workers))


share_cores_between_workers()
# Imported here, at collection, as the project imports it only where a corpus is read: the library's log handlers
# bind the stderr of the moment they are made, which inside a test would be that test's capture (closed after it).
import datasets  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _restore_root_logger():
    """The entry points point the root logger at the running test's (captured) stderr: put it back after
    every test."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors gain nothing from threads, and on a shared machine spinning threads cost seconds."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------
# Packages of the test extra (pip install -e '.[test]'): interop and packaging tests, skipped without them
# ----------------------------------------------------------------------------------------------------

# The README's test command runs in the environment its install command made, which has the project's
# dependencies only: a test that needs one of these packages declares it (`@pytest.mark.extras(...)`, or
# `import_extra` for a module that imports one at collection) and is skipped with the install line without
# it. TRANSFORMER_REQUIRE_EXTRAS=1 (.ci/run, with the extra installed) turns each skip into a failure, so that
# CI runs these tests rather than skipping them.
EXTRA_INSTALL = "pip install -e '.[test]'"


def _require_extras() -> bool:
    return os.environ.get("TRANSFORMER_REQUIRE_EXTRAS") == "1"


def missing_extras(requirements) -> list[str]:
    """The requirements (e.g. "transformers", "setuptools>=70.1") this environment does not satisfy."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    missing = []
    for text in requirements:
        requirement = Requirement(text)
        try:
            if version(requirement.name) not in requirement.specifier:
                missing.append(f"{text} (found {version(requirement.name)})")
        except PackageNotFoundError:
            missing.append(text)
    return missing


def import_extra(name: str):
    """`import name` for a test module that needs it at collection: skipped (the whole module) without it."""
    import importlib

    if _require_extras() or not missing_extras([name]):
        return importlib.import_module(name)  # required and missing: the ImportError fails the collection
    pytest.skip(f"needs {name}, from the test extra: {EXTRA_INSTALL}", allow_module_level=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "extras(*requirements): needs packages of the test extra ('.[test]'); "
                                       "skipped without them, failed under TRANSFORMER_REQUIRE_EXTRAS=1")


@pytest.fixture(autouse=True)
def _test_extra_packages(request):
    for marker in request.node.iter_markers("extras"):
        missing = missing_extras(marker.args)
        if missing and _require_extras():
            pytest.fail(f"TRANSFORMER_REQUIRE_EXTRAS=1 but {', '.join(missing)} is not installed: {EXTRA_INSTALL}")
        if missing:
            pytest.skip(f"needs {', '.join(missing)}, from the test extra: {EXTRA_INSTALL}")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real WMT sample beside the checkout; skipped when absent, except under CI where it must exist."""
    if not SHARED_DATA.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the real data at {SHARED_DATA} (../shared/data beside the checkout)")
        pytest.skip(f"real WMT sample not found at {SHARED_DATA} (../shared/data beside the checkout)")
    return SHARED_DATA


# ----------------------------------------------------------------------------------------------------
# A tiny trained model, shared by the tests of translate.py and evaluate.py
# ----------------------------------------------------------------------------------------------------

# A made-up language pair: the source is 3-8 words drawn from 24 lowercase "words", the target is the
# same words upper-cased in reverse order (attention must find the mirrored word; SentencePiece splits some
# words in two). A 2+2-layer, d_model=64 model reaches BLEU ~99 on the test split in 1500 updates of ~900
# target tokens: ~40 s of one CPU core.
TINY_WORDS = 24
TINY_LINES = {"train": 20000, "valid": 100, "test": 100}  # 20k: ~10 epochs, learnt, not memorised
TINY_STEPS = 1500
TINY_SAVE_EVERY = 250  # numbered checkpoints at 250, 500, ..., 1500; averaged.pt = mean of the last two


def reversal_pair(words: list[str]) -> tuple[str, str]:
    return " ".join(words), " ".join(w.upper() for w in reversed(words))


def write_reversal_corpus(directory: Path, seed: int = 0) -> dict[str, Path]:
    """{split: prefix} of `<prefix>.en` / `<prefix>.de` files of the reversal task, deterministic in `seed`."""
    import random

    rng = random.Random(seed)
    letters = "abdegiklmnoprstu"
    vocabulary: set[str] = set()
    while len(vocabulary) < TINY_WORDS:
        vocabulary.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 4))))
    words = sorted(vocabulary)
    directory.mkdir(parents=True, exist_ok=True)
    prefixes = {}
    for split, count in TINY_LINES.items():
        pairs = [reversal_pair([rng.choice(words) for _ in range(rng.randint(3, 8))]) for _ in range(count)]
        prefix = directory / split
        prefix.with_suffix(".en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        prefix.with_suffix(".de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
        prefixes[split] = prefix
    return prefixes


@dataclass(frozen=True)
class TinyRun:
    """A finished training run on the reversal task: `run_dir` (checkpoints/step-*.pt, last.pt,
    averaged.pt) and the corpus prefixes (`prefixes["test"]` + ".en" / ".de"). Tests that write into a run
    directory copy it first: under pytest-xdist every worker reads this one."""

    run_dir: Path
    prefixes: dict[str, Path]

    def files(self, split: str) -> tuple[Path, Path]:
        """(source, reference) files of a split."""
        prefix = self.prefixes[split]
        return prefix.with_suffix(".en"), prefix.with_suffix(".de")

    def numbered(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step-{step:08d}.pt"


def session_directory(tmp_path_factory, name: str) -> Path:
    """A directory for what a whole test session builds once: the test run's own under plain pytest; under
    pytest-xdist the same one for every worker of the run (their base temp's parent), so that one worker
    builds it, under a file lock in it, and the others read it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return tmp_path_factory.mktemp(name, numbered=False)
    return tmp_path_factory.getbasetemp().parent / name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The training tests' generated corpus (`helpers.Corpus`): 300 training pairs, 16 validation pairs, a
    400-piece vocabulary and the encoded cache, prepared once a module."""
    from quickstart.corpus import write_corpus
    from helpers import Corpus, train_main

    c = Corpus(tmp_path_factory.mktemp("train_corpus"))
    write_corpus(c.directory / "corpus", train=300, valid=16, test=0, seed=1)
    assert train_main(c.overrides(c.directory / "prep", {"prepare_only": "true"}, vocab=False)) == 0
    assert c.spm_model.is_file()
    return c


@pytest.fixture(scope="module")
def disagreeing_checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Two untrained models of one vocabulary, seeds 1 and 2 (`helpers.SMALL`): they disagree on every one of
    `helpers.DISAGREEING_SOURCES`, in milliseconds."""
    import dataclasses

    from data.vocab import train_vocab
    from helpers import DISAGREEING_SOURCES, SMALL, tiny_model
    from transformer import checkpoint as ckpt

    directory = tmp_path_factory.mktemp("disagreeing")
    vocab = train_vocab(DISAGREEING_SOURCES * 50, None, 300)
    paths = []
    for seed in (1, 2):
        model = tiny_model(seed, random_norms=False, vocab_size=vocab.size, **SMALL)
        paths.append(directory / f"seed{seed}.pt")
        ckpt.save(ckpt.checkpoint_dict(kind="train", step=None, model_config=dataclasses.asdict(model.config),
                                       model=model.state_dict(), spm_model=vocab.model_proto, config=None), paths[-1])
    return paths[0], paths[1]


# Where tiny_run keeps its trained run across pytest sessions of one checkout: .ci/run's two steps (the suite,
# then the tests of the extra) share one training. Unset, each session trains its own. Nothing checks that a
# run trained there still matches the code: set it for the sessions of one checkout, as .ci/run does.
TINY_RUN_DIR = "TRANSFORMER_TEST_TINY_RUN"


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> TinyRun:
    """Train the tiny reversal model once per test run, on two threads: nothing compares its weights with
    another run's (two threads were faster than one, even on a shared 2-core machine). Under
    pytest-xdist the first worker to need it trains it while the others wait on a file lock; with
    $TRANSFORMER_TEST_TINY_RUN set, later sessions read the run trained there. `helpers.train_main` puts back
    what train.py sets for the whole process.
    """
    from filelock import FileLock

    directory = Path(os.environ.get(TINY_RUN_DIR) or session_directory(tmp_path_factory, "tiny_run"))
    directory.mkdir(parents=True, exist_ok=True)
    run_dir, done = directory / "run", directory / "trained"
    with FileLock(directory / "lock"):
        if not done.exists():  # a worker whose training failed leaves no mark: the next one starts afresh
            shutil.rmtree(run_dir, ignore_errors=True)
            train_tiny_run(run_dir, write_reversal_corpus(directory / "corpus"))
            done.touch()
    return TinyRun(run_dir=run_dir, prefixes={split: directory / "corpus" / split for split in TINY_LINES})


def train_tiny_run(run_dir: Path, prefixes: dict[str, Path]) -> None:
    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from helpers import train_main

    overrides = [
        f"run_dir={run_dir}", "device=cpu", "seed=1",
        "data.dataset=null", f"data.train_prefix={prefixes['train']}", f"data.valid_prefix={prefixes['valid']}",
        f"data.test_prefix={prefixes['test']}", "data.src_lang=en", "data.tgt_lang=de", "data.vocab_size=400",
        "data.max_len_ratio=null", "data.num_workers=1",
        "model.d_model=64", "model.heads=4", "model.d_ff=128", "model.encoder_layers=2", "model.decoder_layers=2",
        "model.dropout=0.0",
        "train.max_tokens=1024", "train.tokens_per_update=1024", "train.warmup_steps=100", "train.lr_scale=0.7",
        "train.label_smoothing=0.0",
        f"train.max_steps={TINY_STEPS}", f"train.save_every_steps={TINY_SAVE_EVERY}",
        f"train.valid_every_steps={TINY_STEPS}", "train.valid_bleu_lines=0", "train.best_metric=loss", "train.average_last=2",
        "train.log_every_steps=250", "train.save_every_minutes=0",
    ]
    assert train_main(overrides, threads=min(2, os.cpu_count() or 1)) == 0
    # A stop signal (e.g. SIGTERM from a `timeout` around pytest) ends training early with exit 0; every test
    # of the tiny model would then fail on its quality: say so here instead.
    trained = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)["step"]
    assert trained == TINY_STEPS, f"the tiny model stopped at update {trained} of {TINY_STEPS} (a stop signal?)"
