"""Run directories that do not collide, and what pins a result: the dataset revision, the provenance record,
the package versions of every evaluation output. Training runs use the `corpus`
fixture (tests/conftest.py) in this process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from data import corpus as corpus_module  # noqa: E402
from data.errors import DataError  # noqa: E402
from data.pipeline import source as data_source  # noqa: E402
from helpers import train_main  # noqa: E402
from transformer import checkpoint as ckpt  # noqa: E402
from transformer.cli import ConfigError, compose_config, to_job  # noqa: E402
from transformer.config import DataConfig  # noqa: E402
from transformer.training.run_record import provenance  # noqa: E402
from transformer.training.start import default_run_name, resolve_run_dir  # noqa: E402
from transformer.evaluation.measures import write_results  # noqa: E402


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
    source = data_source(DataConfig(dataset="wmt/wmt14", subset="de-en", revision="abc123"), "train")
    assert source.revision == "abc123"
    seen = {}

    def load_dataset(path, subset, **kwargs):
        seen.update(kwargs, path=path)
        raise ConnectionError("offline")

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)  # data.corpus imports datasets where it reads
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError):
        corpus_module.load(source, cache_dir=tmp_path)
    assert seen == {"path": "wmt/wmt14", "revision": "abc123"}
    hashes = corpus_module.FileHashes(tmp_path / "h.json")
    unpinned = data_source(DataConfig(dataset="wmt/wmt14", subset="de-en"), "train")
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
