"""data/: corpus loading, cleaning, vocabulary, encoding cache, token batching, collation, user errors."""

import re
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data import corpus
from data.batching import BatchStream, TokenArrays, batch_by_size, collate
from data.corpus import CleanReport, HubSource, clean, load, text_source
from data.errors import DataError
from data.pipeline import prepare
from data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab, train_vocab


def data_cfg(**overrides) -> dict:
    cfg = dict(
        src_lang="en", tgt_lang="de", vocab_size=600, spm_model=None,
        dataset=None, subset=None, train_prefix=None, valid_prefix=None, test_prefix=None,
        train_split="train", valid_split="validation", test_split="test",
        vocab_sample=2_000_000, max_len=250, max_len_ratio=1.5, dedup=False, num_workers=1, cache_dir=None,
    )
    cfg.update(overrides)
    return cfg


def write_pair(prefix: Path, src_lines, tgt_lines, src_lang="en", tgt_lang="de") -> Path:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.{src_lang}").write_text("".join(f"{s}\n" for s in src_lines), encoding="utf-8")
    Path(f"{prefix}.{tgt_lang}").write_text("".join(f"{t}\n" for t in tgt_lines), encoding="utf-8")
    return prefix


def head(path: Path, n: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


@pytest.fixture(scope="module")
def small_corpus(shared_data, tmp_path_factory) -> Path:
    """2000 real training pairs and 300 newstest2013 pairs as text files: train.{en,de}, valid.{en,de}."""
    root = tmp_path_factory.mktemp("small_corpus")
    text = shared_data / "text"
    write_pair(root / "train", head(text / "train.en-de.en", 2000), head(text / "train.en-de.de", 2000))
    write_pair(root / "valid", head(text / "newstest2013.en", 300), head(text / "newstest2013.de", 300))
    return root


@pytest.fixture(scope="module")
def vocab(shared_data, tmp_path_factory) -> Vocab:
    """A 1000-piece vocabulary trained on 10k real training sentences (both sides)."""
    text = shared_data / "text"
    sentences = head(text / "train.en-de.en", 5000) + head(text / "train.en-de.de", 5000)
    return train_vocab(sentences, tmp_path_factory.mktemp("vocab") / "spm.model", 1000)


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and message, message
    return message


# ------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("split,prefix", [("validation", "newstest2013"), ("test", "newstest2014.en-de"),
                                          ("train", "train.en-de")])
def test_hf_layout_and_text_prefixes_give_identical_pairs(shared_data, tmp_path, split, prefix):
    hub = load(HubSource(str(shared_data / "wmt14"), "de-en", split, "en", "de"), cache_dir=tmp_path)
    text = load(text_source(shared_data / "text" / prefix, "en", "de"), cache_dir=tmp_path)
    assert hub.column_names == text.column_names == ["src", "tgt"]
    assert len(hub) == len(text) > 0
    assert hub.data.column("src").equals(text.data.column("src"))
    assert hub.data.column("tgt").equals(text.data.column("tgt"))


def test_source_and_target_follow_the_configured_direction(shared_data, tmp_path):
    en_de = load(HubSource(str(shared_data / "wmt14"), "de-en", "validation", "en", "de"), cache_dir=tmp_path)
    de_en = load(HubSource(str(shared_data / "wmt14"), "de-en", "validation", "de", "en"), cache_dir=tmp_path)
    assert en_de[0]["src"] == de_en[0]["tgt"] == "A Republican strategy to counter the re-election of Obama"


def test_text_lines_end_at_newline_only(tmp_path):
    prefix = tmp_path / "t"
    Path(f"{prefix}.en").write_bytes("\ufeffa\u2028b\r\nc\x0cd\nlast".encode())
    Path(f"{prefix}.de").write_bytes(b"x\ny\nz")
    ds = load(text_source(prefix, "en", "de"), cache_dir=tmp_path / "cache")
    assert ds["src"][:] == ["a\u2028b", "c\x0cd", "last"]
    assert ds["tgt"][:] == ["x", "y", "z"]


# ------------------------------------------------------------------------------------------ cleaning
def test_cleaning_counts_what_each_filter_removes(tmp_path):
    src = ["  keep me  ", "", "one two three four five six", "a b c d", "short", "keep me", "ok ok"]
    tgt = ["behalte mich", "leer", "eins zwei drei vier fünf sechs", "a", " ", "behalte mich", "ok ok"]
    ds = load(text_source(write_pair(tmp_path / "c", src, tgt), "en", "de"), cache_dir=tmp_path / "cache")
    kept, report = clean(ds, max_len=5, max_len_ratio=1.5, dedup=True)
    assert report == CleanReport(read=7, empty=2, too_long=1, ratio=1, duplicates=1)
    assert report.kept == len(kept) == 2
    assert kept["src"][:] == ["  keep me  ", "ok ok"]  # stripped when encoded, not here


def test_cleaning_with_filters_off_keeps_every_line(tmp_path):
    ds = load(text_source(write_pair(tmp_path / "c", ["", "a b c d"], ["x", "y"]), "en", "de"),
              cache_dir=tmp_path / "cache")
    kept, report = clean(ds, max_len=None, max_len_ratio=None, dedup=False, drop_empty=False)
    assert len(kept) == 2 and report.kept == 2


# ------------------------------------------------------------------------------------------ vocabulary
def test_vocabulary_has_fixed_special_ids(vocab):
    sp = spm.SentencePieceProcessor(model_proto=vocab.model_proto)
    assert (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert vocab.size == 1000


def test_decode_encode_reproduces_normalised_newstest2013(shared_data, vocab):
    for lang in ("en", "de"):
        lines = (shared_data / "text" / f"newstest2013.{lang}").read_text(encoding="utf-8").splitlines()
        assert len(lines) == 3000
        ids = vocab.encode(lines)
        assert all(UNK_ID not in seq for seq in ids)
        assert vocab.decode(ids) == vocab.normalize(lines)
        # nmt_nfkc only folds compatibility characters and whitespace: most lines come back verbatim
        assert sum(a == b for a, b in zip(vocab.decode(ids), lines)) > 2900


def test_byte_fallback_encodes_unseen_characters(vocab):
    text = ["日本語 😀 Ωmega 𝔘ñí", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629"]
    ids = vocab.encode(text)
    assert all(UNK_ID not in seq for seq in ids)
    assert vocab.decode(ids) == vocab.normalize(text)


def test_vocabulary_round_trips_through_bytes(vocab, tmp_path):
    again = Vocab.from_bytes(vocab.model_proto)
    assert again.sha256 == vocab.sha256 == Vocab.load(vocab.model_proto).sha256
    vocab.save(tmp_path / "v.model")
    assert Vocab.load(tmp_path / "v.model").encode(["Hallo Welt"]) == vocab.encode(["Hallo Welt"])


def test_spm_model_with_other_special_ids_is_rejected(tmp_path, shared_data):
    lines = head(shared_data / "text" / "train.en-de.en", 2000)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "other"),
                                   vocab_size=500, model_type="bpe", minloglevel=2)  # unk=0 bos=1 eos=2
    with pytest.raises(DataError, match="pad=0 unk=1 bos=2 eos=3") as error:
        Vocab.load(tmp_path / "other.model")
    assert str(tmp_path / "other.model") in one_line(error)


def test_unreadable_spm_model_is_a_data_error(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a readable SentencePiece model"):
        Vocab.load(tmp_path / "bad.model")


# ------------------------------------------------------------------------------------------ prepare
def test_prepare_encodes_and_a_second_run_reuses_vocab_and_cache(small_corpus, tmp_path, monkeypatch):
    cfg = data_cfg(train_prefix=str(small_corpus / "train"), valid_prefix=str(small_corpus / "valid"))
    first = prepare(cfg, tmp_path / "run", splits=("train", "valid"), seed=1, log=lambda m: None)
    assert first.vocab_path == tmp_path / "run" / "spm.model" and first.vocab.size == 600
    train, valid = first.train.dataset, first.valid.dataset
    assert len(train) == first.train.report.kept > 1800
    assert len(valid) == 300 and first.valid.report.kept == 300  # valid keeps every line
    assert first.train.src_lengths.tolist() == [len(x) for x in train["src_ids"]]
    row = valid[0]
    assert row["src_ids"] == first.vocab.encode([row["src"]])[0] and row["src_len"] == len(row["src_ids"])
    assert EOS_ID not in row["tgt_ids"] and BOS_ID not in row["tgt_ids"]

    def fail(*args, **kwargs):
        raise AssertionError("re-encoded or retrained")

    monkeypatch.setattr(corpus, "encode", fail)
    monkeypatch.setattr(corpus, "load", fail)
    monkeypatch.setattr("data.pipeline.train_vocab", fail)
    again = prepare(cfg, tmp_path / "run", splits=("train", "valid"), seed=1, log=lambda m: None)
    assert again.vocab.sha256 == first.vocab.sha256
    assert again.train.dataset["tgt_ids"][:] == train["tgt_ids"][:]
    assert again.train.report == first.train.report and again.valid.report == first.valid.report


def test_prepare_from_hf_layout_keeps_text_of_valid_split(shared_data, vocab, tmp_path):
    cfg = data_cfg(dataset=str(shared_data / "wmt14"), subset="de-en", vocab_size=1000)
    vocab.save(tmp_path / "run" / "spm.model")
    out = prepare(cfg, tmp_path / "run", splits=("valid", "test"), seed=1, log=lambda m: None)
    assert len(out.valid.dataset) == 3000 and len(out.test.dataset) == 3003
    assert out.test.dataset[0]["src"] == "Gutach: Increased safety for pedestrians"


def test_stored_vocabulary_is_never_retrained(small_corpus, tmp_path):
    cfg = data_cfg(train_prefix=str(small_corpus / "train"))
    prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    with pytest.raises(DataError, match="never retrained") as error:
        prepare(data_cfg(train_prefix=str(small_corpus / "train"), vocab_size=700), tmp_path / "run",
                splits=("train",), seed=1, log=lambda m: None)
    assert "600 pieces" in one_line(error) and "vocab_size=700" in str(error.value)


def test_the_vocabulary_does_not_depend_on_the_seed_when_the_whole_corpus_is_its_sample(small_corpus, tmp_path):
    """The Multi30k recipe's two members (seed=1, seed=2) train their vocabularies apart, side by side, and are
    decoded as one ensemble, which needs one SentencePiece model: a corpus within data.vocab_sample is read
    whole, so the seed cannot change it. A sampled corpus does depend on the seed (the check can fail)."""
    def vocab_bytes(seed: int, run: str, **overrides) -> bytes:
        cfg = data_cfg(train_prefix=str(small_corpus / "train"), **overrides)
        prepare(cfg, tmp_path / run, splits=("train",), seed=seed, log=lambda m: None)
        return (tmp_path / run / "spm.model").read_bytes()

    assert vocab_bytes(1, "one") == vocab_bytes(2, "two")
    assert vocab_bytes(1, "sampled_one", vocab_sample=1000) != vocab_bytes(2, "sampled_two", vocab_sample=1000)


def test_user_spm_model_is_used_and_stored(small_corpus, vocab, tmp_path):
    vocab.save(tmp_path / "mine.model")
    cfg = data_cfg(train_prefix=str(small_corpus / "train"), spm_model=str(tmp_path / "mine.model"))
    out = prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    assert out.vocab.sha256 == vocab.sha256 == Vocab.load(tmp_path / "run" / "spm.model").sha256


def test_a_lowercase_vocabulary_folds_case_and_a_stored_one_must_match_data_lowercase(small_corpus, vocab, tmp_path):
    """data.lowercase=true trains a vocabulary whose own normalisation folds case (the model reads any case and
    writes lowercase; Multi30k's lcBLEU is scored on lowercased text); a stored or given vocabulary of the other
    kind is a one-line error, not a silent mix."""
    cfg = data_cfg(train_prefix=str(small_corpus / "train"), valid_prefix=str(small_corpus / "valid"), lowercase=True)
    out = prepare(cfg, tmp_path / "run", splits=("train", "valid"), seed=1, log=lambda m: None)
    assert out.vocab.lowercases and not vocab.lowercases
    assert out.vocab.encode(["Der Hund läuft ÜBER die Wiese"]) == out.vocab.encode(["der hund läuft über die wiese"])
    assert out.vocab.decode(out.valid.dataset["tgt_ids"][:20]) == [t.lower() for t in out.valid.dataset["tgt"][:20]]
    with pytest.raises(DataError, match="data.lowercase=false") as error:
        prepare(data_cfg(train_prefix=str(small_corpus / "train")), tmp_path / "run", splits=("train",), seed=1,
                log=lambda m: None)
    assert "folds case" in one_line(error)
    vocab.save(tmp_path / "cased.model")
    with pytest.raises(DataError, match="keeps case but data.lowercase=true"):
        prepare(data_cfg(train_prefix=str(small_corpus / "train"), spm_model=str(tmp_path / "cased.model"),
                         lowercase=True), tmp_path / "other", splits=("train",), seed=1, log=lambda m: None)


def test_changed_corpus_is_encoded_again(tmp_path):
    prefix = write_pair(tmp_path / "c", [f"sentence number {i}" for i in range(400)],
                        [f"Satz Nummer {i}" for i in range(400)])
    cfg = data_cfg(train_prefix=str(prefix), vocab_size=300)
    first = prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    write_pair(prefix, ["sentence number 7"] * 10, ["Satz Nummer 7"] * 10)
    second = prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    assert len(first.train.dataset) == 400 and len(second.train.dataset) == 10


# ------------------------------------------------------------------------------------------ batching
def random_lengths(n=5000, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 120, size=n)
    tgt = np.clip(src + rng.integers(-20, 20, size=n), 1, None)
    return src, tgt


def test_batches_never_exceed_the_token_budget():
    src, tgt = random_lengths()
    batches, skipped = batch_by_size(src, tgt, 1000)
    assert skipped == 0
    for b in batches:
        assert len(b) * max(src[b].max() + 1, tgt[b].max() + 1) <= 1000
    # pairs of similar length: the budget is mostly used, not wasted on padding
    used = sum(len(b) * max(src[b].max() + 1, tgt[b].max() + 1) for b in batches)
    assert used > 0.9 * 1000 * len(batches)


def test_collated_batches_fit_the_budget_as_padded(vocab, tmp_path):
    rng = np.random.default_rng(3)
    words = ["Haus", "Katze", "Weltmeisterschaft", "a", "und", "Überraschung"]
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(300)]
    prefix = write_pair(tmp_path / "c", lines, lines[::-1])
    ds = corpus.encode(load(text_source(prefix, "en", "de"), cache_dir=tmp_path), vocab,
                       cache_file=tmp_path / "enc" / "e.arrow")
    src, tgt = corpus.lengths(ds)
    batches, skipped = batch_by_size(src, tgt, 300)
    assert sum(map(len, batches)) + skipped == 300
    for b in batches:
        batch = collate(TokenArrays.from_dataset(ds), b)
        assert batch.src.shape[0] * max(batch.src.shape[1], batch.tgt_in.shape[1]) <= 300


def test_padding_to_a_multiple_rounds_both_lengths_and_keeps_the_budget(vocab, tmp_path):
    """train.pad_to_multiple=8: every batch's source and target lengths are multiples of 8, the padded size
    (so counted) stays within the budget, the extra positions are padding only (the same pieces, EOS and
    labels as without), and the shapes fall from many to a few."""
    rng = np.random.default_rng(5)
    words = ["Haus", "Katze", "Weltmeisterschaft", "a", "und", "Überraschung"]
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 20))) for _ in range(3000)]
    prefix = write_pair(tmp_path / "c", lines, [line.upper() for line in lines])  # lengths that go together
    ds = corpus.encode(load(text_source(prefix, "en", "de"), cache_dir=tmp_path), vocab,
                       cache_file=tmp_path / "enc" / "e.arrow")
    src, tgt = corpus.lengths(ds)
    tokens = TokenArrays.from_dataset(ds)
    shapes = {}
    for multiple in (1, 8):
        batches, skipped = batch_by_size(src, tgt, 1200, multiple=multiple)
        assert sum(map(len, batches)) + skipped == 3000
        shapes[multiple] = set()
        for b in batches:
            batch, plain = collate(tokens, b, multiple=multiple), collate(tokens, b)
            s, t = batch.src.shape[1], batch.tgt_in.shape[1]
            assert s % multiple == 0 and t % multiple == 0 and batch.src.shape[0] * max(s, t) <= 1200
            assert (batch.src[:, : plain.src.shape[1]] == plain.src).all() and (batch.src[:, plain.src.shape[1]:] == PAD_ID).all()
            assert (batch.tgt_out[:, : plain.tgt_out.shape[1]] == plain.tgt_out).all()
            assert (batch.tgt_out[:, plain.tgt_out.shape[1]:] == PAD_ID).all() and batch.tgt_tokens == plain.tgt_tokens
            shapes[multiple].add((batch.src.shape[0], s, t))
    assert len(shapes[8]) * 3 < len(shapes[1]), (len(shapes[8]), len(shapes[1]))


def test_pair_over_the_budget_is_skipped_and_counted_not_truncated():
    batches, skipped = batch_by_size([3, 50, 4, 9], [3, 2, 60, 9], max_tokens=20)
    assert skipped == 2
    assert sorted(np.concatenate(batches).tolist()) == [0, 3]


def test_every_pair_is_used_once_per_epoch():
    src, tgt = random_lengths(3000)
    stream = BatchStream(src, tgt, max_tokens=700, seed=5, update_freq=3)
    n = len(stream.batches)
    seen = []
    while stream.epoch < 2:
        for _, indices in stream.next_update():
            seen.append(indices)
    assert len(seen) >= 2 * n and n % 3 != 0  # the updates cross epoch boundaries
    assert sorted(np.concatenate(seen[:n]).tolist()) == list(range(3000))
    assert sorted(np.concatenate(seen[n : 2 * n]).tolist()) == list(range(3000))
    assert [b.tolist() for b in seen[:n]] != [b.tolist() for b in seen[n : 2 * n]]  # reshuffled


def test_batch_order_is_shuffled_from_seed_and_epoch():
    src, tgt = random_lengths(3000)
    a = BatchStream(src, tgt, max_tokens=800, seed=1)
    b = BatchStream(src, tgt, max_tokens=800, seed=1)
    c = BatchStream(src, tgt, max_tokens=800, seed=2)
    assert np.array_equal(a.epoch_order(0), b.epoch_order(0))
    assert not np.array_equal(a.epoch_order(0), a.epoch_order(1))
    assert not np.array_equal(a.epoch_order(0), c.epoch_order(0))


def flat(stream: BatchStream, updates: int):
    return [(slot, indices.tolist()) for _ in range(updates) for slot, indices in stream.next_update()]


def test_n_ranks_times_k_passes_consume_the_batches_of_one_rank_times_nk():
    src, tgt = random_lengths(2000)
    single = flat(BatchStream(src, tgt, max_tokens=600, seed=3, world_size=1, rank=0, update_freq=6), updates=20)
    for world, k in [(2, 3), (3, 2), (6, 1)]:
        ranks = [BatchStream(src, tgt, max_tokens=600, seed=3, world_size=world, rank=r, update_freq=k)
                 for r in range(world)]
        dealt = []
        for _ in range(20):
            per_rank = [s.next_update() for s in ranks]
            assert all(len(items) == k for items in per_rank)
            dealt += [(slot, indices.tolist()) for items in per_rank for slot, indices in items]
        assert dealt == single
        assert {r.state_dict()["offset"] for r in ranks} == {ranks[0].state_dict()["offset"]}


def test_updates_cross_the_epoch_boundary_without_partial_updates():
    stream = BatchStream([1] * 10, [1] * 10, max_tokens=2, seed=0, update_freq=4)  # ten one-pair batches
    updates = [stream.next_update() for _ in range(3)]
    assert all(len(u) == 4 for u in updates)
    assert stream.epoch == 1 and stream.offset == 2
    first_epoch = [int(b[0]) for u in updates for _, b in u][:10]
    assert sorted(first_epoch) == list(range(10))


@pytest.mark.parametrize("resume_world,resume_k", [(1, 4), (2, 2)])
def test_resume_from_a_saved_position_continues_with_the_same_batches(resume_world, resume_k):
    src, tgt = random_lengths(2000)
    uninterrupted = flat(BatchStream(src, tgt, max_tokens=700, seed=9, update_freq=4), updates=30)
    first = BatchStream(src, tgt, max_tokens=700, seed=9, update_freq=4)
    before = flat(first, updates=13)  # stops mid-epoch
    state = first.state_dict()
    assert 0 < state["offset"] and state == {"epoch": state["epoch"], "offset": state["offset"],
                                             "batches_per_epoch": len(first.batches), "data": ""}
    resumed = [BatchStream(src, tgt, max_tokens=700, seed=9, world_size=resume_world, rank=r, update_freq=resume_k)
               for r in range(resume_world)]
    for s in resumed:
        s.load_state_dict(dict(state))
    after = []
    for _ in range(17):
        after += [(slot, ix.tolist()) for s in resumed for slot, ix in s.next_update()]
    assert before + after == uninterrupted


def test_restoring_a_position_from_other_batches_is_an_error():
    stream = BatchStream([1, 1], [1, 1], max_tokens=2, seed=0)  # two one-pair batches
    with pytest.raises(DataError, match="batches per epoch"):
        stream.load_state_dict({"epoch": 0, "offset": 1, "batches_per_epoch": 3})


def redrawn(n: int, seed: int = 0):
    """Epoch rows of a mix redrawn each epoch: rows 0 … n/2-1 once, then a fresh draw of half of the rest."""
    def epoch_rows(epoch: int) -> np.ndarray:
        rest = np.random.default_rng([seed, epoch]).choice(np.arange(n // 2, n), size=n // 4, replace=False)
        return np.concatenate([np.arange(n // 2), np.sort(rest)])
    return epoch_rows


def test_a_stream_of_redrawn_epochs_batches_each_epochs_own_rows():
    src, tgt = random_lengths(2000)
    epoch_rows = redrawn(2000)
    stream = BatchStream(src, tgt, max_tokens=700, seed=5, update_freq=3, epoch_rows=epoch_rows)
    dealt = [np.asarray(indices) for _, indices in flat(stream, updates=300)]  # the batches in stream order
    assert stream.epoch >= 3
    for epoch in range(3):
        count = len(stream.batches_in(epoch))
        batches, dealt = dealt[:count], dealt[count:]
        assert sorted(np.concatenate(batches).tolist()) == epoch_rows(epoch).tolist()  # each of its rows once
        assert all(len(b) * (max(src[b].max(), tgt[b].max()) + 1) <= 700 for b in batches)
    assert epoch_rows(0).tolist() != epoch_rows(1).tolist()
    # a pure function of (seed, epoch): a second stream deals the same
    again = BatchStream(src, tgt, max_tokens=700, seed=5, update_freq=3, epoch_rows=epoch_rows)
    assert flat(again, 40) == flat(BatchStream(src, tgt, max_tokens=700, seed=5, update_freq=3,
                                               epoch_rows=epoch_rows), 40)


@pytest.mark.parametrize("resume_world,resume_k", [(1, 4), (2, 2)])
def test_a_redrawn_stream_resumes_and_deals_to_ranks_as_one_rank_would(resume_world, resume_k):
    src, tgt = random_lengths(1500)
    stream = lambda **kw: BatchStream(src, tgt, max_tokens=700, seed=9, epoch_rows=redrawn(1500), **kw)  # noqa: E731
    uninterrupted = flat(stream(update_freq=4), updates=90)  # three epochs and more
    first = stream(update_freq=4)
    before = flat(first, updates=65)  # stops mid-epoch in the third epoch, whose draw has more batches
    state = first.state_dict()
    assert state["epoch"] == 2 and state["offset"] > 0 and state["batches_per_epoch"] == len(first.batches)
    assert state["batches_per_epoch"] != len(first.batches_in(0))  # restored by the saved epoch's own count
    resumed = [stream(world_size=resume_world, rank=r, update_freq=resume_k) for r in range(resume_world)]
    for s in resumed:
        s.load_state_dict(dict(state))
    after = []
    for _ in range(25):
        after += [(slot, ix.tolist()) for s in resumed for slot, ix in s.next_update()]
    assert before + after == uninterrupted


# ------------------------------------------------------------------------------------------ collate
def test_collate_teacher_forcing_shifts_the_target_by_one(vocab, tmp_path):
    prefix = write_pair(tmp_path / "c", ["Hello world", "A much longer sentence than the first one"],
                        ["Hallo Welt", "Ein viel längerer Satz"])
    ds = corpus.encode(load(text_source(prefix, "en", "de"), cache_dir=tmp_path), vocab,
                       cache_file=tmp_path / "enc" / "e.arrow")
    batch = collate(TokenArrays.from_dataset(ds), [1, 0])
    for row, i in enumerate([1, 0]):
        x, y = ds[i]["src_ids"], ds[i]["tgt_ids"]
        assert batch.src[row, : len(x) + 1].tolist() == x + [EOS_ID]
        assert batch.tgt_in[row, : len(y) + 1].tolist() == [BOS_ID] + y
        assert batch.tgt_out[row, : len(y) + 1].tolist() == y + [EOS_ID]
        assert (batch.src[row, len(x) + 1 :] == PAD_ID).all() and (batch.tgt_out[row, len(y) + 1 :] == PAD_ID).all()
        # position t of the decoder input holds label t-1: it never sees the token it predicts
        assert batch.tgt_in[row, 1 : len(y) + 1].tolist() == batch.tgt_out[row, : len(y)].tolist()
    assert batch.tgt_in.shape == batch.tgt_out.shape and batch.src.dtype.is_floating_point is False
    assert batch.src_tokens == int((batch.src != PAD_ID).sum())
    assert batch.tgt_tokens == int((batch.tgt_out != PAD_ID).sum())


# ------------------------------------------------------------------------------------------ bad input
def test_misaligned_files_name_both_files_and_line_counts(tmp_path):
    prefix = write_pair(tmp_path / "m", ["a", "b", "c"], ["x", "y"])
    with pytest.raises(DataError) as error:
        load(text_source(prefix, "en", "de"), cache_dir=tmp_path / "cache")
    message = one_line(error)
    assert f"{prefix}.en has 3 lines" in message and f"{prefix}.de has 2" in message


def test_missing_text_file_names_what_exists(tmp_path):
    write_pair(tmp_path / "p", ["a"], ["b"], tgt_lang="fr")
    with pytest.raises(DataError) as error:
        text_source(tmp_path / "p", "en", "de")
    assert "p.de" in one_line(error) and "p.en, p.fr" in str(error.value)


def test_undecodable_bytes_name_file_and_line(tmp_path):
    prefix = tmp_path / "u"
    Path(f"{prefix}.en").write_bytes(b"fine\nstill fine\nbroken \xff here\n")
    Path(f"{prefix}.de").write_bytes(b"gut\nauch gut\nkaputt\n")
    with pytest.raises(DataError) as error:
        prepare(data_cfg(train_prefix=str(prefix)), tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    assert f"{prefix}.en, line 3: invalid UTF-8" in one_line(error)


def test_missing_language_names_the_languages_that_exist(shared_data, tmp_path):
    with pytest.raises(DataError) as error:
        load(HubSource(str(shared_data / "wmt14"), "de-en", "validation", "en", "fr"), cache_dir=tmp_path)
    assert "language 'fr'" in one_line(error) and "de, en" in str(error.value)


def test_missing_split_names_the_splits_that_exist(shared_data, tmp_path):
    cfg = data_cfg(dataset=str(shared_data / "wmt14"), subset="fr-en", tgt_lang="fr")
    with pytest.raises(DataError) as error:
        prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    assert "split 'train'" in one_line(error) and "validation, test" in str(error.value)


def test_a_split_can_be_a_slice_or_a_sum_in_the_datasets_syntax(shared_data, tmp_path):
    """data.valid_split=validation[:500] validates on newstest2013's first 500 pairs (a shorter validation of a
    big dev set); the syntax is the datasets library's: slices by count or per cent, parts joined by '+'."""
    def pairs(split: str) -> dict[str, list[str]]:
        return load(HubSource(str(shared_data / "wmt14"), "de-en", split, "en", "de"), cache_dir=tmp_path).to_dict()

    whole = pairs("validation")
    head, tail, both = pairs("validation[:500]"), pairs("validation[90%:]"), pairs("validation[:500]+test[:3]")
    assert head == {"src": whole["src"][:500], "tgt": whole["tgt"][:500]}
    assert tail == {"src": whole["src"][2700:], "tgt": whole["tgt"][2700:]}
    assert both["src"] == head["src"] + pairs("test")["src"][:3] and len(both["tgt"]) == 503
    for bad, expect in (("validation[:x]", "'validation[:500]'"), ("valid[:9]", "split 'valid' not found")):
        with pytest.raises(DataError) as error:
            pairs(bad)
        assert expect in one_line(error), str(error.value)


def test_missing_subset_names_the_subsets_that_exist(shared_data, tmp_path):
    with pytest.raises(DataError) as error:
        load(HubSource(str(shared_data / "wmt14"), "cs-en", "train", "en", "cs"), cache_dir=tmp_path)
    assert "cs-en" in one_line(error) and "de-en" in str(error.value) and "fr-en" in str(error.value)


def test_corpus_empty_after_cleaning_says_what_each_filter_removed(tmp_path):
    prefix = write_pair(tmp_path / "e", ["", "one", "a b c d e f g h"], ["leer", "eins zwei drei", "x y z"])
    with pytest.raises(DataError) as error:
        prepare(data_cfg(train_prefix=str(prefix), max_len=5), tmp_path / "run", splits=("train",), seed=1,
                log=lambda m: None)
    message = one_line(error)
    assert "empty after cleaning" in message
    assert "3 pairs read" in message and "1 with an empty side" in message
    assert "1 over max_len" in message and "1 past max_len_ratio" in message


@pytest.mark.parametrize("dataset,train_prefix,expected", [
    ("wmt/wmt14", "corpus/train", "both data.dataset and data.train_prefix are set"),
    (None, None, "neither data.dataset nor data.train_prefix is set"),
])
def test_exactly_one_corpus_source_must_be_set(tmp_path, dataset, train_prefix, expected):
    with pytest.raises(DataError, match=expected) as error:
        prepare(data_cfg(dataset=dataset, train_prefix=train_prefix), tmp_path / "run", seed=1, log=lambda m: None)
    one_line(error)


def test_unreachable_hub_fails_fast_with_one_line(tmp_path):
    start = time.monotonic()
    with pytest.raises(DataError) as error:
        prepare(data_cfg(dataset="wmt/wmt14", subset="de-en"), tmp_path / "run", seed=1, log=lambda m: None)
    assert one_line(error) == corpus.HUB_UNREACHABLE
    assert time.monotonic() - start < 60  # a hang guard: offline, the hub is not waited on (its retries take minutes)


def test_vocabulary_too_large_for_the_corpus_is_a_one_line_error():
    with pytest.raises(DataError, match=r"Vocabulary size too high \(5000\)") as error:
        train_vocab(["a b c", "d e f"] * 10, None, 5000)
    assert "data.vocab_size=5000" in one_line(error)


def test_stream_over_nothing_that_fits_is_a_one_line_error():
    with pytest.raises(DataError, match="longer than train.max_tokens=10") as error:
        BatchStream([30, 40], [20, 50], max_tokens=10, seed=0)
    one_line(error)


@pytest.mark.parametrize("rows_per_read", [7, 100_000])
def test_token_arrays_hold_the_datasets_ids_in_memory_and_memory_mapped(vocab, tmp_path, rows_per_read):
    rng = np.random.default_rng(5)
    words = ["Haus", "Katze", "und", "Überraschung", "x"]
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(60)]
    prefix = write_pair(tmp_path / "c", lines, lines[::-1])
    encoded = corpus.encode(load(text_source(prefix, "en", "de"), cache_dir=tmp_path), vocab,
                            cache_file=tmp_path / "enc" / "e.arrow")
    ds = encoded.select(range(3, 60, 2))  # a view with an indices mapping: its own rows, in its order
    (tmp_path / "flat").mkdir()
    for tokens in (TokenArrays.from_dataset(ds, rows_per_read=rows_per_read),
                   TokenArrays.from_dataset(ds, out=tmp_path / "flat", rows_per_read=rows_per_read)):
        assert len(tokens) == len(ds)
        for i in range(len(ds)):
            for side in ("src", "tgt"):
                offsets, values = getattr(tokens, f"{side}_offsets"), getattr(tokens, side)
                assert values[offsets[i]:offsets[i + 1]].tolist() == ds[i][f"{side}_ids"]
    assert TokenArrays.saved_in(tmp_path / "flat") and not list((tmp_path / "flat").glob("*.tmp"))
    mapped = TokenArrays.load(tmp_path / "flat")
    assert isinstance(mapped.src.base, np.memmap) and not mapped.src.flags.writeable


def test_stream_counts_skipped_pairs_and_collate_moves_to_device(vocab, tmp_path):
    stream = BatchStream([3, 50, 4], [3, 2, 6], max_tokens=20, seed=0)
    assert stream.skipped == 1 and sorted(np.concatenate(stream.batches).tolist()) == [0, 2]
    prefix = write_pair(tmp_path / "c", ["Hello world"], ["Hallo Welt"])
    ds = corpus.encode(load(text_source(prefix, "en", "de"), cache_dir=tmp_path), vocab,
                       cache_file=tmp_path / "enc" / "e.arrow")
    assert collate(TokenArrays.from_dataset(ds), [0], device="cpu").src.device.type == "cpu"


def test_stored_vocabulary_is_used_when_vocab_size_is_null(small_corpus, tmp_path):
    cfg = data_cfg(train_prefix=str(small_corpus / "train"))
    first = prepare(cfg, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    again = prepare({**cfg, "vocab_size": None}, tmp_path / "run", splits=("train",), seed=1, log=lambda m: None)
    assert again.vocab.sha256 == first.vocab.sha256
    with pytest.raises(DataError, match="data.vocab_size is null"):
        prepare({**cfg, "vocab_size": None}, tmp_path / "other", splits=("train",), seed=1, log=lambda m: None)


def test_a_vocabulary_too_small_for_the_characters_names_our_key_not_sentencepieces_flag():
    """SentencePiece's advice ("decrease character_coverage with --character_coverage") names a flag this
    project's config does not have: the error names data.vocab_size and the size that fits instead."""
    texts = ["".join(chr(0x4E00 + (7 * i + j) % 500) for j in range(12)) for i in range(600)]  # 500 characters
    with pytest.raises(DataError) as error:
        train_vocab(texts, None, 300)
    message = str(error.value)
    assert "character_coverage" not in message and "data.vocab_size=300 is too small" in message
    needed = int(re.search(r"at least (\d+)", message)[1])
    assert train_vocab(texts, None, needed).size == needed
