"""Greedy search, beam search and sampling over a model's `encode` / single-step `decode` (docs/CONTRACT.md "Python API").

The model is reached only through `Seq2Seq` below, which `transformer.model.Transformer` and `Ensemble` both
satisfy: `config` (special ids, vocab_size), `encode`, `init_cache` (K rows per source, row b * K + k is beam
k of sentence b), a single-step `decode`, `log_probs` of its output, `modules()` (put in eval mode) and the
cache's `reorder_beams`.

Axis letters: B sentences, K beams per sentence, V vocabulary, L longest hypothesis (tokens before EOS).

Rules shared by both searches (docs/CONTRACT.md):
- A source row is its pieces + EOS, right-padded with PAD; |src| = non-PAD tokens - 1. A hypothesis has at
  most cap = floor(max_len_a * |src| + max_len_b) tokens before its EOS; at the cap only EOS is allowed.
- PAD and BOS are never emitted; EOS is forbidden while fewer than `min_len` tokens are generated (the cap
  wins over `min_len`). Forbidden tokens are masked to -inf *after* log_softmax, so the allowed tokens keep
  their log-probabilities over the whole vocabulary (masking does not renormalise). Masking writes the
  forbidden columns in place; rows at their cap get their one candidate, EOS, after the top-k.
- score = (sum of the generated tokens' log-probabilities, EOS included) / length_penalty(|Y|), where |Y|
  counts the generated tokens including EOS.

Finished sentences leave the batch (fairseq style): once a quarter of the sentences still in the batch are
done, the search state and the decoder cache keep only the open ones (`Cache.select_sentences`, which also
cuts the cross-attention keys to the longest remaining source). Until then a done sentence's beams are -inf,
add no candidates and are fed PAD. The one host sync per step counts the done sentences. `compact=False`
keeps every row to the end (the loop before compaction; tests compare the two, benchmarks time them).
Compaction changes the shapes the kernels see, so scores may differ from the uncompacted loop in the last
bits (docs/BENCHMARKS.md, "Decoding real text", measures how often an output changes).

Stop rules (beam search, `stop=`): "exact" (the default, the paper's tensor2tensor behaviour) ends a
sentence when no live beam can beat its n-best list any more, so stopping never changes the result of
running to the cap; "patience" ends it once round(beam × patience) hypotheses (at least nbest) have ended,
as CTranslate2's patience factor (Kasai et al. 2022) and fairseq/Hugging Face early stopping (patience 1) do:
less work, and a later, better hypothesis may be missed.

`SearchWork` counts what a search computed (decoder steps, row-steps computed / of open sentences / needed
up to each sentence's best hypothesis, sentences that ran to their cap): pass one as `work=`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from transformer.kernels import frozen_weights

LENPEN_STYLES = ("gnmt", "power")
STOP_RULES = ("exact", "patience")
COMPACT_SHARE = 0.25  # finished sentences leave the batch once they are this share of it (docs/BENCHMARKS.md)


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]   # generated tokens, without BOS and EOS
    score: float        # sum of log-probabilities (EOS included) / length_penalty(len(tokens) + 1)


@dataclass
class SearchWork:
    """What searches computed, summed over the calls given it (`work=`): benchmarks/decode_real.py reports it.

    A row-step is one row (a beam, a sample) decoded for one step. `computed` counts every row fed to the
    decoder, `open` those of sentences not yet done, `useful` those a search that stopped the moment each
    sentence's best hypothesis ended would have needed (beam search: 1 + K·|best| per sentence, the first step
    decoding one row; greedy and sampling: |row| + 1 per row). `sentence_steps` holds, per sentence, the steps
    it was open; `cap_hits` counts sentences still open when their length cap came.
    """

    steps: int = 0
    computed: int = 0
    open: int = 0
    useful: int = 0
    cap_hits: int = 0
    sentence_steps: list[int] = field(default_factory=list)

    def add_sentences(self, steps_open: torch.Tensor, caps: torch.Tensor, useful: torch.Tensor) -> None:
        """Record sentences that left the search: steps they were open [B'], their caps [B'], useful row-steps."""
        self.sentence_steps += steps_open.tolist()
        self.cap_hits += int((steps_open == caps + 1).sum())  # open at steps 0..cap: the cap ended them
        self.useful += int(useful.sum())


def length_penalty(length: int, alpha: float, style: str) -> float:
    """The divisor of a hypothesis' summed log-probability; `length` = |Y|, generated tokens incl. EOS.

    gnmt:  ((5 + |Y|) / 6) ** alpha   (Wu et al. 2016, the paper's choice)
    power: |Y| ** alpha               (fairseq, Hugging Face, Marian)
    alpha = 0 gives 1 (no penalty) in both styles.
    """
    if style == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    if style == "power":
        return float(length) ** alpha
    raise ValueError(f"unknown lenpen_style {style!r}: use one of {', '.join(LENPEN_STYLES)}")


class TokenIds(Protocol):
    """What search reads of a model's config (`TransformerConfig` has it)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def target_size(self) -> int: ...  # V: the ids the decoder scores (vocab_size unless the target has its own)
    @property
    def pad_id(self) -> int: ...
    @property
    def unk_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...


class Cache(Protocol):
    """A decoder state (`transformer.model.DecoderCache`): `reorder_beams(beams [B, K'])` -> the state in
    which beam k of sentence b continues beam beams[b, k]; `select_sentences(keep [B'])` -> the state of
    sentences `keep` only, in that order (search drops finished sentences)."""

    def reorder_beams(self, beams: torch.Tensor) -> Cache: ...
    def select_sentences(self, keep: torch.Tensor) -> Cache: ...


@runtime_checkable  # isinstance checks that every member is there (not their signatures)
class Seq2Seq(Protocol):
    """The model as search sees it: `transformer.model.Transformer`, an `Ensemble`, or a test's scripted model.

    encode(src [B, S]) -> an encoder output that search only hands back to `init_cache` and `decode`.
    init_cache(encoder_out, beams=K) -> a cache for B * K rows, row b * K + k being beam k of sentence b.
    decode(tgt [B*K, T], encoder_out, cache) -> (output [B*K, T, V], the cache with those T positions
    appended): a new tensor each call, which search may overwrite. Search passes encoder_out=None: with a
    cache, everything about the sources is in the cache (which may hold fewer sentences than were encoded).
    log_probs(output) -> the log-probabilities [.., V] float32 that search adds up: log_softmax of a
    Transformer's logits, an Ensemble's mean of its members'. It may overwrite `output`.
    modules(): the nn.Modules that search puts in eval mode (dropout off) while it runs.
    """

    @property
    def config(self) -> TokenIds: ...
    def encode(self, src_tokens: torch.Tensor) -> Any: ...
    def init_cache(self, encoder_out: Any, beams: int = 1) -> Cache: ...
    def decode(self, tgt_tokens: torch.Tensor, encoder_out: Any, cache: Any) -> tuple[torch.Tensor, Any]: ...
    def log_probs(self, logits: torch.Tensor) -> torch.Tensor: ...
    def modules(self) -> Iterator[nn.Module]: ...


def _vocabulary_ids(config: TokenIds) -> tuple[int, int, int, int, int]:
    return config.vocab_size, config.target_size, config.pad_id, config.unk_id, config.bos_id, config.eos_id


class EnsembleCache:
    """One decoder cache per member model, reordered together."""

    def __init__(self, caches: tuple[Cache, ...]):
        self.caches = caches

    def reorder_beams(self, beams: torch.Tensor) -> EnsembleCache:
        return EnsembleCache(tuple(cache.reorder_beams(beams) for cache in self.caches))

    def select_sentences(self, keep: torch.Tensor) -> EnsembleCache:
        return EnsembleCache(tuple(cache.select_sentences(keep) for cache in self.caches))


class Ensemble(nn.Module):
    """Several models decoding as one: each step scores a token by the mean of the models' log-probabilities.

    This is the contract's "per-step average of the models' log-probabilities" taken literally (as Marian, OpenNMT and
    sockeye's log-linear ensembles do), not fairseq's log of the mean probability. `decode` and `forward`
    return the average [B, T, V] float32, and `log_probs` hands it to search as it is: not renormalised (a
    log_softmax would renormalise it and change the ensemble's scores). Each step's average is <= 0, like any
    log-probability, which the beam search's early stop relies on. Read as logits instead, i.e. renormalised
    by a softmax (as `F.cross_entropy` does), the average is the log-linear ensemble's distribution, which
    sums to one: so a corpus NLL (perplexity) treats `ensemble(src, tgt_in)` like a model's logits.
    """

    def __init__(self, models):  # Seq2Seq models that are nn.Modules, e.g. Transformers
        super().__init__()
        models = list(models)
        if not models:
            raise ValueError("an ensemble needs at least one model")
        first = models[0].config
        for model in models[1:]:
            if _vocabulary_ids(model.config) != _vocabulary_ids(first):
                raise ValueError("ensemble models disagree on (vocab_size, target_size, pad_id, unk_id, bos_id, eos_id): "
                                 f"{_vocabulary_ids(first)} vs {_vocabulary_ids(model.config)}; "
                                 "ensemble only models trained with the same vocabulary")
        self.models = nn.ModuleList(models)
        self.config = first

    def encode(self, src_tokens: torch.Tensor) -> tuple:
        return tuple(model.encode(src_tokens) for model in self.models)

    def init_cache(self, encoder_out: tuple, beams: int = 1) -> EnsembleCache:
        return EnsembleCache(tuple(model.init_cache(out, beams) for model, out in zip(self.models, encoder_out)))

    def decode(self, tgt_tokens: torch.Tensor, encoder_out: tuple | None,
               cache: EnsembleCache | None = None) -> tuple[torch.Tensor, EnsembleCache | None]:
        """-> (mean over the models of their log_probs [B, T, V] float32, the new cache or None).
        encoder_out may be None when a cache is given (search's steps): the members read their caches."""
        caches = cache.caches if cache is not None else (None,) * len(self.models)
        if encoder_out is None:
            encoder_out = (None,) * len(self.models)
        log_probs, new_caches = [], []
        for model, out, member_cache in zip(self.models, encoder_out, caches):
            logits, member_cache = model.decode(tgt_tokens, out, member_cache)
            log_probs.append(model.log_probs(logits))
            new_caches.append(member_cache)
        new_cache = EnsembleCache(tuple(new_caches)) if cache is not None else None  # as a model: None without one
        return torch.stack(log_probs).mean(dim=0), new_cache

    def forward(self, src_tokens: torch.Tensor, tgt_tokens: torch.Tensor) -> torch.Tensor:
        """src [B, S], decoder input [B, T] (BOS first) -> the mean of the models' log-probabilities [B, T, V]."""
        return self.decode(tgt_tokens, self.encode(src_tokens))[0]

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`decode`'s mean log-probabilities, as they are (the contract: the average, not renormalised)."""
        return logits.float()


@contextlib.contextmanager
def _eval_mode(model: Seq2Seq) -> Iterator[None]:
    """Search runs without dropout; the caller's train/eval flags are restored afterwards."""
    modules = list(model.modules())
    modes = [module.training for module in modules]
    for module in modules:
        module.training = False
    try:
        yield
    finally:
        for module, mode in zip(modules, modes):
            module.training = mode


def _length_caps(src_tokens: torch.Tensor, pad_id: int, max_len_a: float, max_len_b: float) -> torch.Tensor:
    """[B] long: the most tokens a hypothesis may have before its EOS, floor(a * |src| + b), at least 0."""
    src_len = ((src_tokens != pad_id).sum(dim=1) - 1).clamp(min=0)  # pieces without the EOS
    return torch.floor(src_len.double() * max_len_a + max_len_b).long().clamp(min=0)


def _penalty_table(longest: int, alpha: float, style: str, device) -> torch.Tensor:
    """[longest + 1] float32, entry n = length_penalty(n) for |Y| = n (entry 0 is unused)."""
    values = [1.0] + [length_penalty(n, alpha, style) for n in range(1, longest + 1)]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _next_token_log_probs(model: Seq2Seq, logits: torch.Tensor, step: int,
                          min_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decode's output [N, V] of one step -> (log-probabilities [N, V] float32 with the tokens search may not
    emit now at -inf, the log-probability of EOS [N] before masking: a row at its cap may end whatever min_len).

    bf16/fp16 models are scored in float32. Search owns what a step returns, so `model.log_probs` may write
    into it (a Transformer's log_softmax does: faster than into a fresh [400, 37000] tensor, whose pages the
    OS must first supply; docs/BENCHMARKS.md, 'In-place log_softmax'). PAD and BOS are never emitted, EOS
    not before min_len: whole columns set to -inf in place, after the log_softmax (masking does not
    renormalise).
    """
    config = model.config
    log_probs = model.log_probs(logits)
    eos = log_probs[:, config.eos_id].clone()
    log_probs[:, config.pad_id] = float("-inf")
    log_probs[:, config.bos_id] = float("-inf")
    if step < min_len:
        log_probs[:, config.eos_id] = float("-inf")
    return log_probs, eos


def _check_options(lenpen_style: str, min_len: int, max_len_a: float, max_len_b: float):
    if lenpen_style not in LENPEN_STYLES:
        raise ValueError(f"unknown lenpen_style {lenpen_style!r}: use one of {', '.join(LENPEN_STYLES)}")
    if min_len < 0:
        raise ValueError(f"min_len must be >= 0, got {min_len}")
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a} and {max_len_b}")


class _Leavers:
    """Where sentences go when they leave a search: results in batch order, filled as sentences finish.

    `put(rows, *values)` writes the values of the sentences at batch rows `rows` ([B'] long) into the tensors
    given at construction (each [B, ...], in the same order as `values`)."""

    def __init__(self, *tensors: torch.Tensor):
        self.tensors = tensors

    def put(self, rows: torch.Tensor, *values: torch.Tensor) -> None:
        for tensor, value in zip(self.tensors, values):
            tensor.index_copy_(0, rows, value)


@torch.inference_mode()
def beam_search(model: Seq2Seq, src_tokens: torch.Tensor, *, beam: int = 4, lenpen: float = 0.6,
                lenpen_style: str = "gnmt", max_len_a: float = 1, max_len_b: float = 50, min_len: int = 0,
                nbest: int = 1, stop: str = "exact", patience: float = 1.0, compact: bool = True,
                work: SearchWork | None = None) -> list[list[Hypothesis]]:
    """src_tokens [B, S] -> for each sentence, up to `nbest` hypotheses, best (highest score) first.

    Each step expands the K live beams of every sentence by every token, ranks the K * V candidates by their
    summed log-probability and takes the 2K best (at most K of them end in EOS, one per beam, so K live ones
    always remain, as in fairseq). EOS candidates among the first K are finished: their score is
    length-normalised and they join the sentence's n-best list (ties keep the earlier one); the first K
    non-EOS candidates are the next live beams.

    Stop rule "exact" (default). A sentence is done once it holds `nbest` finished hypotheses and no live
    beam can beat the worst of them. Bound: per-step log-probabilities are <= 0, so a live beam's raw score s
    can only fall, and every completion of it has |Y| in [t + 2, cap + 1] (it holds t + 1 tokens after step
    t). Its final normalised score s' / P(|Y|) <= s / P(|Y|) <= s / max P over that range, because s <= 0 and
    P > 0. Both penalties are monotone in |Y| (rising for alpha > 0, falling for alpha < 0), so that max is
    max(P(t + 2), P(cap + 1)). The inequalities hold in floating point too (rounding is monotone), and a
    later hypothesis that only ties never displaces a kept one, so stopping never changes the result of
    running every sentence to its cap.

    Stop rule "patience": a sentence is done once max(nbest, round(beam * patience)) hypotheses have
    finished (CTranslate2's patience; patience 1 is fairseq's and Hugging Face's early stopping); its result
    is the best `nbest` of them.
    """
    _check_options(lenpen_style, min_len, max_len_a, max_len_b)
    if beam < 1 or nbest < 1:
        raise ValueError(f"beam and nbest must be >= 1, got beam={beam}, nbest={nbest}")
    if stop not in STOP_RULES or patience <= 0:
        raise ValueError(f"stop must be one of {', '.join(STOP_RULES)} and patience > 0, got {stop!r}, {patience}")
    config = model.config
    device = src_tokens.device
    B, K, N, V = src_tokens.size(0), beam, nbest, config.target_size
    if B == 0:
        return []
    caps = _length_caps(src_tokens, config.pad_id, max_len_a, max_len_b)   # [B]
    L = int(caps.max()) + 1                                                  # history width (one host sync)
    penalty = _penalty_table(L, lenpen, lenpen_style, device)                # [L + 1], index |Y|
    neg_inf = float("-inf")
    top = min(2 * K, V)                            # candidates kept per beam: the sentence's 2K best are among them
    first = torch.arange(top, device=device) == 0  # [top]
    cap_tokens = torch.where(first, config.eos_id, config.pad_id)                    # [top]: EOS, then nothing
    enough = max(N, round(K * patience))                                            # the patience rule's count
    # The results, in batch order: each sentence's n-best list is written here when it leaves the batch.
    results = _Leavers(torch.full((B, N), neg_inf, device=device),
                       torch.full((B, N, L), config.pad_id, dtype=torch.long, device=device),
                       torch.zeros((B, N), dtype=torch.long, device=device))

    with _eval_mode(model), frozen_weights():
        # 1. Encode once. The first step decodes one row per sentence (every beam starts from BOS); from then
        # on the cache holds K rows per sentence: row b * K + k is beam k of sentence b. Below, b counts the
        # sentences still in the batch; `row` is each one's place in the caller's batch.
        cache = model.init_cache(model.encode(src_tokens), beams=1)
        row = torch.arange(B, device=device)

        # Live beams: raw scores [B, K] (step 0 expands only beam 0) and their tokens [B, K, L].
        scores = torch.full((B, K), neg_inf, device=device)
        scores[:, 0] = 0.0
        history = torch.full((B, K, L), config.pad_id, dtype=torch.long, device=device)
        last = torch.full((B, 1), config.bos_id, dtype=torch.long, device=device)
        # Finished n-best per sentence, best first: normalised scores, tokens (PAD after the end), lengths;
        # how many hypotheses have finished, for how many steps the sentence has been open, whether it is done.
        fin_scores = torch.full((B, N), neg_inf, device=device)
        fin_tokens = torch.full((B, N, L), config.pad_id, dtype=torch.long, device=device)
        fin_lengths = torch.zeros((B, N), dtype=torch.long, device=device)
        fin_count = torch.zeros(B, dtype=torch.long, device=device)
        steps_open = torch.zeros(B, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        n_done = 0

        def leave(rows: torch.Tensor) -> None:  # sentences at these places of the batch leave it
            results.put(row[rows], fin_scores[rows], fin_tokens[rows], fin_lengths[rows])
            if work is not None:
                work.add_sentences(steps_open[rows], caps[rows], 1 + K * fin_lengths[rows, 0])

        for t in range(L):  # t tokens generated so far
            # 2. One decoder step for all rows, then log-probabilities with forbidden tokens at -inf.
            logits, cache = model.decode(last, None, cache)                  # [b*R, 1, V], R = 1 at step 0, else K
            log_probs, eos_log_prob = _next_token_log_probs(model, logits[:, -1], t, min_len)
            b = scores.size(0)
            R = log_probs.size(0) // b
            if work is not None:
                work.steps, work.computed, work.open = work.steps + 1, work.computed + b * R, work.open + (b - n_done) * R
            steps_open += ~done

            # 3. Candidates: every beam extended by every token; the 2K best per sentence, best first. They
            # are among each beam's 2K best tokens, so those are ranked instead of all K * V. A beam at its
            # cap has one candidate, EOS. At step 0, beams 1.. (score -inf) copy row 0 and add nothing.
            beam_log_probs, beam_tokens = log_probs.topk(top, dim=1)         # [b*R, top]
            at_cap = (caps <= t).repeat_interleave(R)[:, None]
            beam_log_probs = torch.where(at_cap, torch.where(first, eos_log_prob[:, None], neg_inf), beam_log_probs)
            beam_tokens = torch.where(at_cap, cap_tokens, beam_tokens).view(b, R, top).expand(b, K, top)
            beam_tokens = beam_tokens.reshape(b, K * top)
            candidates = (scores[:, :, None] + beam_log_probs.view(b, R, top)).view(b, K * top)
            cand_scores, cand_index = candidates.topk(2 * K, dim=1)          # [b, 2K]
            cand_beam, cand_token = cand_index // top, beam_tokens.gather(1, cand_index)
            cand_eos = cand_token == config.eos_id

            # 4. EOS among the first K candidates: normalise (|Y| = t + 1) and merge into the n-best lists.
            new_fin = cand_eos[:, :K] & torch.isfinite(cand_scores[:, :K])
            new_scores = torch.where(new_fin, cand_scores[:, :K] / penalty[t + 1], neg_inf)        # [b, K]
            new_tokens = history.gather(1, cand_beam[:, :K, None].expand(-1, -1, L))            # [b, K, L]
            pool_scores = torch.cat([fin_scores, new_scores], dim=1)                             # [b, N+K]
            keep = pool_scores.sort(dim=1, descending=True, stable=True).indices[:, :N]          # old first on ties
            fin_scores = pool_scores.gather(1, keep)
            fin_tokens = torch.cat([fin_tokens, new_tokens], dim=1).gather(1, keep[:, :, None].expand(-1, -1, L))
            fin_lengths = torch.cat([fin_lengths, torch.full_like(new_scores, t, dtype=torch.long)], 1).gather(1, keep)
            fin_count += new_fin.sum(dim=1)

            # 5. The first K non-EOS candidates live on (a stable sort moves EOS behind, keeping rank order).
            live = cand_eos.to(torch.uint8).sort(dim=1, stable=True).indices[:, :K]           # [b, K]
            scores = cand_scores.gather(1, live)
            beams, tokens = cand_beam.gather(1, live), cand_token.gather(1, live)
            history = history.gather(1, beams[:, :, None].expand(-1, -1, L))
            history[:, :, t] = tokens

            # 6. The stop rule (see the docstring): done sentences get -inf beams and feed PAD from now on.
            if stop == "exact":
                longest = caps + 1                                               # |Y| ended by the cap
                next_len = torch.clamp(longest, max=t + 2)                       # shortest |Y| still reachable
                bound = scores.max(dim=1).values / torch.maximum(penalty[next_len], penalty[longest])
                done |= bound <= fin_scores[:, -1]
            else:
                done |= fin_count >= enough
            scores = scores.masked_fill(done[:, None], neg_inf)
            n_done = int(done.sum())                                             # the step's one host sync
            if n_done == b:
                break

            # 7. Move the decoder state with the beams (after step 0, all come from its one row per sentence),
            # then let the done sentences leave once they are a quarter of the batch.
            cache = cache.reorder_beams(beams.clamp(max=R - 1))
            last = tokens.masked_fill(~torch.isfinite(scores), config.pad_id)    # [b, K]
            if compact and n_done >= COMPACT_SHARE * b:
                leave(done.nonzero()[:, 0])
                stay = (~done).nonzero()[:, 0]
                cache = cache.select_sentences(stay)
                row, caps, scores, history, last, fin_scores, fin_tokens, fin_lengths, fin_count, steps_open, done = (
                    x.index_select(0, stay) for x in (row, caps, scores, history, last, fin_scores, fin_tokens,
                                                      fin_lengths, fin_count, steps_open, done))
                n_done = 0
            last = last.reshape(-1, 1)

        leave(torch.arange(scores.size(0), device=device))
    return _to_hypotheses(*results.tensors)


def _to_hypotheses(scores: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> list[list[Hypothesis]]:
    """[B, N] scores (-inf = empty slot), [B, N, L] tokens, [B, N] lengths -> Python lists, best first."""
    scores, tokens, lengths = scores.tolist(), tokens.tolist(), lengths.tolist()
    return [[Hypothesis(tokens=row_tokens[:n], score=score)
             for score, row_tokens, n in zip(sentence_scores, sentence_tokens, sentence_lengths)
             if score != float("-inf")]
            for sentence_scores, sentence_tokens, sentence_lengths in zip(scores, tokens, lengths)]


def _extend_rows(model: Seq2Seq, src_tokens: torch.Tensor, caps: torch.Tensor, L: int, choose, *, min_len: int,
                 rows: int, compact: bool = True,
                 work: SearchWork | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loop of greedy search and sampling: K = `rows` hypotheses per sentence (row b * K + k), each
    extended by the token `choose(log_probs [n, V], step, sentences [n / K]) -> (its log-probability [n],
    token [n])` picks, EOS at its cap (caps: [B * K]); `sentences` are the batch places of the sentences the
    rows belong to. Finished rows are extended with PAD at zero cost until their sentence's rows have all
    finished; done sentences leave the batch as in beam search. Returns, in batch order, summed
    log-probabilities [B * K], tokens [B * K, L] (PAD after EOS) and lengths [B * K] (tokens before EOS)."""
    config = model.config
    B, K, device = src_tokens.size(0), rows, src_tokens.device
    results = _Leavers(torch.zeros(B, K, device=device),
                       torch.full((B, K, L), config.pad_id, dtype=torch.long, device=device),
                       torch.zeros((B, K), dtype=torch.long, device=device))
    with _eval_mode(model), frozen_weights():
        cache = model.init_cache(model.encode(src_tokens), beams=K)
        row = torch.arange(B, device=device)
        caps = caps.view(B, K)
        scores = torch.zeros(B, K, device=device)
        tokens = torch.full((B, K, L), config.pad_id, dtype=torch.long, device=device)
        lengths = torch.zeros((B, K), dtype=torch.long, device=device)
        finished = torch.zeros((B, K), dtype=torch.bool, device=device)
        steps_open = torch.zeros(B, dtype=torch.long, device=device)
        last = torch.full((B * K, 1), config.bos_id, dtype=torch.long, device=device)
        n_done = 0

        def leave(places: torch.Tensor) -> None:
            results.put(row[places], scores[places], tokens[places], lengths[places])
            if work is not None:
                work.add_sentences(steps_open[places], caps[places].max(dim=1).values, (lengths[places] + 1).sum(1))

        for t in range(L):
            b = scores.size(0)
            if work is not None:
                work.steps, work.computed, work.open = work.steps + 1, work.computed + b * K, work.open + (b - n_done) * K
            steps_open += ~finished.all(dim=1)
            logits, cache = model.decode(last, None, cache)                  # [b*K, 1, V]
            log_probs, eos_log_prob = _next_token_log_probs(model, logits[:, -1], t, min_len)
            chosen, token = choose(log_probs, t, row)
            chosen, token = chosen.view(b, K), token.view(b, K)
            at_cap = caps <= t                                               # only EOS may follow
            chosen = torch.where(at_cap, eos_log_prob.view(b, K), chosen)
            token = token.masked_fill(at_cap, config.eos_id)
            scores += chosen.masked_fill(finished, 0.0)
            token = token.masked_fill(finished, config.pad_id)
            tokens[:, :, t] = token
            ended = ~finished & (token == config.eos_id)
            lengths = torch.where(ended, t, lengths)
            finished |= ended
            done = finished.all(dim=1)                                       # [b]
            n_done = int(done.sum())                                         # the step's one host sync
            if n_done == b:
                break
            if compact and n_done >= COMPACT_SHARE * b:
                leave(done.nonzero()[:, 0])
                stay = (~done).nonzero()[:, 0]
                cache = cache.select_sentences(stay)
                row, caps, scores, tokens, lengths, finished, steps_open, token = (
                    x.index_select(0, stay) for x in (row, caps, scores, tokens, lengths, finished, steps_open, token))
                n_done = 0
            last = token.reshape(-1, 1)
        leave(torch.arange(scores.size(0), device=device))
    return tuple(x.view(B * K, *x.shape[2:]) for x in results.tensors)


@torch.inference_mode()
def greedy_search(model: Seq2Seq, src_tokens: torch.Tensor, *, max_len_a: float = 1, max_len_b: float = 50,
                  min_len: int = 0, lenpen: float = 0.0, lenpen_style: str = "gnmt", compact: bool = True,
                  work: SearchWork | None = None) -> list[list[Hypothesis]]:
    """src_tokens [B, S] -> for each sentence, a list holding its one hypothesis: the most probable allowed
    token at every step. Finished sentences leave the batch as in beam search (`compact`)."""
    _check_options(lenpen_style, min_len, max_len_a, max_len_b)
    config = model.config
    device = src_tokens.device
    B = src_tokens.size(0)
    if B == 0:
        return []
    caps = _length_caps(src_tokens, config.pad_id, max_len_a, max_len_b)   # [B]
    L = int(caps.max()) + 1
    penalty = _penalty_table(L, lenpen, lenpen_style, device)

    def most_probable(log_probs: torch.Tensor, t: int, sentences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return log_probs.max(dim=1)                                          # [b], [b]

    scores, tokens, lengths = _extend_rows(model, src_tokens, caps, L, most_probable, min_len=min_len, rows=1,
                                           compact=compact, work=work)
    normalised = scores / penalty[lengths + 1]
    return _to_hypotheses(normalised[:, None], tokens[:, None], lengths[:, None])


# ------------------------------------------------------------------------------------------- sampling

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and c < 2^32, without int64 overflow (16-bit halves)."""
    return ((x & 0xFFFF) * c + (((x >> 16) * c) & 0xFFFF) * 65536) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Wellons' "lowbias32") of int64 values in [0, 2^32): integer arithmetic only, so
    every device and batch gives the same bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sampling_uniforms(seed: int, sentence_ids: torch.Tensor, samples: int, step: int) -> torch.Tensor:
    """[B * samples] float64 in (0, 1): the draw of sample k of sentence `sentence_ids[b]` at `step`, a
    function of (seed, sentence id, k, step) alone: the batch a sentence lands in changes nothing."""
    ids = sentence_ids.long().repeat_interleave(samples) & _MASK32
    k = torch.arange(samples, device=ids.device).repeat(sentence_ids.numel())
    h = _hash32(torch.full_like(ids, seed & _MASK32))
    for key in (ids, k, torch.full_like(ids, step)):
        h = _hash32(h ^ key)
    return (h.double() + 0.5) / 2.0**32


def sampling_distribution(log_probs: torch.Tensor, *, topk: int = 0, topp: float = 1.0,
                          temperature: float = 1.0) -> torch.Tensor:
    """[N, V] log-probabilities (forbidden tokens at -inf) -> [N, V] float64 probabilities to sample from:
    softmax(log_probs / temperature) restricted to the `topk` most probable tokens (0: all) and then to the
    smallest set of most probable tokens whose probability reaches `topp` (1.0: all), renormalised. Ties at
    the top-k boundary are broken by token id (lower first), as the sort is stable."""
    probs = torch.softmax(log_probs.double() / temperature, dim=-1)
    if topk <= 0 and topp >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if topk > 0:
        keep[:, topk:] = False
    if topp < 1.0:
        kept = sorted_probs.masked_fill(~keep, 0.0)
        before = kept.cumsum(dim=-1) - kept  # the mass of the more probable kept tokens
        keep &= before < topp * kept.sum(dim=-1, keepdim=True)  # up to and including the token that reaches p
    restricted = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(~keep, 0.0))
    return restricted / restricted.sum(dim=-1, keepdim=True)


@torch.inference_mode()
def sample_search(model: Seq2Seq, src_tokens: torch.Tensor, *, samples: int = 1, topk: int = 0, topp: float = 1.0,
                  temperature: float = 1.0, seed: int = 1, sentence_ids: torch.Tensor | None = None,
                  max_len_a: float = 1, max_len_b: float = 50, min_len: int = 0, lenpen: float = 0.0,
                  lenpen_style: str = "gnmt", compact: bool = True,
                  work: SearchWork | None = None) -> list[list[Hypothesis]]:
    """src_tokens [B, S] -> for each sentence, `samples` translations drawn from the model, best score first.

    Each step draws the next token of every sample from `sampling_distribution` (temperature, top-k,
    nucleus top-p; forbidden tokens never, EOS only at the cap, as in the other searches) by inverting its
    cumulative distribution at `sampling_uniforms`: sample k of the sentence with id `sentence_ids[b]`
    (default: its row) is a function of (seed, that id, k) and the model alone, whatever else is in the batch.
    A sample's score is its summed model log-probabilities (untempered, unrestricted, EOS included) divided
    by the length penalty, as beam search scores. Draws have 32 bits: a token below 2^-32 is never drawn.
    """
    _check_options(lenpen_style, min_len, max_len_a, max_len_b)
    if samples < 1 or temperature <= 0 or topk < 0 or not 0 < topp <= 1:
        raise ValueError(f"samples >= 1, temperature > 0, topk >= 0 and 0 < topp <= 1 are needed, got "
                         f"samples={samples}, temperature={temperature}, topk={topk}, topp={topp}")
    config = model.config
    device = src_tokens.device
    B, K = src_tokens.size(0), samples
    if B == 0:
        return []
    ids = torch.arange(B, device=device) if sentence_ids is None else sentence_ids.to(device)
    caps = _length_caps(src_tokens, config.pad_id, max_len_a, max_len_b).repeat_interleave(K)  # [B*K]
    L = int(caps.max()) + 1
    penalty = _penalty_table(L, lenpen, lenpen_style, device)

    def draw(log_probs: torch.Tensor, t: int, sentences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = sampling_distribution(log_probs, topk=topk, topp=topp, temperature=temperature)
        cdf = probs.cumsum(dim=-1)
        u = sampling_uniforms(seed, ids[sentences], K, t)[:, None] * cdf[:, -1:]  # below the total: never past the end
        token = torch.searchsorted(cdf, u, right=True)[:, 0]           # the first token whose cdf exceeds u (p > 0)
        return log_probs.gather(1, token[:, None])[:, 0], token

    scores, tokens, lengths = _extend_rows(model, src_tokens, caps, L, draw, min_len=min_len, rows=K,
                                           compact=compact, work=work)
    normalised = (scores / penalty[lengths + 1]).view(B, K)
    best = normalised.sort(dim=1, descending=True, stable=True).indices
    return _to_hypotheses(normalised.gather(1, best), tokens.view(B, K, L).gather(1, best[:, :, None].expand(-1, -1, L)),
                          lengths.view(B, K).gather(1, best))
