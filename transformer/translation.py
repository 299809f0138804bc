"""Translating many sentences: token batching around `beam_search`, in input order.

Works on token ids (the callers turn text into ids and back), so it needs neither the vocabulary nor the
entry points.
"""

from __future__ import annotations

import copy
from typing import Iterable, Iterator, Sequence

import torch

from transformer import kernels
from transformer.search import Hypothesis, beam_search, greedy_search


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
def translate_ids(
    model,
    sources: Sequence[Sequence[int]],
    *,
    beam: int,
    lenpen: float,
    lenpen_style: str,
    max_len_a: float,
    max_len_b: int,
    min_len: int = 0,
    nbest: int = 1,
    max_tokens: int = 8000,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    progress=None,
) -> list[list[Hypothesis]]:
    """Search every source (pieces without EOS) and return the hypotheses in input order.

    An empty source yields no search and an empty hypothesis (score 0): translating nothing gives nothing.
    """
    config = model.config
    results: list[list[Hypothesis]] = [[Hypothesis(tokens=[], score=0.0)] * nbest for _ in sources]
    todo = [i for i, src in enumerate(sources) if len(src) > 0]
    lengths = [len(sources[i]) + 1 for i in todo]
    if precision == "bf16":
        kernels.warn_if_emulated("bf16", torch.device(device).type)
        # As inference engines do: the weights themselves in bfloat16 (autocast would re-cast them at every
        # matmul and keep float32 activations: 5-17 % slower decoding on CPU). Search scores in float32.
        model = copy.deepcopy(model).to(torch.bfloat16)
    for batch in length_sorted_batches(lengths, max_tokens):
        indices = [todo[j] for j in batch]
        src = pad_rows((list(sources[i]) + [config.eos_id] for i in indices), config.pad_id, device)
        if beam == 1 and lenpen == 0:  # the same result as beam_search, without the beam bookkeeping
            hyps = greedy_search(model, src, max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len,
                                 lenpen=lenpen, lenpen_style=lenpen_style)
        else:
            hyps = beam_search(model, src, beam=beam, lenpen=lenpen, lenpen_style=lenpen_style,
                               max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len, nbest=nbest)
        for i, hyp in zip(indices, hyps):
            results[i] = hyp
        if progress is not None:
            progress.update(len(indices))
    return results
