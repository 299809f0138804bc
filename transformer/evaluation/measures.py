"""How a model is scored on a corpus it is not trained on: BLEU of its translations (`split_bleu`) and perplexity
(`corpus_nll`), and the files a scoring leaves (`write_results`). evaluate.py and a training run's validation
(transformer/training/validation.py) both use them."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Sequence

import torch

from data.files import atomic_write
from transformer import distributed
from transformer.config import DecodeConfig
from transformer.loss import label_smoothed_nll
from transformer.evaluation.scoring import Score, package_versions, sacrebleu_scores
from transformer.search import Seq2Seq
from transformer.decoding.translation import length_sorted_batches, pad_rows, translate_ids


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
    """`out`/hyp.txt (one translation per line) and `out`/scores.json (`results` and the package versions that
    produced them), each written atomically."""
    atomic_write(out / "hyp.txt", "".join(line + "\n" for line in hypotheses))
    record = {**results, "versions": results.get("versions") or package_versions()}
    atomic_write(out / "scores.json", json.dumps(record, indent=2) + "\n")


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
