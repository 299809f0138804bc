"""Training on several corpora (data.extra_train, data.train_weight): each corpus's pairs weight times an
epoch, tagged sources led by one reserved piece, the vocabulary trained on every corpus with the tags
reserved, and a resume that continues exactly, and only on the same mix.
"""

import numpy as np
import pytest

from data.config import language_tags
from data.errors import DataError
from data.pipeline import prepare
from data.vocab import load_vocab
from helpers import PIECES, assert_training_states_equal, run, train_main, write_made_up_french
from transformer import checkpoint as ckpt


@pytest.fixture()
def extra_corpus(corpus, tmp_path):
    """A second corpus: 40 pairs of the training corpus, each side reversed word by word (stands for
    back-translations)."""
    prefix = tmp_path / "bt" / "synthetic"
    prefix.parent.mkdir()
    for lang in ("en", "de"):
        lines = corpus.prefixes["train"].with_suffix(f".{lang}").read_text(encoding="utf-8").splitlines()[:40]
        prefix.with_suffix(f".{lang}").write_text("".join(" ".join(line.split()[::-1]) + "\n" for line in lines),
                                                 encoding="utf-8")
    return prefix


def data_cfg(corpus, cache_dir, **changes) -> dict:
    return {"dataset": None, "train_prefix": str(corpus.prefixes["train"]), "valid_prefix": str(corpus.prefixes["valid"]),
            "vocab_size": PIECES, "num_workers": 1, "cache_dir": str(cache_dir), **changes}


def rows(split, side: str, epoch: int = 0) -> list[list[int]]:
    """One side of the pairs an epoch trains on: the laid-out rows, or the epoch's draw of a redrawn mix."""
    values, offsets = getattr(split.tokens, side), getattr(split.tokens, f"{side}_offsets")
    laid_out = [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
    return laid_out if split.epoch_rows is None else [laid_out[i] for i in split.epoch_rows(epoch)]


def test_weights_repeat_the_pairs_and_a_tag_leads_every_source_of_its_corpus(corpus, extra_corpus, tmp_path):
    single = prepare(data_cfg(corpus, tmp_path / "cache"), tmp_path / "single", seed=1, splits=("train",))
    mixed = prepare(data_cfg(corpus, tmp_path / "cache", train_weight=2,
                             extra_train=[{"prefix": str(extra_corpus), "weight": 1.5, "tag": "<BT>"}]),
                    tmp_path / "mixed", seed=1, splits=("train",))
    vocab = mixed.vocab
    tag = vocab.piece_id("<BT>")
    assert tag is not None and single.vocab.piece_id("<BT>") is None  # reserved only where a corpus uses it
    assert vocab.pieces(vocab.encode(["x <BT> y"])[0]).count("<BT>") == 1  # never split into pieces

    main = list(zip(*(rows(prepare(data_cfg(corpus, tmp_path / "cache", spm_model=str(mixed.vocab_path)),
                                   tmp_path / "main", seed=1, splits=("train",)).train, side) for side in ("src", "tgt"))))
    n_main, n_extra = len(main), 40
    src, tgt = rows(mixed.train, "src"), rows(mixed.train, "tgt")
    assert len(src) == 2 * n_main + n_extra + n_extra // 2
    assert list(zip(src, tgt))[:2 * n_main] == main + main  # the main corpus twice, untagged
    extra = list(zip(src, tgt))[2 * n_main:]
    assert all(s[0] == tag and tag not in s[1:] for s, _ in extra)
    whole, half = extra[:n_extra], extra[n_extra:]
    assert len(set(map(str, half))) == len(half) and all(pair in whole for pair in half)  # distinct rows, once more
    assert [mixed.train.src_lengths[i] for i in mixed.train.epoch_rows(0)] == [len(s) for s in src]

    # the fraction is drawn afresh each epoch (the whole copies stay): over the epochs every extra pair is read
    later = [list(zip(rows(mixed.train, "src", e), rows(mixed.train, "tgt", e))) for e in range(1, 8)]
    assert all(len(pairs) == len(src) and pairs[:2 * n_main + n_extra] == list(zip(src, tgt))[:2 * n_main + n_extra]
               for pairs in later)
    halves = [pairs[2 * n_main + n_extra:] for pairs in later]
    assert halves[0] != half and all(len(set(map(str, h))) == len(h) and all(p in whole for p in h) for h in halves)
    assert {str(p) for h in [half, *halves] for p in h} == {str(p) for p in whole}

    again = prepare(data_cfg(corpus, tmp_path / "cache2", train_weight=2,
                             extra_train=[{"prefix": str(extra_corpus), "weight": 1.5, "tag": "<BT>"}]),
                    tmp_path / "mixed", seed=1, splits=("train",))
    assert rows(again.train, "src") == src  # the drawn half is a function of the seed
    other_seed = prepare(data_cfg(corpus, tmp_path / "cache", spm_model=str(mixed.vocab_path), train_weight=2,
                                  extra_train=[{"prefix": str(extra_corpus), "weight": 1.5, "tag": "<BT>"}]),
                         tmp_path / "other", seed=2, splits=("train",))
    assert rows(other_seed.train, "src")[:-n_extra // 2] == src[:-n_extra // 2]
    assert rows(other_seed.train, "src") != src


def test_a_tag_missing_from_a_given_vocabulary_is_a_one_line_error(corpus, extra_corpus, tmp_path):
    with pytest.raises(DataError) as error:
        prepare(data_cfg(corpus, tmp_path / "cache", spm_model=str(corpus.spm_model),
                         extra_train=[{"prefix": str(extra_corpus), "tag": "<BT>"}]),
                tmp_path / "run", seed=1, splits=("train",))
    message = str(error.value)
    assert "\n" not in message and "data.extra_train[0].tag=<BT> is not a piece of the vocabulary" in message


def mix(extra_corpus, weight=1, extra_weight=2) -> dict:
    return {"data.spm_model": "null", "data.train_weight": weight,
            "data.extra_train": f"[{{prefix: '{extra_corpus}', weight: {extra_weight}, tag: '<BT>'}}]"}


@pytest.mark.parametrize("extra_weight", [2, 1.5])  # whole copies laid out once; a fraction drawn each epoch
def test_a_run_on_several_corpora_resumes_bit_identically_and_records_them(corpus, extra_corpus, tmp_path,
                                                                           extra_weight):
    changes = {**mix(extra_corpus, extra_weight=extra_weight), "train.save_every_steps": 2, "train.max_steps": 5,
               "train.max_tokens": 4096, "train.tokens_per_update": 4096}
    whole = run(corpus, tmp_path / "whole", changes)
    run(corpus, tmp_path / "resumed", {**changes, "train.max_steps": 2})
    resumed = run(corpus, tmp_path / "resumed", changes)
    assert_training_states_equal(resumed, whole)
    assert whole["data_state"]["data"].startswith("train-mix-")
    assert whole["data_state"]["epoch"] >= 1  # the resumed part crossed into the next epoch (its own draw)
    data = whole["config"]["data"]
    assert data["extra_train"] == [{"prefix": str(extra_corpus), "weight": extra_weight, "tag": "<BT>",
                                   "src_lang": None, "tgt_lang": None, "valid_prefix": None}]
    assert load_vocab(ckpt.spm_bytes(whole)).piece_id("<BT>") is not None  # the checkpoint carries the tag


def test_an_epoch_of_a_fractional_mix_trains_on_the_pairs_drawn_for_it(corpus, extra_corpus, tmp_path):
    """train.py batches the rows the mix draws for the epoch (the main corpus and 1.5 × the 40 extra pairs),
    not the corpora as laid out (each once): one epoch's target tokens are those of the drawn pairs."""
    changes = {**mix(extra_corpus, extra_weight=1.5), "train.max_epochs": 1, "train.max_steps": 1000}
    trained = run(corpus, tmp_path / "run", changes)
    assert (trained["data_state"]["epoch"], trained["data_state"]["offset"]) == (1, 0)
    prepared = prepare(data_cfg(corpus, tmp_path / "cache", spm_model=str(tmp_path / "run" / "spm.model"),
                                extra_train=[{"prefix": str(extra_corpus), "weight": 1.5, "tag": "<BT>"}]),
                       tmp_path / "check", seed=1, splits=("train",))
    drawn = prepared.train.epoch_rows(0)
    assert len(drawn) == len(prepared.train.tgt_lengths) + 20
    assert trained["train_tokens"] == int((prepared.train.tgt_lengths[drawn] + 1).sum())  # + EOS each


def test_resuming_on_another_mix_is_a_one_line_error(corpus, extra_corpus, tmp_path):
    run(corpus, tmp_path, {**mix(extra_corpus), "train.max_steps": 1})
    with pytest.raises(DataError) as error:
        train_main(corpus.overrides(tmp_path, {**mix(extra_corpus, weight=1), "data.extra_train":
                                               f"[{{prefix: '{extra_corpus}', weight: 3, tag: '<BT>'}}]"}))
    message = str(error.value)
    assert "\n" not in message and "the corpora, their weights or tags" in message


def test_weighted_rows_are_whole_copies_then_a_seeded_draw():
    from data.pipeline import _weighted_rows

    rows = _weighted_rows(10, 2.3, seed=4, corpus=1)
    assert rows[:20].tolist() == list(range(10)) * 2 and len(rows) == 23 and len(set(rows[20:].tolist())) == 3
    assert np.array_equal(rows, _weighted_rows(10, 2.3, seed=4, corpus=1))
    assert _weighted_rows(10, 0.5, seed=4, corpus=1).tolist() != _weighted_rows(10, 0.5, seed=4, corpus=2).tolist()
    assert _weighted_rows(10, 0.5, seed=4, corpus=1).tolist() != _weighted_rows(10, 0.5, seed=4, corpus=1,
                                                                               epoch=1).tolist()
    # data.temperature=1 can give a weight of 0.9999999999999999: each pair once, nothing drawn (no redrawn mix)
    from data.config import temperature_weights
    from data.pipeline import _drawn
    weights = temperature_weights([3771604, 3962480], 1.0)
    assert weights[1] < 1 and [_drawn(n, w) for n, w in zip([3771604, 3962480], weights)] == [0, 0]
    assert _weighted_rows(7, weights[1], seed=4, corpus=1).tolist() == list(range(7))


@pytest.fixture()
def french_corpus(corpus, tmp_path):
    """A corpus of another pair: 60 of the training corpus's English sentences with a made-up French side
    (each word reversed), as <prefix>.en and <prefix>.fr."""
    return write_made_up_french(corpus, tmp_path / "fr" / "train")


def test_several_language_pairs_each_led_by_its_target_languages_tag_and_mixed_by_temperature(corpus, french_corpus,
                                                                                               tmp_path):
    """Multilingual training's data (Johnson et al. 2017; Arivazhagan et al. 2019): the main EN→DE corpus
    tagged <2de>, an EN→FR corpus read from <prefix>.en/.fr tagged <2fr>; at temperature T each corpus is
    p_i = n_i^(1/T) / Σ n_j^(1/T) of an epoch of Σ n pairs, counted here by the tags that lead the sources."""
    changes = dict(train_tag="<2de>", extra_train=[{"prefix": str(french_corpus), "tag": "<2fr>", "src_lang": "en",
                                                    "tgt_lang": "fr"}])
    once = prepare(data_cfg(corpus, tmp_path / "cache", **changes), tmp_path / "once", seed=1, splits=("train",))
    vocab = once.vocab
    de, fr = vocab.piece_id("<2de>"), vocab.piece_id("<2fr>")
    assert de is not None and fr is not None and vocab.pieces(vocab.encode(["x <2fr> y"])[0]).count("<2fr>") == 1
    src = rows(once.train, "src")
    n_de, n_fr = sum(s[0] == de for s in src), sum(s[0] == fr for s in src)
    assert n_fr == 60 and n_de + n_fr == len(src)  # no temperature: each corpus once
    french = vocab.encode([" ".join(w[::-1] for w in line.split()) for line in
                           french_corpus.with_suffix(".en").read_text(encoding="utf-8").splitlines()])
    assert [t for s, t in zip(src, rows(once.train, "tgt")) if s[0] == fr] == french  # the .fr side, in order

    hot = prepare(data_cfg(corpus, tmp_path / "cache", temperature=5, spm_model=str(once.vocab_path), **changes),
                  tmp_path / "hot", seed=1, splits=("train",))
    src = rows(hot.train, "src")
    total = n_de + n_fr
    shares = np.array([n_de, n_fr], dtype=float) ** (1 / 5)
    expected = np.round(shares / shares.sum() * total).astype(int)
    assert [sum(s[0] == de for s in src), sum(s[0] == fr for s in src)] == expected.tolist()
    assert expected[1] > 2 * 60  # the small corpus upsampled
    # the large corpus's share (a fraction of it) is drawn afresh each epoch: two epochs, two subsets
    assert expected[0] < n_de and rows(hot.train, "src", 1) != src
    assert sorted(map(str, rows(hot.train, "src", 1))) != sorted(map(str, src))


def test_temperature_with_explicit_weights_and_a_pair_into_itself_are_one_line_errors(corpus, tmp_path):
    with pytest.raises(DataError, match="data.temperature sets every corpus's share"):
        prepare(data_cfg(corpus, tmp_path / "cache", temperature=2, train_weight=2), tmp_path / "r", seed=1,
                splits=("train",))
    with pytest.raises(DataError, match=r"extra_train\[0\] translates de into itself"):
        prepare(data_cfg(corpus, tmp_path / "cache", extra_train=[{"prefix": "x", "src_lang": "de"}]), tmp_path / "r",
                seed=1, splits=("train",))


def test_a_multilingual_run_resumes_bit_identically(corpus, french_corpus, tmp_path):
    """EN→DE and EN→FR in one model, mixed by temperature, stopped after 2 updates and resumed: the same
    weights, optimizer and data position as the run that was never stopped, and its languages kept."""
    changes = {"data.spm_model": "null", "data.train_tag": "'<2de>'", "data.temperature": 2,
               "data.extra_train": f"[{{prefix: '{french_corpus}', tag: '<2fr>', src_lang: en, tgt_lang: fr}}]",
               "train.save_every_steps": 2, "train.max_steps": 5}
    whole = run(corpus, tmp_path / "whole", changes)
    run(corpus, tmp_path / "resumed", {**changes, "train.max_steps": 2})
    resumed = run(corpus, tmp_path / "resumed", changes)
    assert_training_states_equal(resumed, whole)
    assert language_tags(resumed["config"]["data"]) == {"de": "<2de>", "fr": "<2fr>"}
