"""Cross-attention weights of a trained model, and word alignments read from them.

The model's attention runs in fused kernels that never hold the weights. `cross_attention` reruns a
teacher-forced forward pass with a hook on each decoder layer's encoder-decoder attention that recomputes
softmax(Q K^T / sqrt(d_k)) from the layer's own inputs (`CrossAttention.weights`): the model's outputs are
untouched, and training and search, which never enter this module, pay nothing.

Word alignments (`translate.py alignment=true`) follow the Moses / fast_align convention: `i-j` pairs of a
0-based source word i and target word j, words being the whitespace tokens of the source text and of the
detokenised translation. They come from the attention of one decoder layer (`default_alignment_layer`),
averaged over heads: the attention row of the step that outputs a target piece is that piece's row; each
target word takes the mean row of its pieces, each source word the summed weight of its pieces, and a
target word is aligned to the source word it gives the most weight. That is an attention alignment, not a
trained one (no alignment supervision, no symmetrisation): see docs/EVALUATION.md for what it is worth.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor

from transformer.model import Transformer


@contextlib.contextmanager
def recording_cross_attention(model: Transformer) -> Iterator[list[Tensor]]:
    """Within the block, every decoder pass of `model` appends each layer's cross-attention weights
    [B*K, H, T, S] (float32, layer order) to the yielded list. Outputs are the fused path's."""
    recorded: list[Tensor] = []

    def record(module, args, output):
        x, memory_kv, src_mask = args
        recorded.append(module.weights(x, memory_kv, src_mask).detach())

    handles = [layer.cross_attn.register_forward_hook(record) for layer in model.decoder.layers]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def cross_attention(model: Transformer, src_ids: Sequence[int], tgt_ids: Sequence[int]) -> Tensor:
    """The cross-attention of one sentence pair, teacher-forced: [layers, H, T + 1, S + 1] float32 on the CPU.

    Source row: `src_ids` then EOS; decoder input: BOS then `tgt_ids`. Row t is the step that outputs
    tgt_ids[t] (the last row outputs EOS); column s is source piece s (the last is EOS). The model is put
    back in its training mode.
    """
    config = model.config
    device = model.embedding.weight.device
    src = torch.tensor([[*src_ids, config.eos_id]], device=device)
    tgt_in = torch.tensor([[config.bos_id, *tgt_ids]], device=device)
    training = model.training
    model.eval()
    try:
        with recording_cross_attention(model) as recorded:
            model(src, tgt_in)
    finally:
        model.train(training)
    return torch.cat(recorded).cpu()  # layers x [1, H, T+1, S+1] -> [layers, H, T+1, S+1]


def default_alignment_layer(decoder_layers: int) -> int:
    """The penultimate decoder layer (0-based), but never one below the middle: max(N - 2, N // 2).

    Why: Garg et al. 2019 ("Jointly Learning to Align and Translate with Transformer Models") found the
    penultimate layer's head-averaged attention the closest to human word alignments of a six-layer
    Transformer's layers (layer 4 of 0..5 here). In a two-layer decoder the penultimate is the first layer,
    whose attention on the tests' tiny reversal model aligns clearly worse than the second's, so a two-layer
    decoder uses its second (docs/EVALUATION.md has the figures and what such alignments are worth).
    """
    return max(decoder_layers - 2, decoder_layers // 2)


def word_alignment(attention: Tensor, src_words: Sequence[int], tgt_words: Sequence[int]) -> list[tuple[int, int]]:
    """(source word, target word) pairs from one layer's head-averaged attention [T + 1, S + 1] (as
    `cross_attention` gives, EOS row and column included) and the word of each source / target piece.

    A target word's row is the mean of its pieces' rows; a source word's weight is the sum of its
    pieces' (the EOS column, where attention often parks, counts for no word). Each target word is
    aligned to the source word of largest weight. Sorted by target word, then source word.
    """
    if not src_words or not tgt_words:
        return []
    pieces = attention[: len(tgt_words), : len(src_words)].double()  # [T, S]: without EOS
    src_index = torch.tensor(src_words)
    tgt_index = torch.tensor(tgt_words)
    n_src, n_tgt = int(src_index.max()) + 1, int(tgt_index.max()) + 1
    by_src = torch.zeros(len(tgt_words), n_src, dtype=torch.float64).index_add_(1, src_index, pieces)  # [T, Ws]
    by_word = torch.zeros(n_tgt, n_src, dtype=torch.float64).index_add_(0, tgt_index, by_src)  # [Wt, Ws]
    counts = torch.bincount(tgt_index, minlength=n_tgt)
    links = [(int(by_word[j].argmax()), j) for j in range(n_tgt) if counts[j] > 0]
    return sorted(links, key=lambda link: (link[1], link[0]))


@dataclass(frozen=True, kw_only=True)
class Aligner:
    """Word alignments of translations by one model of a `Translator`, from decoder layer `layer`."""

    model: Transformer
    vocab: object  # data.vocab.Vocab or MarianVocab
    layer: int
    source_prefix: list[int] = field(default_factory=list)  # a multilingual model's target tag, as it translated

    def align(self, source: str, translation: str) -> list[tuple[int, int]]:
        """The (source word, target word) links of one sentence pair; none when either side is empty."""
        src_ids, src_words = self.vocab.encode_words(" ".join(source.split()))
        tgt_ids, tgt_words = self.vocab.encode_words(translation, target=True)
        if not src_ids or not tgt_ids:
            return []
        attention = cross_attention(self.model, self.source_prefix + src_ids, tgt_ids)[self.layer].mean(dim=0)
        return word_alignment(attention[:, len(self.source_prefix):], src_words, tgt_words)  # [T+1, S+1]: no tag


def format_alignment(links: Sequence[tuple[int, int]]) -> str:
    """Moses / fast_align text: "i-j i-j ..." (source-target, 0-based)."""
    return " ".join(f"{i}-{j}" for i, j in links)
