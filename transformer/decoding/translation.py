"""The decoding library: load a model, translate text (scoring a corpus: transformer/evaluation/measures.py).

- `Translator.load(checkpoint, device=, beam=, ...)`: a model or an ensemble with its vocabulary and search
  settings, from run directories or .pt files, keeping only the weights (not the Adam moments of last.pt).
  `translate(texts)` gives strings, `translate_nbest(texts)` scored hypotheses: the Python API
  (`from transformer import Translator`) and what translate.py and evaluate.py decode with.
- `translate_ids`: token batching around `beam_search`, in input order, with the search settings of one
  `DecodeConfig`.

translate.py and evaluate.py are thin command lines over this module and transformer/evaluation/measures.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch
from tqdm import tqdm

from data.config import language_tags
from data.errors import DataError
from data.vocab import MarianVocab, Vocab, load_vocab
from transformer import checkpoint as ckpt
from transformer import distributed, kernels
from transformer.config import ConfigError, DecodeConfig
from transformer.decoding.noise import noisy
from transformer.search import Ensemble, Hypothesis, SearchWork, Seq2Seq, beam_search, greedy_search, sample_search

log = logging.getLogger(__name__)


def length_sorted_batches(lengths: Sequence[int], max_tokens: int) -> Iterator[list[int]]:
    """Indices grouped into batches of similar length with batch size × longest row ≤ max_tokens.

    Longest first, so that an out-of-memory error shows on the first batch, not the last.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    longest = 0
    for index in order:
        row = lengths[index]
        if batch and max(longest, row) * (len(batch) + 1) > max_tokens:
            yield batch
            batch, longest = [], 0
        batch.append(index)
        longest = max(longest, row)
    if batch:
        yield batch


def pad_rows(rows: Iterable[Sequence[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """Right-pad token rows into one [B, S] int64 tensor."""
    rows = list(rows)
    width = max(len(row) for row in rows)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out.to(device)


class DeadlinePassed(Exception):
    """`translate_ids` reached its deadline (a time.monotonic() value) before its last batch."""


@torch.inference_mode()
def translate_ids(model: Seq2Seq, sources: Sequence[Sequence[int]], decode: DecodeConfig, *,
                  device: torch.device | str = "cpu", progress=None, deadline: float | None = None,
                  first_id: int = 0, work: SearchWork | None = None,
                  weights: kernels.WeightCache | None = None) -> list[list[Hypothesis]]:
    """Search every source (pieces without EOS) and return its `decode.nbest` hypotheses, in input order.

    An empty source yields no search and an empty hypothesis (score 0): translating nothing gives nothing.
    With a `deadline`, a batch that would start after it raises DeadlinePassed instead (the batches are
    those of a call without one, so a translation that finishes is the same). Sampling (decode.sampling)
    draws source i's samples from its number `first_id + i`, so a line's samples do not depend on the
    batch or the chunk of input it came in. `work` (a search.SearchWork) adds up what the searches computed.
    `weights` keeps the packed or int8 weights for the next call (a Translator's; `kernels.WeightCache`).
    """
    if decode.precision == "bf16":
        kernels.warn_if_emulated("bf16", torch.device(device).type)
        model = bfloat16_copy(model)
    with int8_linear_maps(decode, device, weights), kernels.frozen_weights(weights):
        return _translate_batches(model, sources, decode, device=device, progress=progress, deadline=deadline,
                                  first_id=first_id, work=work)


def int8_linear_maps(decode: DecodeConfig, device: torch.device | str,
                     weights: kernels.WeightCache | None = None) -> contextlib.AbstractContextManager:
    """`kernels.int8_weights(weights)` for decode.precision=int8 (a one-line ConfigError where it cannot run),
    else nothing."""
    if decode.precision != "int8":
        return contextlib.nullcontext()
    if torch.device(device).type != "cpu":
        raise ConfigError(f"decode.precision=int8 runs on CPU only (device is {device}); use decode.precision=bf16 "
                          "or fp32 on a GPU")
    reason = kernels.why_no_int8()
    if reason:
        raise ConfigError(f"decode.precision=int8: {reason}; use decode.precision=fp32")
    return kernels.int8_weights(weights)


def _translate_batches(model: Seq2Seq, sources: Sequence[Sequence[int]], decode: DecodeConfig, *, device, progress,
                       deadline: float | None, first_id: int, work: SearchWork | None) -> list[list[Hypothesis]]:
    """`translate_ids` once the model is in its decoding precision."""
    config = model.config
    results: list[list[Hypothesis]] = [[Hypothesis(tokens=[], score=0.0)] * decode.nbest for _ in sources]
    todo = [i for i, src in enumerate(sources) if len(src) > 0]
    lengths, done = [len(sources[i]) + 1 for i in todo], 0
    limits = {"max_len_a": decode.max_len_a, "max_len_b": decode.max_len_b, "min_len": decode.min_len,
              "lenpen": decode.lenpen, "lenpen_style": decode.lenpen_style, "work": work}
    for batch in length_sorted_batches(lengths, decode.max_tokens):
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlinePassed(f"{len(todo) - done} of {len(todo)} lines were not translated by the deadline")
        indices = [todo[j] for j in batch]
        src = pad_rows((list(sources[i]) + [config.eos_id] for i in indices), config.pad_id, device)
        if decode.sampling:  # each line's samples depend on its number in `sources`, not on its batch
            hyps = sample_search(model, src, samples=decode.nbest, topk=decode.sampling_topk, topp=decode.sampling_topp,
                                 temperature=decode.temperature, seed=decode.seed,
                                 sentence_ids=torch.tensor(indices) + first_id, **limits)
        elif decode.beam == 1 and decode.lenpen == 0:  # the same result as beam_search, without the beam bookkeeping
            hyps = greedy_search(model, src, **limits)
        else:
            hyps = beam_search(model, src, beam=decode.beam, nbest=decode.nbest, stop=decode.stop,
                               patience=decode.patience, **limits)
        for i, hyp in zip(indices, hyps):
            results[i] = hyp
        done += len(indices)
        if progress is not None:
            progress.update(len(indices))
    return results


def bfloat16_copy(model: Seq2Seq) -> Seq2Seq:
    """The model with its weights in bfloat16, for `decode.precision=bf16`; one already in bfloat16 is itself.

    As inference engines do: the weights themselves in bfloat16 (autocast would re-cast them at every matmul
    and keep float32 activations: slower decoding on CPU). Search scores in float32.
    """
    if all(p.dtype == torch.bfloat16 for p in model.parameters()):
        return model
    return copy.deepcopy(model).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ the translator


@dataclass(frozen=True)
class Translation:
    """One hypothesis of `Translator.translate_nbest`: the detokenised text and its search score (the sum of
    the log-probabilities of its tokens, EOS included, divided by the length penalty: docs/CONTRACT.md "Python API")."""

    text: str
    score: float


@dataclass
class _Prepared:
    """What a Translator makes from its weights once, for every call and every `with_decode` copy."""

    weights: kernels.WeightCache = field(default_factory=kernels.WeightCache)  # packed for oneDNN, or int8
    bf16_model: Seq2Seq | None = None  # decode.precision=bf16: the bfloat16 copy


@dataclass
class Translator:
    """A model (or an ensemble) with its vocabulary, languages and search settings, ready to translate text.
    The Python API, and what translate.py and evaluate.py decode with:

        from transformer import Translator
        t = Translator.load("runs/quickstart", device="cpu", beam=4)   # any DecodeConfig field as a keyword
        t.translate(["A sentence."])                      # -> ["..."]: the best translation of each text
        t.translate_nbest(["A sentence."], nbest=4)      # -> [[Translation(text, score), ...]], best first
        greedy = t.with_decode(beam=1, lenpen=0)         # the same model, other search settings

    Its weights must not change: it packs them for the CPU's kernels (or quantises them, decode.precision=int8;
    or copies them to bfloat16) once, on first use, and keeps them for every call and every `with_decode` copy
    (on CPUs where decoding uses oneDNN, the packed copy about doubles the weights' memory). To translate with
    changed weights, load a new Translator.
    """

    model: Seq2Seq
    vocab: Vocab | MarianVocab
    decode: DecodeConfig
    src_lang: str | None
    tgt_lang: str | None
    device: torch.device
    checkpoints: list[dict]  # what each checkpoint holds besides its weights (step, config, TrainState keys)
    source_prefix: list[int] = field(default_factory=list)  # a multilingual model's: the target language's tag
    _prepared: _Prepared = field(default_factory=_Prepared, init=False, repr=False)

    @property
    def chosen_language(self) -> str | None:
        """The target language a multilingual model was asked for (its tag leads every source), else None: part
        of what a translation is, for whatever keeps translations apart (caches, resumable chunks, folders)."""
        return self.tgt_lang if self.source_prefix else None

    @classmethod
    def load(cls, checkpoint, device: torch.device | str = "auto", *, decode: DecodeConfig | None = None,
             tgt_lang: str | None = None, **settings) -> Translator:
        """From a run directory, a .pt file, or a list of them (an ensemble sharing one vocabulary).

        `tgt_lang`: the language to translate into. A multilingual model (trained with data.train_tag) needs it,
        and puts that language's tag before every source; a model of one pair takes its own or none.

        `device`: auto (cuda if available, else cpu), cpu, cuda or cuda:N, by the one device rule of
        `distributed.pick_device` (under torchrun, auto and cuda are cuda:LOCAL_RANK; cuda:N is refused), or a
        torch.device, taken as already picked (the entry scripts pick it first). The search settings are `decode`
        (default: the run's own, `run_decode`: those its validation BLEU and end-of-training test used) with
        `settings` (its fields: beam=, lenpen=, nbest=, ...) replacing some of them.
        """
        asked = _with_settings(DecodeConfig() if decode is None else decode, settings)  # fails before any read
        device = device if isinstance(device, torch.device) else distributed.pick_device(device)
        int8_linear_maps(asked, device)  # int8 where it cannot run: refused before any read too
        names = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
        if not names:
            raise ConfigError("checkpoint=[] names no checkpoint: give a run directory or a .pt file")
        paths = [ckpt.resolve(str(name)) for name in names]
        states = [ckpt.load(path) for path in paths]
        # the weights go into the models; the Adam moments of last.pt are dropped with `states`
        translator = cls.from_states(states, device, names=[str(path) for path in paths], decode=decode,
                                     tgt_lang=tgt_lang)
        for path, record in zip(paths, translator.checkpoints):  # after the checks: an error is the one line
            log.info("loaded %s (update %s)", path, record.get("step"))
        return translator.with_decode(**settings) if settings else translator

    @classmethod
    def from_states(cls, states: Sequence[dict], device: torch.device | str = "cpu", *,
                    names: Sequence[str] | None = None, decode: DecodeConfig | None = None,
                    tgt_lang: str | None = None) -> Translator:
        """From checkpoint dicts in memory (e.g. `checkpoint.average(...)` made on the fly): one model, or several
        decoded as one ensemble (they must share one vocabulary and translate into the same languages). `names`
        stand for their paths in error messages; `decode` and `tgt_lang` as for `load` (default: the first
        model's run's own)."""
        if not states:
            raise ValueError("from_states needs at least one checkpoint state")
        names = list(names) if names is not None else [f"checkpoint {i + 1}" for i in range(len(states))]
        if len(names) != len(states):
            raise ValueError(f"from_states needs one name per state: {len(states)} states, {len(names)} names")
        device = device if isinstance(device, torch.device) else torch.device(device)
        protos = []
        for name, state in zip(names, states):  # every vocabulary is checked before any model is built
            try:
                protos.append(ckpt.spm_bytes(state))
            except ckpt.CheckpointError as error:
                raise ckpt.CheckpointError(f"{name}: {error}") from None
            if protos[-1] != protos[0]:
                raise ConfigError(f"{name} has another vocabulary than {names[0]}: an ensemble needs models that "
                                  "share one SentencePiece model")
        try:
            vocab = load_vocab(protos[0])
        except DataError as error:
            raise ckpt.CheckpointError(f"{names[0]}: its stored vocabulary is unreadable ({error}); use another "
                                       "checkpoint") from None
        models, records = [], []
        for name, state in zip(names, states):
            models.append(ckpt.model_of(state, name, vocab_size=vocab.size).to(device).eval())
            records.append({k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler",
                                                                         "scaler", "data_state", "spm_model")})
            records[-1]["params"] = sum(t.numel() for t in state["model"].values())
        decode = run_decode(records[0]) if decode is None else decode
        data_cfg = (records[0].get("config") or {}).get("data", {})
        for name, record in zip(names[1:], records[1:]):
            if language_tags((record.get("config") or {}).get("data", {})) != language_tags(data_cfg):
                raise ConfigError(f"{name} translates into other languages than {names[0]}: an ensemble's models "
                                  "need the same target languages and tags")
        target, prefix = _target(data_cfg, tgt_lang, vocab, names[0])
        return cls(model=models[0] if len(models) == 1 else Ensemble(models), vocab=vocab, decode=decode,
                   src_lang=data_cfg.get("src_lang"), tgt_lang=target, device=device, checkpoints=records,
                   source_prefix=prefix)

    def with_decode(self, **settings) -> Translator:
        """The same model (shared, not copied, with its packed weights and bf16 copy) with some search settings
        replaced, e.g. `with_decode(beam=1)`."""
        other = dataclasses.replace(self, decode=_with_settings(self.decode, settings))
        other._prepared = self._prepared
        return other

    def translate(self, texts: Sequence[str], *, progress: bool = False, source: str = "input",
                  deadline: float | None = None, work: SearchWork | None = None) -> list[str]:
        """The best translation of each text, one line each, in input order (`deadline`, `work`: see
        `translate_nbest`)."""
        return [row[0].text for row in self.translate_nbest(texts, progress=progress, source=source,
                                                            deadline=deadline, work=work)]

    def translate_nbest(self, texts: Sequence[str], nbest: int | None = None, *, progress: bool = False,
                        source: str = "input", first_line: int = 1, work: SearchWork | None = None,
                        deadline: float | None = None) -> list[list[Translation]]:
        """`nbest` (default: `decode.nbest`) translations of each text with their scores, best first.

        A text is one sentence: its whitespace is normalised and a line break inside it is a space. Inputs
        longer than `decode.max_input_len` pieces are cropped, with a warning naming the line (`source` line
        N, the first text being line `first_line`); `progress` shows a bar on stderr. With a `deadline` (a
        time.monotonic() value) the search raises DeadlinePassed rather than start a batch after it. `work`
        (a `transformer.search.SearchWork`) adds up what the searches computed.
        """
        if isinstance(texts, str):
            raise TypeError("translate takes a list of texts; for one sentence write translate([text])")
        decode = self.decode if nbest is None else _with_settings(self.decode, {"nbest": nbest})
        model = self.model
        if decode.precision == "bf16":  # a copy made once, not per call (interactive mode calls per line)
            if self._prepared.bf16_model is None:
                self._prepared.bf16_model = bfloat16_copy(self.model)
            model = self._prepared.bf16_model
        ids = self.vocab.encode([" ".join(t.split()) for t in texts])
        for index, row in enumerate(ids):
            if len(row) > decode.max_input_len - len(self.source_prefix):
                log.warning("%s line %d has %d pieces: cropped to decode.max_input_len=%d", source,
                            first_line + index, len(row), decode.max_input_len)
                row = row[: decode.max_input_len - len(self.source_prefix)]
            ids[index] = self.source_prefix + row if row else []  # an empty line stays empty, tag or not
        with tqdm(total=len(ids), desc="translating", unit="line", file=sys.stderr, disable=not progress,
                  mininterval=1.0) as bar:
            hyps = translate_ids(model, ids, decode, device=self.device, progress=bar, deadline=deadline,
                                 first_id=first_line - 1, work=work, weights=self._prepared.weights)
        out = []
        for index, row in enumerate(hyps):
            # Byte-fallback pieces can spell a line break; one translation must stay one output line.
            detok = [" ".join(text.splitlines()) for text in self.vocab.decode([h.tokens for h in row])]
            if decode.noise:  # noised back-translation: the noise of a line depends on its number, as sampling
                detok = [noisy(text, seed=decode.seed, line=first_line - 1 + index, rank=rank,
                               filler=decode.noise_filler) for rank, text in enumerate(detok)]
            out.append([Translation(text=text, score=h.score) for text, h in zip(detok, row)])
        return out


def _target(data_cfg: dict, tgt_lang: str | None, vocab, name) -> tuple[str | None, list[int]]:
    """(the language a model translates into, the pieces put before each source) for a request of `tgt_lang`
    (None: the model's own); a one-line ConfigError where the model cannot."""
    tags, own = language_tags(data_cfg), data_cfg.get("tgt_lang")
    if tags:
        if tgt_lang not in tags:
            asked = "no tgt_lang is given" if tgt_lang is None else f"tgt_lang={tgt_lang} is not one of them"
            raise ConfigError(f"{name} is a multilingual model translating into {', '.join(tags)}, and {asked}: "
                              f"give tgt_lang=<one of {', '.join(tags)}>")
        return tgt_lang, [vocab.piece_id(tags[tgt_lang])]
    if tgt_lang is not None and own is not None and tgt_lang != own:
        raise ConfigError(f"tgt_lang={tgt_lang}: {name} translates {data_cfg.get('src_lang')}→{own} only; give "
                          f"tgt_lang={own} or leave it out")
    return own if tgt_lang is None else tgt_lang, []


def run_decode(record: dict) -> DecodeConfig:
    """The search settings a checkpoint's run was trained with (its `decode.*` config: what its validation BLEU
    and end-of-training test translation used), completed with the paper's for keys it lacks; the paper's
    (`DecodeConfig()`) for a checkpoint without a run config (e.g. an imported Marian model).

    A run's own evaluation then decodes as the run did: `python evaluate.py checkpoint=RUN ...` scores the
    same hypotheses as the end-of-training test, unless decode.* keys say otherwise."""
    saved = (record.get("config") or {}).get("decode") or {}
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    return DecodeConfig(**{key: value for key, value in saved.items() if key in fields})


def _with_settings(decode: DecodeConfig, settings: dict) -> DecodeConfig:
    """`decode` with some fields replaced; its own checks apply (a ConfigError names the key)."""
    fields = {f.name for f in dataclasses.fields(DecodeConfig)}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise TypeError(f"unknown search setting(s) {', '.join(unknown)}: the settings are DecodeConfig's fields "
                        f"({', '.join(sorted(fields))})")
    return dataclasses.replace(decode, **settings)
