"""Fine-tuning as a new user meets it: the vocabulary's coverage of a new language (byte fallback, named
characters), init_from taking the architecture, the data checked before a vocabulary is trained, and the
finetune preset's early stop. Training runs use the `corpus` fixture (tests/conftest.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data.errors import DataError  # noqa: E402
from data.vocab import train_vocab  # noqa: E402
from helpers import Corpus, train_main  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.training import finetune  # noqa: E402
from transformer.cli import ConfigError, compose_config, to_job  # noqa: E402
from transformer.training.run_record import print_summary  # noqa: E402


# ------------------------------------------------------------------------------------- fine-tuning


def icelandic(text: str) -> str:
    """The generated English → German-like corpus with letters that an EN-DE vocabulary never saw."""
    return text.replace("th", "þ").replace("d", "ð").replace("a", "á").replace("o", "ö")


def test_coverage_measures_byte_fallback_and_names_the_characters(tmp_path):
    english = ["the dog sees the cat and the bird", "a house is near the old tree"] * 200
    vocab = train_vocab(english, tmp_path / "spm.model", 300, num_threads=1, total=len(english))
    good = finetune.coverage(vocab, vocab.encode(english))
    poor = finetune.coverage(vocab, vocab.encode([icelandic(t) for t in english]))
    assert good.fallback == 0 and good.characters == ()
    assert poor.fallback > finetune.POOR_COVERAGE and {"þ", "ð"} <= set(poor.characters)


def test_missing_valid_prefix_is_reported_before_the_vocabulary_is_trained(corpus, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(DataError, match=r"data.valid_prefix is not set"):
        train_main(corpus.overrides(run_dir, {"data.valid_prefix": "null", "data.cache_dir": tmp_path / "cache"},
                                    vocab=False))
    assert not (run_dir / "spm.model").exists() and not list((tmp_path / "cache").glob("train-*"))


@pytest.fixture(scope="module")
def parent(corpus, tmp_path_factory) -> Path:
    """A 1+1-layer parent with d_model=16 (not the base model's 512), one update."""
    run_dir = tmp_path_factory.mktemp("parent")
    assert train_main(corpus.overrides(run_dir, {"train.max_steps": 1})) == 0
    return run_dir


def child_overrides(corpus: Corpus, run_dir: Path, train_prefix: Path, changes: dict | None = None) -> list[str]:
    """A fine-tuning run's command line as a user types it: no model.* keys."""
    base = corpus.overrides(run_dir, {"data.train_prefix": train_prefix, "data.cache_dir": "null",
                                      "train.max_steps": 1}, vocab=False)
    return [o for o in base if not o.startswith("model")] + [f"{k}={v}" for k, v in (changes or {}).items()]


def test_init_from_takes_the_architecture_and_warns_of_a_poorly_covering_vocabulary(corpus, parent, tmp_path,
                                                                                     capsys):
    icelandic_train = tmp_path / "is" / "train"
    icelandic_train.parent.mkdir()
    for lang in ("en", "de"):
        text = corpus.prefixes["train"].with_suffix(f".{lang}").read_text(encoding="utf-8")
        icelandic_train.with_suffix(f".{lang}").write_text(icelandic(text) if lang == "de" else text,
                                                           encoding="utf-8")
    run_dir = tmp_path / "child"
    assert train_main(child_overrides(corpus, run_dir, icelandic_train, {"init_from": parent})) == 0
    child = ckpt.load(ckpt.last_path(run_dir))
    assert child["model_config"] == ckpt.load(ckpt.last_path(parent))["model_config"]
    assert child["model_config"]["d_model"] == 16
    warning = next(line for line in capsys.readouterr().err.splitlines() if "covers this corpus poorly" in line)
    assert "data.vocab=transfer" in warning and "ð" in warning and "target" in warning
    # An explicit model.* that contradicts the checkpoint is still refused.
    with pytest.raises(ConfigError, match=r"has another architecture \(model.d_model: 16 → 32\): drop those"):
        train_main(child_overrides(corpus, tmp_path / "bad", icelandic_train,
                                   {"init_from": parent, "model.d_model": 32}))


def test_finetune_preset_stops_early_and_the_summary_says_which_checkpoint(capsys):
    job = to_job(compose_config(["experiment=finetune", "init_from=runs/x", "data.dataset=null",
                                 "data.train_prefix=indomain/train", "run_dir=runs/ft"]))
    assert job.train.patience > 0 and job.train.best_metric == "bleu"
    print_summary(job, ["experiment=finetune"])
    err = capsys.readouterr().err
    assert "translate with best.pt (the best validation bleu" in err
    assert "python translate.py checkpoint=runs/ft/checkpoints/best.pt" in err
