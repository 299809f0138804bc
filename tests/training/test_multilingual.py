"""One model for several language pairs (Johnson et al. 2017): each corpus's sources lead with its target
language's tag; the run's validation pairs carry the main pair's tag; translating needs the target language
(tgt_lang), which puts its tag first, and a model of one pair refuses another language in one line."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from data.config import DataConfig, language_tags
from data.errors import ConfigError
from helpers import run, run_evaluate, write_made_up_french
from transformer import checkpoint as ckpt
from transformer import search
from transformer.decoding import translation
from transformer.decoding.translation import Translator
from transformer.evaluation.testsets import read_lines

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def multilingual_run(corpus, tmp_path_factory):
    """A tiny EN→{DE, FR} model of 3 updates: the generated corpus tagged <2de>, and 60 of its English sentences
    with a made-up French side (each word reversed) tagged <2fr>."""
    root = tmp_path_factory.mktemp("multilingual")
    prefix = write_made_up_french(corpus, root / "fr" / "train")
    valid = root / "fr" / "valid"
    for lang in ("en", "fr"):
        valid.with_suffix(f".{lang}").write_text(prefix.with_suffix(f".{lang}").read_text(encoding="utf-8")
                                                 .split("\n", 12)[12], encoding="utf-8")  # lines 13-60
    run_dir = root / "run"
    run(corpus, run_dir, multilingual_changes(corpus, prefix, valid, steps=3))
    return run_dir


def multilingual_changes(corpus, french, valid, *, steps: int) -> dict:
    """The fixture's run: EN→DE tagged <2de>, the French corpus tagged <2fr> with its validation pairs, BLEU
    validation at update 3, the test split (the corpus's 16 validation pairs) translated at the end."""
    return {"data.spm_model": "null", "data.train_tag": '"<2de>"', "data.temperature": 2,
            "data.extra_train": f'[{{prefix: {french}, src_lang: en, tgt_lang: fr, tag: "<2fr>", '
                                f'valid_prefix: {valid}}}]',
            "train.max_steps": steps, "train.valid_every_steps": 3, "train.valid_bleu_lines": 4,
            "train.best_metric": "bleu", "data.test_prefix": corpus.prefixes["valid"], "train.test_at_end": "true"}


def sources_searched(monkeypatch) -> list[list[int]]:
    """The source ids the next searches receive."""
    seen, original = [], translation.translate_ids

    def spy(model, sources, *args, **kwargs):
        seen.extend(list(s) for s in sources)
        return original(model, sources, *args, **kwargs)

    monkeypatch.setattr(translation, "translate_ids", spy)
    return seen


def test_a_multilingual_model_needs_its_target_language_and_puts_its_tag_first(multilingual_run, monkeypatch):
    with pytest.raises(ConfigError, match=r"multilingual model translating into de, fr, and no tgt_lang is given"):
        Translator.load(multilingual_run, "cpu")
    with pytest.raises(ConfigError, match="tgt_lang=cs is not one of them: give tgt_lang=<one of de, fr>"):
        Translator.load(multilingual_run, "cpu", tgt_lang="cs")
    seen = sources_searched(monkeypatch)
    for lang in ("fr", "de"):
        translator = Translator.load(multilingual_run, "cpu", tgt_lang=lang, beam=1, max_len_b=3)
        tag = translator.vocab.piece_id(f"<2{lang}>")
        assert translator.tgt_lang == lang and translator.source_prefix == [tag]
        seen.clear()
        translator.translate(["a b c", "d e"])
        assert [row[0] for row in seen] == [tag, tag]
        assert sorted(row[1:] for row in seen) == sorted(translator.vocab.encode(["a b c", "d e"]))
        seen.clear()  # an empty line is not searched with its tag alone: it gives an empty line, as for one pair
        assert translator.translate(["", "d e", " "])[::2] == ["", ""] and [r[:1] for r in seen] == [[], [tag], []]


def test_the_validation_sources_of_a_multilingual_run_lead_with_their_pairs_tag(multilingual_run):
    from data.pipeline import prepare
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(multilingual_run / "config.yaml").data)
    assert language_tags(data) == {"de": "<2de>", "fr": "<2fr>"}
    prepared = prepare(data, multilingual_run, splits=("valid",), seed=1, log=lambda m: None)
    tag = prepared.vocab.piece_id("<2de>")
    valid = prepared.valid.dataset
    assert all(ids[0] == tag for ids in valid["src_ids"])
    assert valid["src_ids"][0][1:] == prepared.vocab.encode([valid["src"][0]])[0]
    assert valid["src_len"][0] == len(valid["src_ids"][0])
    french = prepared.splits["valid+1"].dataset  # the EN→FR corpus's own validation pairs, led by <2fr>
    assert len(french) == 48 and all(ids[0] == prepared.vocab.piece_id("<2fr>") for ids in french["src_ids"])
    assert list(prepared.valid_sets(DataConfig(**data))) == [("en", "de"), ("en", "fr")]


def test_the_end_of_training_test_translation_puts_the_main_pairs_tag_first(multilingual_run, corpus, monkeypatch):
    """train.test_at_end decodes the test split with the main pair's tag first (as evaluate.py tgt_lang=de): a
    second run of the fixture's command, one update further, with the search watched."""
    from omegaconf import OmegaConf

    seen = sources_searched(monkeypatch)
    extra = OmegaConf.load(multilingual_run / "config.yaml").data.extra_train[0]
    run(corpus, multilingual_run, multilingual_changes(corpus, extra.prefix, extra.valid_prefix, steps=4))
    tag = Translator.load(multilingual_run, "cpu", tgt_lang="de").source_prefix[0]
    assert len(seen) == 16 and all(ids[0] == tag for ids in seen)  # the test split: the corpus's 16 valid pairs


def test_a_sweep_decodes_into_its_tgt_lang_and_does_not_reuse_another_languages_translations(
        multilingual_run, corpus, tmp_path, capsys, monkeypatch):
    """evaluate.py checkpoints=all tgt_lang=fr, then tgt_lang=de, on one source: each search's sources lead with
    that language's tag, and the German sweep decodes again rather than scoring the cached French translations."""
    run_dir = tmp_path / "run"
    shutil.copytree(multilingual_run, run_dir, ignore=shutil.ignore_patterns("eval"))
    shutil.copy(ckpt.last_path(run_dir), ckpt.numbered_path(run_dir, 3))  # the sweep's one numbered checkpoint
    src, ref = (corpus.prefixes["valid"].with_suffix(f".{lang}") for lang in ("en", "de"))
    seen = sources_searched(monkeypatch)
    for lang in ("fr", "de"):
        seen.clear()
        run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "checkpoints=all", f"tgt_lang={lang}",
                      "decode.beam=1", "decode.max_len_b=3", f"out={tmp_path / lang}"], capsys)
        decoded = json.loads((tmp_path / lang / "checkpoints.json").read_text())["decoded"]
        tag = Translator.load(run_dir, "cpu", tgt_lang=lang).source_prefix[0]
        assert decoded >= 1 and len(seen) == 16 * decoded and all(ids[0] == tag for ids in seen), lang


def test_evaluations_into_two_languages_of_one_test_set_write_apart(multilingual_run, corpus, tmp_path, capsys,
                                                                    monkeypatch):
    """evaluate.py tgt_lang=fr, then tgt_lang=de, with one reference file: run_dir/eval/<set>.fr/ and <set>.de/,
    each with the translations into its language (each search's sources led by its tag), rather than the second
    evaluation's files over the first's; the table's two rows keep the set's own name (its columns name the
    language)."""
    run_dir = tmp_path / "run"
    shutil.copytree(multilingual_run, run_dir, ignore=shutil.ignore_patterns("eval"))
    src, ref = (corpus.prefixes["valid"].with_suffix(f".{lang}") for lang in ("en", "de"))
    seen = sources_searched(monkeypatch)
    for lang in ("fr", "de"):
        seen.clear()
        run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", f"tgt_lang={lang}", "decode.beam=1",
                      "decode.max_len_b=3", "report=false"], capsys)
        translator = Translator.load(run_dir, "cpu", tgt_lang=lang, beam=1, max_len_b=3)
        assert len(seen) == 16 and all(ids[0] == translator.source_prefix[0] for ids in seen), lang
        hypotheses = (run_dir / "eval" / f"{ref.stem}.{lang}" / "hyp.txt").read_text(encoding="utf-8")
        assert hypotheses == "".join(f"{line}\n" for line in translator.translate(read_lines(src))), lang
    assert not (run_dir / "eval" / ref.stem).exists()
    table = (run_dir / "eval" / "table.md").read_text(encoding="utf-8")
    assert table.count(f"| run | {ref.stem} | ") == 2 and f"{ref.stem}.fr" not in table, table  # EN-DE, EN-FR


def test_alignments_and_the_reports_attention_read_the_source_as_it_was_translated(multilingual_run, corpus,
                                                                                  tmp_path, capsys, monkeypatch):
    """translate.py alignment=true and evaluate.py's report run the model on the source it translated: the
    target language's tag first (the alignment's columns then skip the tag: source words only)."""
    import types

    import translate
    from transformer.evaluation import alignment, report

    attended, real = [], alignment.cross_attention

    def spy(model, src_ids, tgt_ids):
        attended.append(list(src_ids))
        return real(model, src_ids, tgt_ids)

    translator = Translator.load(multilingual_run, "cpu", tgt_lang="fr", beam=1, max_len_b=3)
    monkeypatch.setattr(alignment, "cross_attention", spy)
    links = translate.alignment_of(types.SimpleNamespace(alignment_layer=None), translator).align("a b c", "x y z w")
    assert attended[0][0] == translator.source_prefix[0] and attended[0][1:] == translator.vocab.encode(["a b c"])[0]
    assert {j for _, j in links} == {0, 1, 2, 3} and all(0 <= i <= 2 for i, _ in links)
    attended.clear()
    monkeypatch.setattr(report, "cross_attention", spy)
    run_dir = tmp_path / "run"
    shutil.copytree(multilingual_run, run_dir, ignore=shutil.ignore_patterns("eval"))
    src, ref = (corpus.prefixes["valid"].with_suffix(f".{lang}") for lang in ("en", "de"))
    run_evaluate([f"checkpoint={run_dir}", f"src={src}", f"ref={ref}", "tgt_lang=fr", "decode.beam=1",
                  "decode.max_len_b=3", "report=true"], capsys)
    assert attended and all(ids[0] == translator.source_prefix[0] for ids in attended)


def test_a_corpus_translation_into_one_language_is_not_resumed_into_another(multilingual_run, corpus, tmp_path,
                                                                            capsys, monkeypatch):
    """translate.py input= output= keeps its chunks for a resume; chunks into French left by a killed run are
    refused, in one line naming tgt_lang, by the same command into German (joined, they would mix languages)."""
    import translate
    from helpers import user_error

    output = tmp_path / "out.txt"
    args = [f"checkpoint={multilingual_run}", f"input={corpus.prefixes['valid'].with_suffix('.en')}",
            f"output={output}", "device=cpu", "quiet=true", "chunk_lines=4", "decode.beam=1", "decode.max_len_b=3"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # leaves chunks behind, as a killed run would
    assert translate.main([*args, "tgt_lang=fr"]) == 0 and not output.exists()
    monkeypatch.setenv("RANK", "0")
    error = user_error(translate, [*args, "tgt_lang=de"], capsys, monkeypatch)
    assert "holds chunks of another translation (different: tgt_lang)" in error, error
    assert not output.exists()


def test_each_pair_is_validated_and_the_run_keeps_the_best_of_their_mean(multilingual_run):
    """valid/en-de/* and valid/en-fr/* in TensorBoard, each pair's sources led by its own tag; valid/* is their
    mean, which best.pt follows (train.best_metric)."""
    from helpers import tensorboard_scalars

    for key in ("bleu", "nll"):  # after 3 updates BLEU is 0 for both; the NLLs differ
        de, fr = (tensorboard_scalars(multilingual_run, f"valid/{pair}/{key}")[3] for pair in ("en-de", "en-fr"))
        assert tensorboard_scalars(multilingual_run, f"valid/{key}")[3] == pytest.approx((de + fr) / 2)
    assert de != fr


def test_a_multilingual_model_is_not_exported_where_its_tag_would_be_lost(multilingual_run, tmp_path, capsys):
    from transformer import hf

    assert hf.main(["export", str(multilingual_run), str(tmp_path / "exported")]) == 2
    assert "is a multilingual model (into de, fr)" in capsys.readouterr().err
    assert not (tmp_path / "exported").exists()


def test_a_model_of_one_pair_takes_its_own_target_language_or_none(corpus, tmp_path):
    run(corpus, tmp_path / "run", {"train.max_steps": 1})
    assert Translator.load(tmp_path / "run", "cpu", tgt_lang="de").source_prefix == []
    with pytest.raises(ConfigError, match="tgt_lang=fr: .* translates en→de only; give tgt_lang=de or leave it out"):
        Translator.load(tmp_path / "run", "cpu", tgt_lang="fr")


def test_each_target_language_has_one_tag_when_the_main_corpus_is_tagged():
    with pytest.raises(ConfigError, match=r"extra_train\[0\] translates into fr, whose tag is None"):
        DataConfig(train_prefix="x", train_tag="<2de>", extra_train=[{"prefix": "y", "tgt_lang": "fr"}])
    with pytest.raises(ConfigError, match="give it tag: <2de>"):
        DataConfig(train_prefix="x", train_tag="<2de>", extra_train=[{"prefix": "y", "tag": "<BT>"}])


def test_the_czech_preset_extends_the_multilingual_model_and_replays_its_pairs():
    """experiment=multi30k_multilingual_add_cs (docs/MULTILINGUAL.md): from the multilingual preset's run, the
    vocabulary extended, Czech as the main pair with its own tag, German and French replayed at half weight."""
    from transformer.cli import compose_config, to_job

    base, job = (to_job(compose_config([f"experiment={name}"]))
                 for name in ("multi30k_multilingual", "multi30k_multilingual_add_cs"))
    assert job.init_from == base.run_dir and job.data.vocab == "extend"
    tags = language_tags(dataclasses.asdict(job.data))
    assert tags == {"cs": "<2cs>", "de": "<2de>", "fr": "<2fr>"}
    assert {(c.tgt_lang, c.weight) for c in job.data.extra_train} == {("de", 0.5), ("fr", 0.5)}
    assert job.model == base.model and job.data.vocab_size == base.data.vocab_size
    assert job.train.lr_scale == base.train.lr_scale / 2  # chosen on validation (docs/MULTILINGUAL.md)
