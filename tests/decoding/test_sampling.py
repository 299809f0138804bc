"""Sampling decoders (transformer/search.py `sample_search`, `decode.sampling`): drawn tokens follow the
model's distribution, top-k and nucleus (top-p) supports are exact, and a sample is a function of the seed,
the line's number and its rank alone."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import BOS, EOS, PAD, VOCAB, tiny_model
from transformer.cli import compose_config, to_job
from transformer.config import ConfigError, DecodeConfig
from transformer.search import sample_search, sampling_distribution, sampling_uniforms
from transformer.decoding.translation import translate_ids

SOURCE = torch.tensor([[5, 9, 17, 23, 8, EOS]])
DRAWS = 6000


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4)


def first_step_probabilities(model, temperature: float = 1.0) -> torch.Tensor:
    """[V] float64: the model's next-token distribution after BOS over the tokens search may emit, computed
    here from the model's full forward pass (not the search's cached step)."""
    with torch.no_grad():
        logits = model(SOURCE, torch.tensor([[BOS]]))[0, -1].double()
    logits[[PAD, BOS]] = float("-inf")
    return torch.softmax(logits / temperature, dim=-1)


def first_tokens(model, **options) -> torch.Tensor:
    """The first token of DRAWS samples of SOURCE (one token, then EOS at the cap)."""
    hyps = sample_search(model, SOURCE, samples=DRAWS, max_len_a=0, max_len_b=1, **options)[0]
    assert len(hyps) == DRAWS
    return torch.tensor([h.tokens[0] if h.tokens else EOS for h in hyps])


def assert_frequencies_match(tokens: torch.Tensor, p: torch.Tensor) -> None:
    """Each token's frequency within 5 standard errors of its probability (40 tokens: a false alarm has odds
    below 1e-5), and tokens of probability 0 never drawn."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    frequency = counts / DRAWS
    bound = 5 * torch.sqrt(p * (1 - p) / DRAWS) + 1 / DRAWS
    assert bool(((frequency - p).abs() <= bound).all()), (frequency - p).abs().max()
    assert counts[p == 0].sum() == 0


def test_unrestricted_samples_follow_the_models_probabilities(model):
    assert_frequencies_match(first_tokens(model), first_step_probabilities(model))


def test_temperature_samples_follow_the_tempered_distribution(model):
    assert_frequencies_match(first_tokens(model, temperature=0.5), first_step_probabilities(model, 0.5))


def test_top_k_draws_exactly_the_k_most_probable_tokens_in_proportion(model):
    p = first_step_probabilities(model)
    top = p.topk(3).indices
    restricted = torch.zeros_like(p)
    restricted[top] = p[top] / p[top].sum()
    tokens = first_tokens(model, topk=3)
    assert set(tokens.tolist()) == set(top.tolist())
    assert_frequencies_match(tokens, restricted)


def test_top_p_draws_exactly_the_nucleus_in_proportion(model):
    p = first_step_probabilities(model)
    order = p.argsort(descending=True)
    mass, nucleus = 0.0, []
    for token in order.tolist():  # the smallest most-probable set whose mass reaches 0.3
        nucleus.append(token)
        mass += float(p[token])
        if mass >= 0.3:
            break
    restricted = torch.zeros_like(p)
    restricted[nucleus] = p[nucleus] / p[nucleus].sum()
    tokens = first_tokens(model, topp=0.3)
    assert set(tokens.tolist()) == set(nucleus) and len(nucleus) > 1
    assert_frequencies_match(tokens, restricted)


def test_the_restricted_distribution_by_hand():
    log_p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert sampling_distribution(log_p, topp=0.8)[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert sampling_distribution(log_p, topp=0.81)[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert sampling_distribution(log_p, topk=1).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert sampling_distribution(log_p, topk=3, topp=0.9)[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    tempered = [p ** 2 / sum(q ** 2 for q in (0.5, 0.3, 0.15, 0.05)) for p in (0.5, 0.3, 0.15, 0.05)]
    assert sampling_distribution(log_p, temperature=0.5)[0].tolist() == pytest.approx(tempered)


def test_uniforms_are_a_function_of_seed_sentence_sample_and_step_alone():
    a = sampling_uniforms(1, torch.tensor([7, 3]), 2, 5)
    assert a[2:].tolist() == sampling_uniforms(1, torch.tensor([3]), 2, 5).tolist()
    assert a.tolist() != sampling_uniforms(2, torch.tensor([7, 3]), 2, 5).tolist()
    assert a.tolist() != sampling_uniforms(1, torch.tensor([7, 3]), 2, 6).tolist()
    draws = sampling_uniforms(1, torch.arange(20000), 1, 0)
    assert 0 < float(draws.min()) and float(draws.max()) < 1
    assert abs(float(draws.mean()) - 0.5) < 0.01 and len(set(draws.tolist())) == 20000


def test_a_sentences_samples_do_not_depend_on_its_batch_and_a_seed_repeats_them(model):
    g = torch.Generator().manual_seed(2)
    other = torch.cat([torch.randint(4, VOCAB, (1, 9), generator=g), torch.tensor([[EOS]])], dim=1)
    padded = torch.cat([SOURCE, torch.full((1, 4), PAD)], dim=1)
    batch = torch.cat([other, padded])
    together = sample_search(model, batch, samples=3, seed=5, sentence_ids=torch.tensor([11, 4]))[1]
    alone = sample_search(model, SOURCE, samples=3, seed=5, sentence_ids=torch.tensor([4]))[0]
    assert [h.tokens for h in together] == [h.tokens for h in alone]  # scores: equal up to padding's rounding
    assert [h.score for h in together] == pytest.approx([h.score for h in alone], abs=1e-4)
    assert sample_search(model, SOURCE, samples=3, seed=5, sentence_ids=torch.tensor([4]))[0] == alone
    assert sample_search(model, SOURCE, samples=3, seed=6, sentence_ids=torch.tensor([4]))[0] != alone


def test_samples_never_hold_forbidden_tokens_respect_min_len_and_are_scored_best_first(model):
    hyps = sample_search(model, SOURCE, samples=200, min_len=3, max_len_b=8, max_len_a=0)[0]
    assert all(PAD not in h.tokens and BOS not in h.tokens and EOS not in h.tokens for h in hyps)
    assert all(3 <= len(h.tokens) <= 8 for h in hyps)
    scores = [h.score for h in hyps]
    assert scores == sorted(scores, reverse=True) and all(math.isfinite(s) and s < 0 for s in scores)


def test_translate_ids_numbers_lines_so_chunks_draw_what_one_call_draws(model):
    g = torch.Generator().manual_seed(7)
    sources = [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in (4, 8, 6, 3, 9)]
    decode = DecodeConfig(sampling=True, nbest=2, max_tokens=16, max_len_b=6, sampling_topk=5)
    whole = translate_ids(model, sources, decode)
    chunks = translate_ids(model, sources[:2], decode) + translate_ids(model, sources[2:], decode, first_id=2)
    assert all(len(row) == 2 for row in whole)
    # the same draws; scores to rounding (a batch's size changes how the CPU's kernels block the matmuls: AVX2)
    assert [[h.tokens for h in row] for row in whole] == [[h.tokens for h in row] for row in chunks]
    assert [h.score for row in whole for h in row] == pytest.approx([h.score for row in chunks for h in row],
                                                                    rel=1e-5)


def test_the_sampling_preset_composes_and_bad_values_are_one_line_errors():
    job = to_job(compose_config(["decode=sampling", "decode.nbest=8", "decode.sampling_topk=10"]))
    assert job.decode.sampling and job.decode.nbest == 8 and job.decode.beam == 4  # n samples need no beam
    for key, value in (("sampling_topp", 0.0), ("temperature", 0), ("sampling_topk", -1)):
        with pytest.raises(ConfigError, match=f"decode.{key}="):
            DecodeConfig(sampling=True, **{key: value})


# ---------------------------------------------------------------------------------- noised back-translation


def test_noise_deletes_and_fills_a_tenth_each_and_moves_no_word_more_than_three_places():
    from transformer.decoding.noise import noisy

    words = [f"w{i}" for i in range(30)]
    deleted = filled = total = 0
    for line in range(400):
        out = noisy(" ".join(words), seed=1, line=line).split()
        kept = [w for w in out if w != "<blank>"]
        total += len(words)
        filled += out.count("<blank>")
        deleted += len(words) - len(out)
        positions = [int(w[1:]) for w in kept]
        # the kept words keep their order up to local swaps: each within 3 places of its rank among survivors
        ranks = sorted(positions)
        assert all(abs(out.index(w) - ranks.index(int(w[1:]))) <= 3 + out.count("<blank>") for w in kept)
    assert abs(deleted / total - 0.1) < 0.01 and abs(filled / total - 0.09) < 0.01  # fill: 0.1 of the kept 0.9


def test_noise_shift_bound_on_a_sentence_without_deletions():
    from transformer.decoding.noise import noisy

    words = [f"w{i}" for i in range(40)]
    for line in range(200):
        out = noisy(" ".join(words), seed=3, line=line, delete=0.0, replace=0.0).split()
        assert sorted(out) == sorted(words)
        assert max(abs(out.index(w) - i) for i, w in enumerate(words)) <= 3
    assert noisy("a b c d e f", seed=3, line=5) == noisy("a b c d e f", seed=3, line=5)
    assert len({noisy("a b c d e f g h", seed=3, line=n) for n in range(20)}) > 10
    assert noisy("solo", seed=1, line=0, delete=1.0) == "solo"  # never an empty line


def test_decode_noise_applies_to_the_translator_output_by_line_number(disagreeing_checkpoints, monkeypatch):
    from transformer.decoding.noise import noisy
    from transformer.decoding.translation import Translator

    plain = Translator.load(disagreeing_checkpoints[0], decode=DecodeConfig(max_len_a=0, max_len_b=12, min_len=8))
    noised = plain.with_decode(noise=True, seed=4)
    # An untrained model writes byte pieces, one "word" a line: spell each piece id as a word instead.
    monkeypatch.setattr(plain.vocab, "decode", lambda rows: [" ".join(map(str, row)) for row in rows])
    texts = ["the cat sees a dog", "a dog sees the cat", "the small cat sleeps"]
    clean = plain.translate(texts)
    assert all(len(line.split()) >= 8 for line in clean)
    assert noised.translate(texts) == [noisy(t, seed=4, line=i) for i, t in enumerate(clean)]
    assert noised.translate_nbest(texts[2:], first_line=3)[0][0].text == noisy(clean[2], seed=4, line=2)
    with pytest.raises(ConfigError, match="decode.noise_filler"):
        DecodeConfig(noise=True, noise_filler="two words")
