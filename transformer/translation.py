"""The decoding and evaluation library: load a model, translate text, score a corpus.

- `Translator.load(checkpoint)`: a model or an ensemble with its vocabulary, from run directories or .pt
  files, keeping only the weights (not the Adam moments of last.pt).
- `translate_ids` / `Translator.translate`: token batching around `beam_search`, in input order, with the
  search settings of one `DecodeConfig`.
- `split_bleu`: sacreBLEU (and tokBLEU) of a decoded split; validation BLEU and the end-of-training test
  translation are both this function.
- `corpus_nll`: label-smoothed loss, NLL and perplexity of a corpus, its batches split over the ranks;
  train.py's validation and evaluate.py's perplexity are both this function.

translate.py and evaluate.py are thin command lines over this module.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
from tqdm import tqdm

from data.errors import DataError
from data.vocab import load_vocab
from transformer import checkpoint as ckpt
from transformer import distributed, kernels
from transformer.config import ConfigError, DecodeConfig
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.scoring import Score, sacrebleu_scores
from transformer.search import Ensemble, Hypothesis, Seq2Seq, beam_search, greedy_search

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


@torch.inference_mode()
def translate_ids(model: Seq2Seq, sources: Sequence[Sequence[int]], decode: DecodeConfig, *,
                  device: torch.device | str = "cpu", progress=None) -> list[list[Hypothesis]]:
    """Search every source (pieces without EOS) and return its `decode.nbest` hypotheses, in input order.

    An empty source yields no search and an empty hypothesis (score 0): translating nothing gives nothing.
    """
    config = model.config
    results: list[list[Hypothesis]] = [[Hypothesis(tokens=[], score=0.0)] * decode.nbest for _ in sources]
    todo = [i for i, src in enumerate(sources) if len(src) > 0]
    lengths = [len(sources[i]) + 1 for i in todo]
    if decode.precision == "bf16":
        kernels.warn_if_emulated("bf16", torch.device(device).type)
        # As inference engines do: the weights themselves in bfloat16 (autocast would re-cast them at every
        # matmul and keep float32 activations: slower decoding on CPU). Search scores in float32.
        model = copy.deepcopy(model).to(torch.bfloat16)
    limits = {"max_len_a": decode.max_len_a, "max_len_b": decode.max_len_b, "min_len": decode.min_len,
              "lenpen": decode.lenpen, "lenpen_style": decode.lenpen_style}
    for batch in length_sorted_batches(lengths, decode.max_tokens):
        indices = [todo[j] for j in batch]
        src = pad_rows((list(sources[i]) + [config.eos_id] for i in indices), config.pad_id, device)
        if decode.beam == 1 and decode.lenpen == 0:  # the same result as beam_search, without the beam bookkeeping
            hyps = greedy_search(model, src, **limits)
        else:
            hyps = beam_search(model, src, beam=decode.beam, nbest=decode.nbest, **limits)
        for i, hyp in zip(indices, hyps):
            results[i] = hyp
        if progress is not None:
            progress.update(len(indices))
    return results


# ------------------------------------------------------------------------------------------ the translator


@dataclass
class Translator:
    """A model (or an ensemble) with its vocabulary and languages, ready to translate text."""

    model: Seq2Seq
    vocab: object  # data.vocab.Vocab
    src_lang: str | None
    tgt_lang: str | None
    device: torch.device
    checkpoints: list[dict]  # what each checkpoint holds besides its weights (step, config, TrainState keys)

    @classmethod
    def load(cls, checkpoint, device: torch.device | str = "cpu") -> Translator:
        """From a run directory, a .pt file, or a list of them (an ensemble sharing one vocabulary)."""
        names = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
        if not names:
            raise ConfigError("checkpoint=[] names no checkpoint: give a run directory or a .pt file")
        paths = [ckpt.resolve(str(name)) for name in names]
        states = [ckpt.load(path) for path in paths]
        protos = []
        for path, state in zip(paths, states):  # every vocabulary is checked before any model is built
            try:
                protos.append(ckpt.spm_bytes(state))
            except ckpt.CheckpointError as error:
                raise ckpt.CheckpointError(f"{path}: {error}") from None
            if protos[-1] != protos[0]:
                raise ConfigError(f"{path} has another vocabulary than {paths[0]}: an ensemble needs models that "
                                  "share one SentencePiece model")
        try:
            vocab = load_vocab(protos[0])
        except DataError as error:
            raise ckpt.CheckpointError(f"{paths[0]}: its stored vocabulary is unreadable ({error}); use another "
                                       "checkpoint") from None
        models, records = [], []
        for path, state in zip(paths, states):
            models.append(_model_of(state, path, vocab.size).to(device).eval())
            records.append({k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler",
                                                                         "scaler", "data_state", "spm_model")})
            records[-1]["params"] = sum(t.numel() for t in state["model"].values())
            log.info("loaded %s (update %s)", path, state.get("step"))
        del states  # the weights are in the models now; the Adam moments of last.pt are not kept
        data_cfg = (records[0].get("config") or {}).get("data", {})
        return cls(model=models[0] if len(models) == 1 else Ensemble(models), vocab=vocab,
                   src_lang=data_cfg.get("src_lang"), tgt_lang=data_cfg.get("tgt_lang"),
                   device=torch.device(device), checkpoints=records)

    @classmethod
    def from_state(cls, state: dict, device: torch.device | str = "cpu", *, name: str = "checkpoint") -> Translator:
        """From a checkpoint dict already in memory, e.g. `checkpoint.average(...)` made on the fly; `name`
        stands for its path in error messages."""
        try:
            vocab = Vocab.from_bytes(ckpt.spm_bytes(state))
        except (ckpt.CheckpointError, DataError) as error:
            raise ckpt.CheckpointError(f"{name}: its vocabulary is unusable ({error})") from None
        record = {k: v for k, v in state.items() if k not in ("model", "optimizer", "scheduler", "scaler",
                                                              "data_state", "spm_model")}
        record["params"] = sum(t.numel() for t in state["model"].values())
        data_cfg = (record.get("config") or {}).get("data", {})
        return cls(model=_model_of(state, name, vocab.size).to(device).eval(), vocab=vocab,
                   src_lang=data_cfg.get("src_lang"), tgt_lang=data_cfg.get("tgt_lang"),
                   device=torch.device(device), checkpoints=[record])

    def translate(self, texts: list[str], decode: DecodeConfig, *, progress: bool = False,
                  source: str = "input") -> list[list[tuple[str, float]]]:
        """(translation, score) lists, `decode.nbest` per input text, best first; one line each."""
        ids = self.vocab.encode([" ".join(t.split()) for t in texts])
        for number, row in enumerate(ids, start=1):
            if len(row) > decode.max_input_len:
                log.warning("%s line %d has %d pieces: cropped to decode.max_input_len=%d", source, number,
                            len(row), decode.max_input_len)
                ids[number - 1] = row[: decode.max_input_len]
        with tqdm(total=len(ids), desc="translating", unit="line", file=sys.stderr, disable=not progress,
                  mininterval=1.0) as bar:
            hyps = translate_ids(self.model, ids, decode, device=self.device, progress=bar)
        out = []
        for row in hyps:
            # Byte-fallback pieces can spell a line break; one translation must stay one output line.
            detok = [" ".join(text.splitlines()) for text in self.vocab.decode([h.tokens for h in row])]
            out.append(list(zip(detok, [h.score for h in row])))
        return out


def _model_of(state: dict, path, vocab_size: int) -> Transformer:
    """The model of a loaded checkpoint, its config and weights checked against each other and the vocabulary."""
    config = state.get("model_config")
    if not isinstance(config, dict):
        raise ckpt.CheckpointError(f"{path} has no model_config: it was not written by this framework's "
                                   "train.py; use another checkpoint")
    try:
        model = Transformer(TransformerConfig(**config))
    except (TypeError, ValueError) as error:
        raise ckpt.CheckpointError(f"{path} has an invalid model_config ({error}); use another checkpoint") from None
    if model.config.vocab_size != vocab_size:
        raise ckpt.CheckpointError(f"{path}: its model has {model.config.vocab_size} token embeddings but its "
                                   f"vocabulary {vocab_size} pieces; the file is inconsistent: use another")
    ckpt.load_model_state(model, state["model"], path, fix="the file is damaged or foreign: use another checkpoint")
    return model


def split_lines(raw: bytes, source: str) -> list[str]:
    """Split raw bytes into lines; invalid UTF-8 is replaced, with a warning naming the line."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    texts = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix(b"\r")
        try:
            texts.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            log.warning("%s line %d is not valid UTF-8: the bad bytes were replaced by U+FFFD", source, number)
            texts.append(line.decode("utf-8", errors="replace"))
    return texts


# ------------------------------------------------------------------------------------------------ scoring


def split_bleu(model: Seq2Seq, vocab, src_ids: Sequence[Sequence[int]], references: list[str], decode: DecodeConfig,
               *, lang: str, device: torch.device | str) -> tuple[list[Score], list[str]]:
    """sacreBLEU's BLEU and chrF and the paper's tokBLEU of the decoded `src_ids` against `references`;
    returns (scores, the detokenised best hypotheses). The model is put back in its training mode."""
    training = getattr(model, "training", False)
    model.eval()
    try:
        hyps = translate_ids(model, src_ids, decode, device=device)
    finally:
        model.train(training)
    texts = vocab.decode([h[0].tokens for h in hyps])
    return sacrebleu_scores(texts, references, lang=lang), texts


def write_results(out: Path, hypotheses: Sequence[str], results: dict) -> None:
    """`out`/hyp.txt (one translation per line) and `out`/scores.json, each written atomically."""
    ckpt.atomic_write(out / "hyp.txt", "".join(line + "\n" for line in hypotheses))
    ckpt.atomic_write(out / "scores.json", json.dumps(results, indent=2) + "\n")


@torch.no_grad()
def corpus_nll(model, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], *, max_tokens: int,
               device: torch.device | str, label_smoothing: float = 0.0, autocast=None,
               rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """Per-token label-smoothed loss, NLL and perplexity of the targets given the sources (the paper's
    Table 3 "PPL (dev)" is `ppl` with per-piece tokens). Rows with an empty side are skipped. Under DDP
    each rank scores every `world_size`-th batch and the sums are all-reduced (every rank must call it).
    For an ensemble, the scores are its averaged log-probabilities' (`Ensemble.forward`)."""
    config = model.config
    keep = [i for i in range(len(src_ids)) if len(src_ids[i]) and len(tgt_ids[i])]
    lengths = [max(len(src_ids[i]), len(tgt_ids[i])) + 1 for i in keep]
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, tokens
    training = model.training
    model.eval()
    for batch in list(length_sorted_batches(lengths, max_tokens))[rank::world_size]:
        rows = [keep[j] for j in batch]
        src = pad_rows(([*src_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        tgt_in = pad_rows(([config.bos_id, *tgt_ids[i]] for i in rows), config.pad_id, device)
        tgt_out = pad_rows(([*tgt_ids[i], config.eos_id] for i in rows), config.pad_id, device)
        with autocast or contextlib.nullcontext():
            logits = model(src, tgt_in)
        loss, nll = label_smoothed_nll(logits, tgt_out, epsilon=label_smoothing, ignore_index=config.pad_id)
        sums += torch.stack([loss.double(), nll.double(), (tgt_out != config.pad_id).sum().double()])
    model.train(training)
    distributed.all_reduce_sum(sums)
    loss, nll, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    return {"loss": loss / tokens, "nll": nll / tokens, "ppl": math.exp(min(nll / tokens, 100.0))}
