"""What a new user meets first (issue #17): device errors, fine-tuning without retyping the architecture,
vocabulary coverage, run directories that do not collide, and the versions and revisions that pin a result.

Training runs use test_train's `corpus` fixture (300 generated pairs, a 1+1-layer d_model=16 model) in this
process; the device errors are read from the raw stderr of the real command lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data import corpus as corpus_module  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.pipeline import DataSettings  # noqa: E402
from data.vocab import train_vocab  # noqa: E402
import test_train  # noqa: E402
from test_train import Corpus, subprocess_env, train_main  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer import cli, finetune  # noqa: E402
from transformer.cli import ConfigError, compose_config  # noqa: E402
from transformer.config import DataConfig, to_job  # noqa: E402
from transformer.training import default_run_name, print_summary, provenance, resolve_run_dir  # noqa: E402

corpus = test_train.corpus  # test_train.py's module-scoped fixture, registered in this module as well
from transformer.translation import write_results  # noqa: E402


def raw_stderr(script: str, *args: str) -> tuple[int, list[str]]:
    """The exit status and the non-empty stderr lines of `python <script> args` (stdin empty)."""
    result = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=subprocess_env(),
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ devices


@pytest.mark.slow
@pytest.mark.parametrize(("script", "device", "expect"), [
    ("translate.py", "gpu", ["device=gpu is not one of", "device=cuda is the GPU"]),
    ("evaluate.py", "gpu", ["device=gpu is not one of", "device=cuda is the GPU"]),
    ("translate.py", "cuda:x", ["device=cuda:x is not one of", "e.g. cuda:0"]),
    ("evaluate.py", "cuda:7", ["device=cuda:7", "device=cpu"]),  # no CUDA here; out-of-range below
    ("translate.py", "mps", ["device=mps", "use device=cpu"]),
])
def test_a_bad_device_is_one_line_on_the_command_lines_raw_stderr(script, device, expect, tmp_path):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS: device=mps translates")
    if device == "cuda:7" and torch.cuda.is_available():
        pytest.skip("with CUDA, test_pick_device_refuses_an_out_of_range_gpu checks the range")
    status, lines = raw_stderr(script, f"checkpoint={tmp_path}", f"device={device}", "hyp=x" if
                               script == "evaluate.py" else "quiet=true")
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ") and "Traceback" not in lines[0]
    for fragment in expect:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "expect"), [
    ("translate.py", ["runs/quickstart"], ["'runs/quickstart' is not a key=value override", "write checkpoint=runs/quickstart"]),
    ("translate.py", ["checkpoint=x", "decode.beams=5"], ["'decode.beams': translate.py has no such key",
                                                           "TranslateJob", "python translate.py --help"]),
    ("evaluate.py", ["hyp=x", "train.max_steps=5"], ["'train.max_steps': evaluate.py has no such key", "EvaluateJob"]),
])
def test_a_bare_path_or_an_unknown_key_names_the_fix_on_raw_stderr(script, args, expect):
    status, lines = raw_stderr(script, *args)
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in expect:
        assert fragment in lines[0], lines[0]


def test_pick_device_refuses_an_out_of_range_gpu_and_mps_for_training(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"device=cuda:2 but this machine has 2 CUDA device\(s\) \(cuda:0 to "
                                          r"cuda:1\): choose one of them"):
        cli.pick_device("cuda:2")
    with pytest.raises(ConfigError, match="device=mps is not supported for training .* use device=cpu"):
        cli.pick_device("mps", training=True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device=mps but this torch has no MPS device .* use device=cpu"):
        cli.pick_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert cli.pick_device("mps") == torch.device("mps")  # decoding on Apple silicon (untested: no such machine)


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


# --------------------------------------------------------------------------------- run directories


def test_default_run_dir_names_the_corpus_and_the_language_pair():
    def run_dir(*overrides: str) -> str:
        cfg = compose_config(list(overrides))
        return str(resolve_run_dir(to_job(cfg), cfg))

    assert run_dir("experiment=paper_base_en_de") == "runs/paper_base_en_de-wmt14-en-de"
    assert run_dir("experiment=paper_base_en_fr") == "runs/paper_base_en_fr-wmt14-en-fr"
    mine = ("data.dataset=null", "data.train_prefix=corpus/train", "data.tgt_lang=it")
    assert run_dir(*mine) == "runs/base-corpus_train-en-it"
    assert run_dir(*mine[:2], "data.tgt_lang=fr") != run_dir(*mine)
    assert run_dir("data.dataset=null", "data.train_prefix=other/train", "data.tgt_lang=it") != run_dir(*mine)
    assert default_run_name("base", DataConfig(dataset="../shared/data/wmt14/", subset="de-en")) == "base-wmt14-en-de"


def test_a_run_dir_refuses_another_valid_set_and_another_run_without_a_checkpoint(corpus, tmp_path):
    run_dir = tmp_path / "run"
    assert train_main(corpus.overrides(run_dir, {"train.max_steps": 1})) == 0
    other_valid = {"data.valid_prefix": corpus.prefixes["train"]}
    with pytest.raises(ConfigError, match=r"run_dir holds a different run \(data.valid_prefix: .*valid' → .*train'"):
        train_main(corpus.overrides(run_dir, other_valid))
    # A run that wrote its config but no checkpoint yet (stopped before its first save):
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    saved = OmegaConf.load(run_dir / "config.yaml")
    saved.data.train_prefix = str(tmp_path / "elsewhere" / "train")
    OmegaConf.save(saved, fresh / "config.yaml")
    with pytest.raises(ConfigError, match=r"run_dir holds another run that has no checkpoint yet "
                                          r"\(data.train_prefix: .*elsewhere/train' → "):
        train_main(corpus.overrides(fresh, {"run_dir": fresh}))
    assert not ckpt.last_path(fresh).exists()


# ------------------------------------------------------------------------------------ reproducibility


def test_data_revision_pins_the_hub_dataset_and_is_recorded(monkeypatch, tmp_path):
    settings = DataSettings.from_config(DataConfig(dataset="wmt/wmt14", subset="de-en", revision="abc123"))
    source = settings.source("train")
    assert source.revision == "abc123"
    seen = {}

    def load_dataset(path, subset, **kwargs):
        seen.update(kwargs, path=path)
        raise ConnectionError("offline")

    monkeypatch.setattr(corpus_module.datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(corpus_module.datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError):
        corpus_module.load(source, cache_dir=tmp_path)
    assert seen == {"path": "wmt/wmt14", "revision": "abc123"}
    hashes = corpus_module.FileHashes(tmp_path / "h.json")
    unpinned = DataSettings.from_config(DataConfig(dataset="wmt/wmt14", subset="de-en")).source("train")
    assert corpus_module.identity(source, hashes) != corpus_module.identity(unpinned, hashes)  # its own cache
    record = provenance(world_size=1, update_freq=1, max_tokens=1, argv=[],
                        data=DataConfig(dataset="wmt/wmt14", subset="de-en", revision="abc123"))
    assert record["data"]["revision"] == "abc123" and record["data"]["dataset"] == "wmt/wmt14"
    with pytest.raises(ConfigError, match="data.revision=abc pins a hub dataset, but data.dataset is null"):
        DataConfig(dataset=None, train_prefix="x/train", revision="abc")


def test_every_evaluation_output_records_the_package_versions(tmp_path):
    import sacrebleu

    write_results(tmp_path, ["a"], {"scores": {}})
    versions = json.loads((tmp_path / "scores.json").read_text())["versions"]
    assert versions["sacrebleu"] == sacrebleu.__version__ and versions["torch"] and versions["sentencepiece"]
