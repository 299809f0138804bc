"""Search: exact tokens and scores from scripted models, and parity checks on tiny random Transformers.

Expected scores are computed here by hand (math.log and the penalty formulas written out), never with the
functions under test.
"""

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torch import nn

from helpers import SMALL, tiny_model
from transformer import model as model_module
from transformer.search import (Ensemble, SearchWork, Seq2Seq, beam_search, greedy_search, length_penalty,
                                sample_search)

PAD, UNK, BOS, EOS = 0, 1, 2, 3
A, B, C = 4, 5, 6


# --- a scripted model: the next-token distribution is a function of (sentence, generated prefix) -------------

@dataclass(frozen=True)
class ScriptConfig:
    vocab_size: int = 8
    pad_id: int = PAD
    unk_id: int = UNK
    bos_id: int = BOS
    eos_id: int = EOS

    @property
    def target_size(self) -> int:
        return self.vocab_size


class ScriptEncoderOut(NamedTuple):
    out: torch.Tensor        # [B, 1, 1]: the sentence key (first source token), to check row alignment
    src_mask: torch.Tensor   # [B, S]


class PrefixCache:
    def __init__(self, sentence: torch.Tensor, prefix: torch.Tensor, beams: int):
        self.sentence = sentence   # [B*K]: row b*K + k decodes sentence b
        self.prefix = prefix       # [B*K, T] decoder inputs so far, BOS first
        self.beams = beams

    def reorder_beams(self, beams: torch.Tensor) -> "PrefixCache":
        b, k = beams.shape
        assert b * self.beams == self.sentence.size(0) and int(beams.max()) < self.beams
        rows = (torch.arange(b)[:, None] * self.beams + beams).view(-1)
        return PrefixCache(self.sentence.index_select(0, rows), self.prefix.index_select(0, rows), k)

    def select_sentences(self, keep: torch.Tensor) -> "PrefixCache":
        rows = (keep[:, None] * self.beams + torch.arange(self.beams)).view(-1)
        return PrefixCache(self.sentence.index_select(0, rows), self.prefix.index_select(0, rows), self.beams)


class ScriptedModel(nn.Module):
    """next(sentence, prefix) -> {token: probability}; the tokens it does not name share the rest equally.

    `sentence` is the first source token, `prefix` the tuple of generated tokens (no BOS). Logits are the
    log-probabilities, so the model's log_softmax (`log_probs`) gives back the script's numbers.
    """

    def __init__(self, next_probs, vocab_size: int = 8):
        super().__init__()
        self.config = ScriptConfig(vocab_size=vocab_size)
        self.next_probs = next_probs
        self.steps = 0
        self.training_seen = []

    def encode(self, src):
        return ScriptEncoderOut(out=src[:, :1, None].double(), src_mask=src != PAD)

    def init_cache(self, encoder_out, beams=1):
        sentence = encoder_out.out[:, 0, 0].long().repeat_interleave(beams)
        return PrefixCache(sentence, torch.zeros((sentence.size(0), 0), dtype=torch.long), beams)

    def distribution(self, sentence: int, prefix: tuple) -> torch.Tensor:
        named = self.next_probs(sentence, prefix)
        rest = max(0.0, 1.0 - sum(named.values()))
        unnamed = self.config.vocab_size - len(named)
        probs = torch.full((self.config.vocab_size,), rest / unnamed if unnamed else 0.0, dtype=torch.float64)
        for token, p in named.items():
            probs[token] = p
        return probs

    def decode(self, tgt, encoder_out, cache):
        self.steps += 1
        self.training_seen.append(self.training)
        assert cache.sentence.view(-1, cache.beams).unique(dim=1).size(1) == 1, "beams must stay with their sentence"
        full = torch.cat([cache.prefix, tgt], dim=1)
        logits = torch.stack([
            torch.stack([self.distribution(int(cache.sentence[row]), tuple(full[row, 1:pos + 1].tolist())).log()
                         for pos in range(cache.prefix.size(1), full.size(1))])
            for row in range(full.size(0))])
        return logits, PrefixCache(cache.sentence, full, cache.beams)

    def log_probs(self, logits):
        return torch.log_softmax(logits.float(), dim=-1)


def source(*rows):
    """Rows of source pieces -> [B, S]: pieces + EOS, right-padded with PAD."""
    width = max(len(row) for row in rows) + 1
    return torch.tensor([list(row) + [EOS] + [PAD] * (width - len(row) - 1) for row in rows])


def gnmt(length, alpha):
    return ((5 + length) / 6) ** alpha


def assert_hyps(actual, expected, tol=1e-6):
    """expected: per sentence, a list of (tokens, score)."""
    assert [[h.tokens for h in sentence] for sentence in actual] == [[t for t, _ in s] for s in expected]
    for got, want in zip(actual, expected):
        for hyp, (_, score) in zip(got, want):
            assert hyp.score == pytest.approx(score, abs=tol)


# --- length penalty ----------------------------------------------------------------------------------------

def test_length_penalty_follows_gnmt_and_power_formulas():
    assert length_penalty(7, 0.6, "gnmt") == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(7, 0.6, "power") == pytest.approx(7 ** 0.6)
    assert length_penalty(7, 0.0, "gnmt") == 1.0 and length_penalty(7, 0.0, "power") == 1.0
    with pytest.raises(ValueError, match="lenpen_style"):
        length_penalty(3, 0.6, "wu")


def test_unknown_lenpen_style_is_a_value_error():
    model = ScriptedModel(lambda s, p: {EOS: 0.9})
    with pytest.raises(ValueError, match="lenpen_style"):
        beam_search(model, source([A]), lenpen_style="average")
    with pytest.raises(ValueError, match="lenpen_style"):
        greedy_search(model, source([A]), lenpen_style="average")


# --- scripted models: exact tokens and scores ---------------------------------------------------------------

def short_or_long(sentence, prefix):
    """[] ends with p=.5; [A] (p=.4) ends with p=.9; everything else is far worse."""
    return {(): {EOS: 0.5, A: 0.4}, (A,): {EOS: 0.9}}.get(prefix, {EOS: 0.1})


def test_gnmt_keeps_the_early_end_and_power_prefers_the_longer_hypothesis():
    short, long_raw = math.log(0.5), math.log(0.4) + math.log(0.9)
    hyps = beam_search(ScriptedModel(short_or_long), source([C]), beam=2, lenpen=0.6, lenpen_style="gnmt", nbest=2)
    assert_hyps(hyps, [[([], short / gnmt(1, 0.6)), ([A], long_raw / gnmt(2, 0.6))]])
    hyps = beam_search(ScriptedModel(short_or_long), source([C]), beam=2, lenpen=0.6, lenpen_style="power", nbest=2)
    assert_hyps(hyps, [[([A], long_raw / 2 ** 0.6), ([], short / 1 ** 0.6)]])


def test_nbest_lists_finished_hypotheses_best_first():
    def script(sentence, prefix):
        return {(): {A: 0.5, B: 0.3, EOS: 0.2}, (A,): {EOS: 0.6}, (B,): {EOS: 0.7}}.get(prefix, {EOS: 0.1})
    hyps = beam_search(ScriptedModel(script), source([C]), beam=3, lenpen=0.0, nbest=3)
    assert_hyps(hyps, [[([A], math.log(0.5) + math.log(0.6)), ([B], math.log(0.3) + math.log(0.7)),
                        ([], math.log(0.2))]])


def test_early_stop_ends_the_search_once_no_live_beam_can_win():
    # EOS at .9 first; every live beam is at most log(.1/7) and can only fall: one decoder step suffices,
    # although the cap (|src| + 50) would allow 52.
    for lenpen, style in [(0.0, "gnmt"), (0.6, "gnmt"), (0.6, "power")]:
        model = ScriptedModel(lambda s, p: {EOS: 0.9})
        hyps = beam_search(model, source([C]), beam=4, lenpen=lenpen, lenpen_style=style)
        assert_hyps(hyps, [[([], math.log(0.9))]])
        assert model.steps == 1


def test_early_stop_waits_while_the_growing_gnmt_penalty_can_still_lift_a_live_beam():
    # After step 0, [] (log .5) is finished and the live [A] has raw log .45 < log .5; but its end
    # log .45 + log .999 divided by gnmt(2) = 7/6 beats log .5: stopping on raw scores would be wrong.
    def script(sentence, prefix):
        return {(): {EOS: 0.5, A: 0.45}, (A,): {EOS: 0.999}}.get(prefix, {EOS: 0.1})
    hyps = beam_search(ScriptedModel(script), source([C]), beam=2, lenpen=1.0, lenpen_style="gnmt",
                       max_len_a=0, max_len_b=4)
    assert_hyps(hyps, [[([A], (math.log(0.45) + math.log(0.999)) / gnmt(2, 1.0))]])

    # Here even log .4 / gnmt(2) < log .5, yet [A, A] wins at |Y| = 3: the bound must use the penalty at
    # the cap, not at the next length.
    def script(sentence, prefix):
        return {(): {EOS: 0.5, A: 0.4}, (A,): {A: 0.999}, (A, A): {EOS: 0.999}}.get(prefix, {EOS: 0.1})
    hyps = beam_search(ScriptedModel(script), source([C]), beam=2, lenpen=1.0, lenpen_style="gnmt",
                       max_len_a=0, max_len_b=4)
    assert_hyps(hyps, [[([A, A], (math.log(0.4) + 2 * math.log(0.999)) / gnmt(3, 1.0))]])


def test_early_stop_never_changes_the_result_of_running_to_the_cap():
    # Live beams stay close to the finished ones and the gnmt penalty grows quickly (alpha 1.5), so the stop
    # must wait; a beam of 108 >= 27 live beams * 4 allowed tokens is exhaustive, so the answer must be the
    # brute-force best over every sequence the cap allows (emittable: UNK, A, B).
    def script(sentence, prefix):
        return {EOS: 0.3 + 0.1 * (len(prefix) % 2), A: 0.33, B: 0.22}
    model = ScriptedModel(script, vocab_size=6)
    cap, alpha = 4, 1.5
    scored = []
    for n in range(cap + 1):
        for tokens in itertools.product([UNK, A, B], repeat=n):
            raw = sum(math.log(model.distribution(C, tokens[:i])[tokens[i]].item()) for i in range(n))
            raw += math.log(model.distribution(C, tokens)[EOS].item())
            scored.append((list(tokens), raw / gnmt(n + 1, alpha)))
    scored.sort(key=lambda pair: -pair[1])
    hyps = beam_search(model, source([C]), beam=108, nbest=3, lenpen=alpha, lenpen_style="gnmt",
                       max_len_a=0, max_len_b=cap)
    assert_hyps(hyps, [scored[:3]])
    assert model.steps < cap + 1, "the search should have stopped before the cap"


def test_patience_rule_ends_a_sentence_once_enough_hypotheses_have_finished():
    # The exact rule waits for [A]: its end beats [] once divided by gnmt(2). The patience rule ends the
    # sentence after round(beam * patience) finished hypotheses, whatever the live beams could still reach.
    def script(sentence, prefix):
        return {(): {EOS: 0.5, A: 0.45}, (A,): {EOS: 0.999}}.get(prefix, {EOS: 0.1})
    options = dict(beam=2, lenpen=1.0, lenpen_style="gnmt", max_len_a=0, max_len_b=4)
    short, long = ([], math.log(0.5) / gnmt(1, 1.0)), ([A], (math.log(0.45) + math.log(0.999)) / gnmt(2, 1.0))
    model = ScriptedModel(script)
    assert_hyps(beam_search(model, source([C]), stop="patience", patience=0.5, **options), [[short]])
    assert model.steps == 1                                  # one finished hypothesis was enough
    model = ScriptedModel(script)
    assert_hyps(beam_search(model, source([C]), stop="patience", patience=1.0, nbest=2, **options), [[long, short]])
    assert model.steps == 2
    with pytest.raises(ValueError, match="stop must be one of exact, patience"):
        beam_search(model, source([C]), stop="early", **options)


@pytest.mark.parametrize("compact", [True, False])
def test_search_work_counts_rows_steps_and_cap_hits(compact):
    # Sentence C ends at step 0 (EOS .9); sentence A never ranks EOS among its beam's first two candidates
    # (A .9, then the unnamed tokens at .015 each, EOS .01), so it runs to its cap of 2 and ends as [A, A].
    def script(sentence, prefix):
        return {EOS: 0.9} if sentence == C else {A: 0.9, EOS: 0.01}
    work = SearchWork()
    hyps = beam_search(ScriptedModel(script), source([C], [A]), beam=2, lenpen=0.0, max_len_a=0, max_len_b=2,
                       compact=compact, work=work)
    assert [[h.tokens for h in sentence] for sentence in hyps] == [[[]], [[A, A]]]
    # Rows decoded: step 0 one per sentence, then 2 per sentence still in the batch (C leaves after step 0).
    assert work.steps == 3
    assert work.computed == (2 + 2 + 2 if compact else 2 + 4 + 4)
    assert work.open == 2 + 2 + 2
    assert work.useful == (1 + 0) + (1 + 2 * 2)              # 1 + K * |best| per sentence
    assert sorted(work.sentence_steps) == [1, 3] and work.cap_hits == 1


def trained_batches(tiny_run, checkpoint):
    """The tiny reversal model and its 100 test sources as one batch of mixed lengths (3-8 words, in file
    order), ends decided by the model itself."""
    from transformer.decoding.translation import Translator, pad_rows

    translator = Translator.load(checkpoint, device="cpu")
    ids = translator.vocab.encode(tiny_run.files("test")[0].read_text(encoding="utf-8").splitlines())
    eos, pad = translator.model.config.eos_id, translator.model.config.pad_id
    return translator.model, pad_rows((row + [eos] for row in ids), pad, "cpu")


SEARCHES = {
    "beam exact": lambda model, src, **kw: beam_search(model, src, beam=4, nbest=2, **kw),
    "beam patience": lambda model, src, **kw: beam_search(model, src, beam=4, stop="patience", patience=1.0, **kw),
    "greedy": lambda model, src, **kw: greedy_search(model, src, **kw),
    "sampling": lambda model, src, **kw: sample_search(model, src, samples=3, topk=10, seed=7, **kw),
}


@pytest.mark.parametrize("search", list(SEARCHES))
def test_compaction_puts_every_sentence_back_in_its_place(search):
    """A random model on sources of 1-9 tokens: the caps (|src| + 2) end the sentences at different steps, in
    an order unlike the batch's, so sentences leave the batch several times, from its middle too."""
    model = tiny_model(11, random_norms=False, vocab_size=20, **SMALL)
    src = random_source(20, [9, 1, 5, 2, 8, 3, 1, 7, 4, 6, 2, 9], seed=12)
    kept_work, compact_work = SearchWork(), SearchWork()
    kept = SEARCHES[search](model, src, max_len_b=2, compact=False, work=kept_work)
    compacted = SEARCHES[search](model, src, max_len_b=2, compact=True, work=compact_work)
    assert [[h.tokens for h in s] for s in compacted] == [[h.tokens for h in s] for s in kept]
    for c, k in zip(itertools.chain(*compacted), itertools.chain(*kept)):
        assert c.score == pytest.approx(k.score, abs=1e-5)
    assert compact_work.computed < kept_work.computed and compact_work.open == kept_work.open


@pytest.mark.parametrize("search", list(SEARCHES))
@pytest.mark.parametrize("step", [250, None])  # an early checkpoint, whose ends vary more, and the final one
def test_compacting_search_equals_the_loop_that_keeps_every_row(search, step, tiny_run, one_torch_thread):
    model, src = trained_batches(tiny_run, tiny_run.numbered(step) if step else tiny_run.run_dir)
    kept_work, compact_work = SearchWork(), SearchWork()
    kept = SEARCHES[search](model, src, compact=False, work=kept_work)
    compacted = SEARCHES[search](model, src, compact=True, work=compact_work)
    assert [[h.tokens for h in s] for s in compacted] == [[h.tokens for h in s] for s in kept]
    for c, k in zip(itertools.chain(*compacted), itertools.chain(*kept)):
        assert c.score == pytest.approx(k.score, abs=1e-5)
    # Sentences left the batch: fewer rows decoded for the same open ones, steps and sentences alike.
    assert compact_work.computed < kept_work.computed
    assert (compact_work.open, compact_work.useful, compact_work.steps, sorted(compact_work.sentence_steps)) == (
        kept_work.open, kept_work.useful, kept_work.steps, sorted(kept_work.sentence_steps))
    assert compact_work.useful <= compact_work.open <= compact_work.computed


@pytest.mark.parametrize("search", ["beam exact", "greedy"])
def test_encoding_in_groups_changes_no_search_result(search, tiny_run, one_torch_thread, monkeypatch):
    """The 100 test sources, encoded by the search in groups of similar length (model.ENCODE_GROUP) and as one
    padded batch: the same hypotheses, scores equal to rounding."""
    model, src = trained_batches(tiny_run, tiny_run.run_dir)
    grouped = SEARCHES[search](model, src)
    monkeypatch.setattr(model_module, "ENCODE_GROUP", src.shape[0])  # one group: the whole padded batch
    whole = SEARCHES[search](model, src)
    assert [[h.tokens for h in s] for s in grouped] == [[h.tokens for h in s] for s in whole]
    for g, w in zip(itertools.chain(*grouped), itertools.chain(*whole)):
        assert g.score == pytest.approx(w.score, abs=1e-5)


def test_decoder_state_follows_beams_that_change_rank():
    # Step 0 ranks A over B; step 1 ranks B's child first, so row 0 must take over row 1's state (the
    # scripted cache holds the prefix, and the script only finishes well after [B, B]).
    def script(sentence, prefix):
        return {(): {A: 0.5, B: 0.4}, (A,): {A: 0.3, B: 0.3}, (B,): {B: 0.9},
                (B, B): {EOS: 0.9}}.get(prefix, {EOS: 0.01})
    hyps = beam_search(ScriptedModel(script), source([C]), beam=2, lenpen=0.0, max_len_a=0, max_len_b=3)
    assert_hyps(hyps, [[([B, B], math.log(0.4) + 2 * math.log(0.9))]])


def test_beam_of_one_finishes_only_its_best_candidate_like_greedy():
    # EOS ranks second at step 0 and would win if it counted; only EOS among the first `beam` candidates
    # finishes a hypothesis (as in fairseq), so beam 1 walks the greedy path.
    def script(sentence, prefix):
        return {(): {A: 0.5, EOS: 0.4}, (A,): {B: 0.5, EOS: 0.1}, (A, B): {EOS: 0.3}}.get(prefix, {EOS: 0.1})
    expected = [[([A, B], 2 * math.log(0.5) + math.log(0.3))]]
    assert_hyps(greedy_search(ScriptedModel(script), source([C])), expected)
    assert_hyps(beam_search(ScriptedModel(script), source([C]), beam=1, lenpen=0.0), expected)


def test_min_len_forbids_eos_without_renormalising():
    def script(sentence, prefix):
        return {EOS: 0.6, A: 0.3, B: 0.1}
    expected = [[([A, A], 2 * math.log(0.3) + math.log(0.6))]]
    assert_hyps(greedy_search(ScriptedModel(script), source([C]), min_len=2), expected)
    assert_hyps(beam_search(ScriptedModel(script), source([C]), beam=2, lenpen=0.0, min_len=2), expected)
    assert_hyps(greedy_search(ScriptedModel(script), source([C]), min_len=0), [[([], math.log(0.6))]])


def long_runs(sentence, prefix):
    """A is always likely; EOS is nearly impossible before two tokens and unlikely after."""
    return {A: 0.97, EOS: 1e-6 if len(prefix) < 2 else 0.02}


@pytest.mark.parametrize("max_len_a, max_len_b, caps", [(1, 1, [2, 4]), (2, 0, [2, 6]), (0.5, 1, [1, 2])])
def test_length_cap_forces_eos_per_sentence(max_len_a, max_len_b, caps):
    src = source([C], [B, B, B])  # |src| = 1 and 3 in one batch
    model = ScriptedModel(long_runs)

    def capped(cap):
        return [A] * cap, cap * math.log(0.97) + math.log(1e-6 if cap < 2 else 0.02)

    hyps = greedy_search(model, src, max_len_a=max_len_a, max_len_b=max_len_b)
    assert_hyps(hyps, [[capped(cap)] for cap in caps])
    # The cap wins over min_len.
    hyps = greedy_search(model, src, max_len_a=max_len_a, max_len_b=max_len_b, min_len=10)
    assert_hyps(hyps, [[capped(cap)] for cap in caps])
    # Beam search with a power penalty prefers the longest allowed; no n-best entry passes the cap.
    hyps = beam_search(model, src, beam=3, nbest=3, lenpen=1.0, lenpen_style="power",
                       max_len_a=max_len_a, max_len_b=max_len_b)
    for sentence, cap in zip(hyps, caps):
        tokens, raw = capped(cap)
        assert sentence[0].tokens == tokens and sentence[0].score == pytest.approx(raw / (cap + 1), abs=1e-6)
        assert all(len(h.tokens) <= cap for h in sentence)


def test_pad_and_bos_are_never_emitted_and_their_mass_is_not_renormalised():
    def script(sentence, prefix):
        return {(): {PAD: 0.4, BOS: 0.3, A: 0.2, EOS: 0.1},
                (A,): {PAD: 0.5, BOS: 0.3, EOS: 0.15, A: 0.05}}.get(prefix, {PAD: 0.6, BOS: 0.3, EOS: 0.1})
    hyps = greedy_search(ScriptedModel(script), source([C]))
    assert_hyps(hyps, [[([A], math.log(0.2) + math.log(0.15))]])
    hyps = beam_search(ScriptedModel(script), source([C]), beam=4, lenpen=0.0, nbest=3)
    assert_hyps(hyps, [[([], math.log(0.1)), ([A], math.log(0.2) + math.log(0.15)),
                        ([A, A], math.log(0.2) + math.log(0.05) + math.log(0.1))]])
    assert all(PAD not in h.tokens and BOS not in h.tokens for h in hyps[0])


def test_sentences_in_one_batch_follow_their_own_scripts():
    def script(sentence, prefix):
        if sentence == C:
            return short_or_long(sentence, prefix)
        return {(): {B: 0.8, EOS: 0.1}, (B,): {EOS: 0.7}}.get(prefix, {EOS: 0.1})
    hyps = beam_search(ScriptedModel(script), source([C], [A, A, A]), beam=2, lenpen=0.6, lenpen_style="power")
    assert_hyps(hyps, [[([A], (math.log(0.4) + math.log(0.9)) / 2 ** 0.6)],
                       [([B], (math.log(0.8) + math.log(0.7)) / 2 ** 0.6)]])


def test_search_runs_in_eval_mode_and_restores_the_callers_mode():
    model = ScriptedModel(short_or_long).train()
    beam_search(model, source([C]))
    greedy_search(model, source([C]))
    assert model.training and not any(model.training_seen)


def test_ensemble_decode_is_the_mean_of_the_models_log_probabilities():
    first = ScriptedModel(lambda s, p: {A: 0.5, EOS: 0.3})
    second = ScriptedModel(lambda s, p: {B: 0.6, EOS: 0.1})
    ensemble = Ensemble([first, second])
    src = source([C], [A, B])
    tgt = torch.tensor([[BOS, A], [BOS, B]])
    log_probs, _ = ensemble.decode(tgt, ensemble.encode(src), ensemble.init_cache(ensemble.encode(src)))
    expected = [(torch.log_softmax(m.decode(tgt, m.encode(src), m.init_cache(m.encode(src)))[0], -1)) for m in
                (first, second)]
    torch.testing.assert_close(log_probs, ((expected[0] + expected[1]) / 2).float())
    # Search scores with the average itself (no renormalisation): greedy takes EOS at (.3 * .1) ** .5.
    hyps = greedy_search(ensemble, source([C]))
    assert hyps[0][0].tokens == [] and hyps[0][0].score == pytest.approx(0.5 * (math.log(0.3) + math.log(0.1)))


def test_ensemble_rejects_models_with_different_vocabularies():
    with pytest.raises(ValueError, match="vocab"):
        Ensemble([ScriptedModel(short_or_long, vocab_size=8), ScriptedModel(short_or_long, vocab_size=9)])


# --- tiny random Transformers (transformer/model.py) ---------------------------------------------------------

def random_source(vocab_size: int, lengths, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return source(*[torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths])


def test_beam_of_one_without_lenpen_is_greedy():
    model = tiny_model(0, random_norms=False, vocab_size=20, **SMALL)
    src = random_source(20, [5, 2, 7, 3], seed=1)
    for min_len in (0, 2):
        beam = beam_search(model, src, beam=1, lenpen=0.0, max_len_a=1, max_len_b=4, min_len=min_len)
        greedy = greedy_search(model, src, max_len_a=1, max_len_b=4, min_len=min_len)
        assert [[h.tokens for h in s] for s in beam] == [[h.tokens for h in s] for s in greedy]
        for b, g in zip(beam, greedy):
            assert b[0].score == pytest.approx(g[0].score, abs=1e-5)


def brute_force(model, src_row: torch.Tensor, cap: int, alpha: float, style: str):
    """Every sequence over the emittable tokens (all but PAD, BOS, EOS) of at most `cap` tokens, then EOS,
    scored by one teacher-forced forward pass: (sum of log-probs) / penalty. Sorted best first."""
    vocab = [t for t in range(model.config.vocab_size) if t not in (PAD, BOS, EOS)]
    sequences = [list(s) for n in range(cap + 1) for s in itertools.product(vocab, repeat=n)]
    tgt_in = torch.tensor([[BOS] + s + [PAD] * (cap - len(s)) for s in sequences])
    tgt_out = torch.tensor([s + [EOS] + [PAD] * (cap - len(s)) for s in sequences])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(src_row.expand(len(sequences), -1), tgt_in).double(), dim=-1)
    token_lp = log_probs.gather(2, tgt_out[:, :, None])[:, :, 0]
    scored = []
    for i, s in enumerate(sequences):
        raw = token_lp[i, :len(s) + 1].sum().item()
        penalty = ((5 + len(s) + 1) / 6) ** alpha if style == "gnmt" else (len(s) + 1) ** alpha
        scored.append((s, raw / penalty))
    return sorted(scored, key=lambda pair: -pair[1])


@pytest.mark.parametrize("style, alpha", [("gnmt", 0.6), ("gnmt", 2.0), ("power", 1.0)])
def test_exhaustive_beam_finds_the_brute_force_best(style, alpha):
    # Vocabulary 6: UNK, EOS and two real tokens. Caps 2 and 3 give at most 9 * 4 = 36 candidates a step,
    # so beam 36 keeps every one: beam search is then exhaustive, and its 10-best is brute force's 10-best.
    model = tiny_model(2, random_norms=False, vocab_size=6, **SMALL)
    src = random_source(6, [1, 2], seed=3)
    hyps = beam_search(model, src, beam=36, lenpen=alpha, lenpen_style=style, max_len_a=1, max_len_b=1, nbest=10)
    for row, cap, sentence in zip(src, [2, 3], hyps):
        expected = brute_force(model, row[None], cap, alpha, style)[:10]
        assert [h.tokens for h in sentence] == [tokens for tokens, _ in expected]
        for hyp, (_, score) in zip(sentence, expected):
            assert hyp.score == pytest.approx(score, abs=1e-5)


def pruned_search_by_enumeration(model, src_row: torch.Tensor, cap: int, beam: int, alpha: float, style: str,
                                 nbest: int):
    """The pruned search's own rule, run on Python lists, every prefix scored by a fresh teacher-forced pass:
    at each step extend every live prefix by every emittable token (only EOS at the cap), rank all those
    candidates by summed log-probability and keep the 2 * beam best; the EOS candidates among the first
    `beam` finish (normalised), the first `beam` non-EOS candidates live on. Runs to the cap (early stop must
    not change the result). Returns the `nbest` finished hypotheses, best first."""
    emittable = [t for t in range(model.config.vocab_size) if t not in (PAD, BOS)]
    live, finished = [((), 0.0)], []
    for t in range(cap + 1):
        candidates = []
        for prefix, score in live:
            with torch.no_grad():
                logits = model(src_row[None], torch.tensor([[BOS, *prefix]]))[0, -1]
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            for token in ([EOS] if t == cap else emittable):
                candidates.append((score + log_probs[token].item(), prefix, token))
        kept = sorted(candidates, key=lambda c: -c[0])[:2 * beam]
        for score, prefix, token in kept[:beam]:
            if token == EOS:
                length = len(prefix) + 1
                finished.append((list(prefix), score / (((5 + length) / 6) ** alpha if style == "gnmt"
                                                        else length ** alpha)))
        live = [(prefix + (token,), score) for score, prefix, token in kept if token != EOS][:beam]
    return sorted(finished, key=lambda pair: -pair[1])[:nbest]


@pytest.mark.parametrize("beam, style, alpha", [(1, "gnmt", 0.6), (2, "gnmt", 0.6), (3, "gnmt", 2.0),
                                                (2, "power", 1.0)])
def test_pruning_beam_follows_its_rule_enumerated(beam, style, alpha, one_torch_thread):
    # Vocabulary 8: 6 emittable tokens a step, so caps 3 and 4 give 6^3 and 6^4 sequences, far more than the
    # beam keeps: pruning decides what is found.
    model = tiny_model(5, random_norms=False, vocab_size=8, **SMALL)
    src = random_source(8, [2, 3], seed=6)
    hyps = beam_search(model, src, beam=beam, lenpen=alpha, lenpen_style=style, max_len_a=1, max_len_b=1,
                       nbest=beam)
    for row, cap, sentence in zip(src, [3, 4], hyps):
        expected = pruned_search_by_enumeration(model, row, cap, beam, alpha, style, beam)
        assert [h.tokens for h in sentence] == [tokens for tokens, _ in expected]
        for hyp, (_, score) in zip(sentence, expected):
            assert hyp.score == pytest.approx(score, abs=1e-5)


def test_the_pruned_cases_prune_something(one_torch_thread):
    """The enumeration above would prove little if pruning never changed the answer: on these models a small
    beam misses brute force's best for some sentence."""
    model = tiny_model(5, random_norms=False, vocab_size=8, **SMALL)
    src = random_source(8, [2, 3], seed=6)
    missed = [pruned_search_by_enumeration(model, row, cap, 1, 0.6, "gnmt", 1)[0][0]
              != brute_force(model, row[None], cap, 0.6, "gnmt")[0][0] for row, cap in zip(src, [3, 4])]
    assert any(missed)


def test_an_empty_batch_gives_no_hypotheses():
    model = tiny_model(4, random_norms=False, vocab_size=20, **SMALL)
    empty = torch.zeros((0, 5), dtype=torch.long)
    assert beam_search(model, empty) == [] and greedy_search(model, empty) == []


def test_batched_search_equals_searching_each_sentence_alone():
    model = tiny_model(4, random_norms=False, vocab_size=20, **SMALL)
    src = random_source(20, [6, 1, 3], seed=5)
    options = dict(beam=3, nbest=2, lenpen=0.6, lenpen_style="gnmt", max_len_a=1, max_len_b=3)
    batched = beam_search(model, src, **options)
    for row, together in zip(src, batched):
        length = int((row != PAD).sum())
        alone = beam_search(model, row[None, :length], **options)[0]
        assert [h.tokens for h in together] == [h.tokens for h in alone]
        for t, a in zip(together, alone):
            assert t.score == pytest.approx(a.score, abs=1e-5)


def test_ensemble_of_one_model_equals_the_model():
    model = tiny_model(6, random_norms=False, vocab_size=20, **SMALL)
    src = random_source(20, [4, 2], seed=7)
    options = dict(beam=3, nbest=3, lenpen=0.6, max_len_a=1, max_len_b=3)
    alone, ensembled = beam_search(model, src, **options), beam_search(Ensemble([model]), src, **options)
    assert [[h.tokens for h in s] for s in ensembled] == [[h.tokens for h in s] for s in alone]
    for a, e in zip(itertools.chain(*alone), itertools.chain(*ensembled)):
        assert e.score == pytest.approx(a.score, abs=1e-5)


def test_ensemble_averages_the_models_log_probabilities_step_by_step_and_teacher_forced():
    first, second = tiny_model(8, random_norms=False, vocab_size=20, **SMALL), tiny_model(9, random_norms=False, vocab_size=20, **SMALL)
    ensemble = Ensemble([first, second])
    src = random_source(20, [4, 2], seed=10)
    tgt = torch.tensor([[BOS, 5, 6], [BOS, 7, 8]])
    with torch.no_grad():
        encoder_out = ensemble.encode(src)
        cache = ensemble.init_cache(encoder_out)
        steps = []
        for t in range(tgt.size(1)):  # cached single steps, as search calls it
            log_probs, cache = ensemble.decode(tgt[:, t:t + 1], encoder_out, cache)
            steps.append(log_probs)
        expected = (torch.log_softmax(first(src, tgt), -1) + torch.log_softmax(second(src, tgt), -1)) / 2
        teacher_forced = ensemble(src, tgt)
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(teacher_forced, expected, atol=1e-5, rtol=0)


def test_transformer_ensemble_and_scripted_model_offer_what_search_reads():
    model = tiny_model(0, random_norms=False, vocab_size=20, **SMALL)
    for candidate in (model, Ensemble([model, tiny_model(1, random_norms=False, vocab_size=20, **SMALL)]), ScriptedModel(short_or_long)):
        assert isinstance(candidate, Seq2Seq)
    assert not isinstance(model.encoder, Seq2Seq)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_search_on_cuda_matches_cpu(monkeypatch):
    # full fp32 on the GPU, as on the CPU: the device rule turns TF32 matmuls on for the process (another test's
    # training may have), and TF32's rounding can reorder this untrained model's near-tied candidates
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = tiny_model(11, random_norms=False, vocab_size=20, **SMALL)
    src = random_source(20, [5, 2, 3], seed=12)
    options = dict(beam=3, nbest=2, lenpen=0.6, max_len_a=1, max_len_b=4)
    cpu = beam_search(model, src, **options)
    cuda = beam_search(model.cuda(), src.cuda(), **options)
    assert [[h.tokens for h in s] for s in cuda] == [[h.tokens for h in s] for s in cpu]
    greedy_cpu = greedy_search(model.cpu(), src)
    assert [[h.tokens for h in s] for s in greedy_search(model.cuda(), src.cuda())] == \
        [[h.tokens for h in s] for s in greedy_cpu]
