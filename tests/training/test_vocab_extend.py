"""data.vocab=extend: a trained model's vocabulary grows for a new language. Every old piece keeps its id, string,
score and type, and its embedding row bit for bit; the pieces learned on the new corpus that it lacks are
appended (at most data.extend_pieces), each new row the mean of the old rows that spell it."""

from __future__ import annotations

import pytest
import torch
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from data.vocab import extend_vocab, load_vocab, train_vocab
from helpers import run
from transformer import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CZECHISH = str.maketrans({"a": "á", "e": "ě", "r": "ř", "s": "š", "z": "ž", "c": "č", "u": "ů"})


def pieces_of(vocab) -> list[tuple[str, float, int]]:
    model = model_pb2.ModelProto()
    model.ParseFromString(vocab.model_proto)
    return [(p.piece, p.score, p.type) for p in model.pieces]


def new_language(corpus, directory):
    """The generated corpus with a made-up target language: German with Czech letters (á, ě, ř, š, ž, č, ů)."""
    prefix = directory / "cs" / "train"
    prefix.parent.mkdir(parents=True)
    for split, source in (("train", corpus.prefixes["train"]), ("valid", corpus.prefixes["valid"])):
        target = prefix.with_name(split)
        target.with_suffix(".en").write_text(source.with_suffix(".en").read_text(encoding="utf-8"), encoding="utf-8")
        target.with_suffix(".cs").write_text(source.with_suffix(".de").read_text(encoding="utf-8").translate(CZECHISH),
                                             encoding="utf-8")
    return prefix.with_name("train"), prefix.with_name("valid")


def test_extend_appends_the_lacking_pieces_and_leaves_every_old_one_as_it_was(corpus, tmp_path):
    train, _ = new_language(corpus, tmp_path)
    old = load_vocab(corpus.spm_model)
    lines = train.with_suffix(".cs").read_text(encoding="utf-8").splitlines()
    learned = train_vocab(lines + train.with_suffix(".en").read_text(encoding="utf-8").splitlines(), None, 400,
                          reserved=["<2cs>"])
    extended, added = extend_vocab(old, learned, limit=20, reserved=["<2cs>"])
    before, after = pieces_of(old), pieces_of(extended)
    lacking = [p for p, _, t in pieces_of(learned) if t == 1 and p not in {q for q, _, _ in before}]
    assert after[: len(before)] == before  # ids, strings, scores and types
    assert len(lacking) > 20 and added == 21 and extended.size == old.size + 21 and after[-1][0] == "<2cs>"
    assert [p for p, _, _ in after[len(before):-1]] == lacking[:20]  # in the learned model's (merge) order
    assert len({p for p, _, _ in after}) == len(after)  # no piece twice
    assert all(score < min(s for _, s, t in before if t == 1) for _, score, _ in after[len(before):-1])
    spelled = lambda vocab: sum(len(ids) for ids in vocab.encode(lines[:100]))  # noqa: E731
    assert spelled(extended) < spelled(old)  # the new letters are pieces, no longer bytes
    assert extended.pieces(extended.encode(["x <2cs> y"])[0]).count("<2cs>") == 1


def test_a_model_extended_for_a_new_language_keeps_every_old_row_and_starts_new_ones_from_the_old(corpus, tmp_path):
    """train.py init_from=<run> data.vocab=extend on the new language (the embeddings frozen for the one update,
    so the rows are as initialised): the old rows bit-identical, each new row the mean of the old rows of the
    old vocabulary's spelling of its piece."""
    run(corpus, tmp_path / "old", {"train.max_steps": 2})
    old_state = ckpt.load(ckpt.last_path(tmp_path / "old"))
    train, valid = new_language(corpus, tmp_path)
    run(corpus, tmp_path / "new", {"init_from": tmp_path / "old", "data.vocab": "extend", "data.spm_model": "null",
                                   "data.train_prefix": train, "data.valid_prefix": valid, "data.tgt_lang": "cs",
                                   "data.vocab_size": 400, "data.extend_pieces": 20, "train.max_steps": 1,
                                   "train.freeze": "[embeddings]"})
    new_state = ckpt.load(ckpt.last_path(tmp_path / "new"))
    old_vocab, new_vocab = load_vocab(ckpt.spm_bytes(old_state)), load_vocab(ckpt.spm_bytes(new_state))
    old_rows, new_rows = old_state["model"]["embedding.weight"], new_state["model"]["embedding.weight"]
    assert new_rows.shape[0] == new_vocab.size == old_vocab.size + 20
    assert torch.equal(new_rows[: old_vocab.size], old_rows)
    for row in range(old_vocab.size, new_vocab.size):
        text = new_vocab.pieces([row])[0].replace("▁", " ").strip()
        expected = old_rows[torch.tensor(old_vocab.encode([text])[0])].mean(0)
        assert torch.allclose(new_rows[row], expected, atol=1e-6), new_vocab.pieces([row])
