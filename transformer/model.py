"""The Transformer of "Attention Is All You Need" (Vaswani et al. 2017), §3, section by section.

After the config, the sections follow the paper's: the model of Figure 1 (§3), which also holds §3.4 (its
one embedding matrix serves source, target and the pre-softmax projection); §3.1 encoder and decoder
stacks; §3.2 attention; §3.3 feed-forward; §3.5 positional encoding (the sinusoids, and the learned
positions of Table 3 row (E)). Last comes what only incremental decoding (search) uses: the decoder cache.
Every linear map is `Linear` (an `nn.Linear`) or `linear` (`F.linear`), and attention is
`F.scaled_dot_product_attention`'s maths: transformer/kernels.py only routes CPU work to faster kernels
(same maths, up to the rounding of sums).

Axis letters used in shape comments:
    B  batch (sentences, or sentences x beams during search)
    S  source length            T  target length (with a cache: the new positions only)
    L  target positions attended with a decoder cache (past + new)
    D  model width (d_model)    H  heads
    Dk  query/key width per head (d_k: D / H unless config.d_k is set, Table 3 row (B))
    Dv  value width per head (d_v = D / H, so that Concat(head_1..head_H) is D wide)
    F  feed-forward width (d_ff)           V  vocabulary size

Mask convention, the only one in this file: a boolean mask is True where a query MAY attend to a key.
`F.scaled_dot_product_attention` reads boolean masks the same way; note that `nn.MultiheadAttention` and
`nn.Transformer*` read them the other way round (True = blocked).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.config import ConfigError, ModelConfig, model_preset
from transformer.kernels import Linear, linear, scaled_dot_product_attention


# ----------------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(ModelConfig):
    """The architecture (`model.*`, transformer/config.py's ModelConfig, whose checks it runs) with its
    vocabulary: size and special ids. `dataclasses.asdict(config)` is what checkpoints store.

    The decoder starts with `bos_id`. Marian vocabularies have no BOS and start the decoder with PAD, so
    bos_id == pad_id is allowed (every other pair of special ids must differ). With
    `shared_embeddings=False` the target side may have its own vocabulary of `target_vocab_size` ids
    (None: vocab_size); the special ids are ids of both.
    """

    vocab_size: int
    target_vocab_size: int | None = None
    pad_id: int = 0
    unk_id: int = 1
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not _is_int(self.vocab_size) or self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size!r} is invalid: set data.vocab_size to a positive integer")
        if self.target_vocab_size is not None:
            if not _is_int(self.target_vocab_size) or self.target_vocab_size < 1:
                raise ValueError(f"target_vocab_size={self.target_vocab_size!r} is invalid: use a positive integer "
                                 "or None (the source's vocab_size)")
            if self.shared_embeddings and self.target_vocab_size != self.vocab_size:
                raise ValueError(f"target_vocab_size={self.target_vocab_size} differs from vocab_size="
                                 f"{self.vocab_size}, but one embedding serves both sides: set "
                                 "shared_embeddings=False or target_vocab_size=None")
        smallest, size_key = ((self.target_size, "target_vocab_size") if self.target_size < self.vocab_size
                              else (self.vocab_size, "vocab_size"))
        special = {"pad_id": self.pad_id, "unk_id": self.unk_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in special.items():
            if not _is_int(value) or not 0 <= value < smallest:
                raise ValueError(
                    f"{name}={value!r} is not a token id of a vocabulary of {size_key}={smallest}: "
                    f"use an id in [0, {smallest}) or a larger vocabulary"
                )
        distinct = {name: value for name, value in special.items() if name != "bos_id" or value != self.pad_id}
        if len(set(distinct.values())) != len(distinct):
            listed = ", ".join(f"{name}={value}" for name, value in special.items())
            raise ValueError(f"special token ids must be distinct (only bos_id may equal pad_id), got {listed}: "
                             "give each its own id")

    @property
    def target_size(self) -> int:
        """Ids of the target side: the decoder's embeddings and the logits' width (V of the decoder)."""
        return self.vocab_size if self.target_vocab_size is None else self.target_vocab_size

    @classmethod
    def base(cls, vocab_size: int = 37000, **overrides) -> TransformerConfig:
        """Table 3, "base": N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1 (configs/model/base.yaml)."""
        return cls(vocab_size=vocab_size, **{**dataclasses.asdict(model_preset("base")), **overrides})

    @classmethod
    def big(cls, vocab_size: int = 37000, **overrides) -> TransformerConfig:
        """Table 3, "big": N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3 (configs/model/big.yaml)."""
        return cls(vocab_size=vocab_size, **{**dataclasses.asdict(model_preset("big")), **overrides})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _embedding(vocab_size: int, d_model: int, pad_id: int) -> nn.Embedding:
    """N(0, D^-0.5) rows (tensor2tensor, fairseq: times sqrt(D) they start at unit size), PAD's row zero."""
    embedding = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
    nn.init.normal_(embedding.weight, mean=0.0, std=d_model**-0.5)
    with torch.no_grad():
        embedding.weight[pad_id].zero_()
    return embedding


# ----------------------------------------------------------------------------------------------------
# §3 Model architecture (Figure 1), with §3.4 embeddings and softmax


ENCODE_GROUP = 32  # sources a group when search encodes a batch (`Transformer._encode_in_groups`)


def _right_padded(src_mask: Tensor) -> bool:
    """Whether no real token follows padding in any row of src_mask [B, S] (one host sync)."""
    return not bool((src_mask[:, 1:] & ~src_mask[:, :-1]).any())


class EncoderOut(NamedTuple):
    out: Tensor  # [B, S, D]
    src_mask: Tensor  # [B, S] bool, True = real token
    padded: bool = True  # whether any source holds padding (True: not known to hold none)

    @property
    def key_mask(self) -> Tensor | None:
        """What attention over the source keys is given: src_mask, or None for a batch without padding."""
        return self.src_mask if self.padded else None


class Transformer(nn.Module):
    """The encoder-decoder of Figure 1. Training, greedy and beam search all go through encode/decode.

    Marian's variants (config `shared_embeddings=False`, `scale_embedding=False`, `logits_bias=True`; see
    ModelConfig) change only this class: the decoder then has its own `target_embedding` (also its
    pre-softmax projection), embeddings are not scaled, and a fixed `logits_bias` buffer is added to the
    logits. A buffer, not a parameter: Marian's is a constant of the converted model that nothing trains.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        # §3.4: one matrix for source embeddings, target embeddings and the pre-softmax projection.
        # N(0, D^-0.5) as tensor2tensor and fairseq: scaled by sqrt(D), embeddings start at unit size.
        self.embedding = _embedding(config.vocab_size, d, config.pad_id)
        self.target_embedding = None if config.shared_embeddings else _embedding(config.target_size, d, config.pad_id)
        if config.logits_bias:
            self.register_buffer("logits_bias", torch.zeros(config.target_size))
        else:
            self.logits_bias = None
        self.positions = (LearnedPositions(config.max_positions, d) if config.positions == "learned"
                          else SinusoidalPositions(d))
        self.embed_dropout = nn.Dropout(config.dropout)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    @property
    def output_embedding(self) -> nn.Embedding:
        """The target side's embedding, which is also the pre-softmax projection (§3.4)."""
        return self.embedding if self.target_embedding is None else self.target_embedding

    def embed(self, tokens: Tensor, start: int = 0, *, target: bool = False) -> Tensor:
        """tokens [B, T] at positions start.. -> Dropout(E[tokens] * sqrt(D) + PE) [B, T, D] (§3.4, §3.5, §5.4).
        With learned positions, a position past the table raises a one-line ConfigError (`LearnedPositions`)."""
        x = (self.output_embedding if target else self.embedding)(tokens)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.d_model)
        x = x + self.positions(start, tokens.shape[1]).to(x.dtype)  # [B, T, D] + [T, D]
        return self.embed_dropout(x)

    def encode(self, src_tokens: Tensor, *, padded: bool | None = None) -> EncoderOut:
        """src_tokens [B, S] int64 (pieces, EOS, then PAD) -> EncoderOut(out [B, S, D], src_mask [B, S], padded).

        A batch without padding attends with no mask at all, in the encoder and in the cross-attention of a
        teacher-forced `decode`: `F.scaled_dot_product_attention` may then pick any of its kernels (on GPU
        flash attention takes no mask; the others read one at a cost). `padded` says whether any source
        holds padding; None looks (a host sync on GPU: train.py tells it from the batch instead). In a
        compiled graph the mask is always kept, so that a graph serves padded and unpadded batches alike.

        In inference mode (search) a batch of more than ENCODE_GROUP sources is encoded in groups of that
        many sources of similar length, each cut to its longest (`_encode_in_groups`): the same outputs at
        the real positions, up to the rounding of sums, without encoding one batch-wide width of padding.
        """
        src_mask = src_tokens != self.config.pad_id
        if torch.compiler.is_compiling():
            padded = True
        elif padded is None:
            padded = bool((~src_mask).any())
        # A data-dependent check (the host waits for the device): not in compiled graphs, nor in training,
        # whose batches come from data.batching.collate, which ends every source with EOS.
        if not (self.training or torch.compiler.is_compiling()):
            empty = ~src_mask.any(dim=1)
            if empty.any():
                row = int(empty.nonzero()[0, 0])
                raise ValueError(
                    f"source row {row} is all padding: every source needs at least one token "
                    f"(sentences end with EOS={self.config.eos_id})"
                )
        # is_compiling first: dynamo cannot trace is_inference_mode_enabled and would cut the graph here
        if (not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()
                and src_tokens.shape[0] > ENCODE_GROUP and _right_padded(src_mask)):  # a cut keeps every token
            out = self._encode_in_groups(src_tokens, src_mask)
        else:
            out = self.encoder(self.embed(src_tokens), src_mask if padded else None)
        return EncoderOut(out=out, src_mask=src_mask, padded=padded)

    def _encode_in_groups(self, src_tokens: Tensor, src_mask: Tensor) -> Tensor:
        """The encoder output [B, S, D] of right-padded sources, computed ENCODE_GROUP sources at a time in
        order of length, each group only as wide as its longest source (0 beyond that width).

        Padding keys are never attended and each position's embedding depends on its own token and place,
        so cutting a group's padding columns changes no output at a real position (only how the kernels
        block the sums). Why: a translation batch holds up to decode.max_tokens source tokens of mixed
        lengths and is padded to its longest; 300 Multi30k test sources made two batches of 9,465 positions
        for 5,061 tokens, 5,691 in groups of 32 (docs/BENCHMARKS.md, "Encoding in groups").
        """
        lengths = src_mask.sum(dim=1)
        order = lengths.argsort(descending=True, stable=True)
        widths = lengths[order].tolist()
        out = None
        for start in range(0, len(widths), ENCODE_GROUP):
            rows, width = order[start:start + ENCODE_GROUP], widths[start]
            group = self.encoder(self.embed(src_tokens[rows, :width]), src_mask[rows, :width])  # [G, width, D]
            if out is None:
                out = group.new_zeros(*src_tokens.shape, group.shape[-1])
            out[rows, :width] = group
        return out

    def init_cache(self, encoder_out: EncoderOut, beams: int = 1) -> DecoderCache:
        """An empty decoder cache for these B sources, decoding `beams` rows per source (B * beams rows,
        row b * beams + k is beam k of source b), with the cross-attention K/V of every layer.
        `DecoderCache` is at the end of this file, with the rest of incremental decoding."""
        return DecoderCache.empty(self.decoder, encoder_out, beams)

    def decode(self, tgt_tokens: Tensor, encoder_out: EncoderOut,
               cache: DecoderCache | None = None) -> tuple[Tensor, DecoderCache | None]:
        """Target tokens -> (logits [B, T, V], cache).

        Without a cache: the teacher-forced pass over the whole target [B, T] (BOS first), cache None.
        With a cache: tgt_tokens [B*K, T] are the new positions only (usually T = 1) of the cache's rows, at
        positions cache.length..; encoder_out is not read (the cache holds what is needed); returns the
        new cache.
        """
        if cache is None:
            x, _ = self.decoder(self.embed(tgt_tokens, target=True), memory=encoder_out.out,
                                src_mask=encoder_out.key_mask)
        else:
            x, self_kv = self.decoder(self.embed(tgt_tokens, start=cache.length, target=True),
                                      src_mask=cache.src_mask, cache=cache)
            cache = dataclasses.replace(cache, self_k=[kv.k for kv in self_kv], self_v=[kv.v for kv in self_kv],
                                        rows=None)
        # x E^T: [B, T, D] @ [D, V] -> [B, T, V]; the paper has no bias, Marian a fixed one
        logits = linear(x, self.output_embedding.weight, self.logits_bias)
        return logits, cache

    def forward(self, src_tokens: Tensor, tgt_tokens: Tensor, *, src_padded: bool | None = None) -> Tensor:
        """src [B, S], decoder input [B, T] (BOS first) -> logits [B, T, V]. src_padded: as `encode`'s padded."""
        return self.decode(tgt_tokens, self.encode(src_tokens, padded=src_padded))[0]

    def log_probs(self, logits: Tensor) -> Tensor:
        """logits [.., V] from `decode` -> log softmax(logits) over the vocabulary [.., V] float32 (§3.4's softmax).

        float32 logits that need no gradient are overwritten: `decode` returns a fresh tensor each call, and
        writing into it spares search a new [rows, V] tensor every step (on CPU about a third of the time).
        """
        x = logits.float()
        if x.requires_grad:  # out= is not differentiable
            return F.log_softmax(x, dim=-1)
        return torch.log_softmax(x, dim=-1, out=x)


# ----------------------------------------------------------------------------------------------------
# §3.1 Encoder and decoder stacks


class Encoder(nn.Module):
    """N encoder layers; pre-norm adds a final LayerNorm (post-norm's last sublayer already ends with one)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        """x: [B, S, D], src_mask: [B, S] (True = real token; None: no padding) -> [B, S, D]."""
        for layer in self.layers:
            x = layer(x, src_mask)
        return x if self.final_norm is None else self.final_norm(x)


class ResidualLayer(nn.Module):
    """Wraps each sublayer in a residual connection, layer normalization and dropout (§3.1, §5.4).

    The paper's post-norm: LayerNorm(x + Dropout(Sublayer(x))). With `norm_first`, the pre-norm of later
    work (Wang et al. 2019; the tensor2tensor v1.x defaults): x + Dropout(Sublayer(LayerNorm(x))), and
    the stack ends with a final LayerNorm. A sublayer reads `sublayer_input(x)`; `add_norm` joins its
    output y back into x.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm_first = config.norm_first
        self.dropout = nn.Dropout(config.dropout)

    def sublayer_input(self, x: Tensor, norm: nn.LayerNorm) -> Tensor:
        return norm(x) if self.norm_first else x

    def add_norm(self, x: Tensor, y: Tensor, norm: nn.LayerNorm) -> Tensor:
        return x + self.dropout(y) if self.norm_first else norm(x + self.dropout(y))


class EncoderLayer(ResidualLayer):
    """Self-attention, then feed-forward."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        d = config.d_model
        self.self_attn = SelfAttention(d_model=d, heads=config.heads, d_k=config.key_width,
                                       bias=config.attention_bias, dropout=config.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(d)
        self.ffn = FeedForward(d_model=d, d_ff=config.d_ff, activation=config.activation,
                               dropout=config.activation_dropout)
        self.ffn_norm = nn.LayerNorm(d)

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        """x: [B, S, D], src_mask: [B, S] (True = real token; None: no padding) -> [B, S, D]."""
        y, _ = self.self_attn(self.sublayer_input(x, self.self_attn_norm), key_mask=src_mask)
        x = self.add_norm(x, y, self.self_attn_norm)
        y = self.ffn(self.sublayer_input(x, self.ffn_norm))
        return self.add_norm(x, y, self.ffn_norm)


class Decoder(nn.Module):
    """N decoder layers; pre-norm adds a final LayerNorm."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        self.final_norm = nn.LayerNorm(config.d_model) if config.norm_first else None

    def forward(self, x: Tensor, *, memory: Tensor | None = None, src_mask: Tensor | None,
                cache: DecoderCache | None = None) -> tuple[Tensor, list[PastKV | None]]:
        """x: [B, T, D] -> (x [B, T, D], with a cache: per layer the self-attention K/V of all positions).
        src_mask: [B, S] (True = real token), None for sources without padding.

        Without a cache: the whole target; cross-attention K/V are projected from memory [B, S, D].
        With a cache: x holds the positions after cache.length; cross K/V and past K/V come from it.
        """
        self_kv = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x, kv = layer(x, memory_kv=layer.cross_attn.memory_kv(memory), src_mask=src_mask)
            else:
                x, kv = layer(x, memory_kv=(cache.cross_k[i], cache.cross_v[i]), src_mask=src_mask,
                              past=PastKV(cache.self_k[i], cache.self_v[i], cache.rows))
            self_kv.append(kv)
        return (x if self.final_norm is None else self.final_norm(x)), self_kv


class DecoderLayer(ResidualLayer):
    """Causal self-attention, encoder-decoder attention, feed-forward."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        d = config.d_model
        self.self_attn = SelfAttention(d_model=d, heads=config.heads, d_k=config.key_width,
                                       bias=config.attention_bias, dropout=config.attention_dropout)
        self.self_attn_norm = nn.LayerNorm(d)
        self.cross_attn = CrossAttention(d_model=d, heads=config.heads, d_k=config.key_width,
                                         bias=config.attention_bias, dropout=config.attention_dropout)
        self.cross_attn_norm = nn.LayerNorm(d)
        self.ffn = FeedForward(d_model=d, d_ff=config.d_ff, activation=config.activation,
                               dropout=config.activation_dropout)
        self.ffn_norm = nn.LayerNorm(d)

    def forward(self, x: Tensor, *, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor | None,
                past: PastKV | None = None) -> tuple[Tensor, PastKV | None]:
        """x: [B, T, D], the positions after those of `past` -> (x [B, T, D], with `past`: self-attention K/V).

        Self-attention needs no key mask: targets are right-padded, so what a real position may see
        (itself and earlier positions) holds no padding.
        """
        y, kv = self.self_attn(self.sublayer_input(x, self.self_attn_norm), causal=True, past=past)
        x = self.add_norm(x, y, self.self_attn_norm)
        y = self.cross_attn(self.sublayer_input(x, self.cross_attn_norm), memory_kv, src_mask)
        x = self.add_norm(x, y, self.cross_attn_norm)
        y = self.ffn(self.sublayer_input(x, self.ffn_norm))
        return self.add_norm(x, y, self.ffn_norm), kv


# ----------------------------------------------------------------------------------------------------
# §3.2 Attention


def attention(q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None = None, causal: bool = False,
              dropout: float = 0.0) -> Tensor:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (§3.2.1), every head at once.

    q: [B, H, Tq, Dk]; k: [B, H, Tk, Dk]; v: [B, H, Tk, Dv] -> [B, H, Tq, Dv]. The scale is 1/sqrt(Dk), the
    width of q and k (the kernel reads it from q), whatever the width of v.
    key_mask: [B, Tk] bool, True = a real key (False: padding, never attended).
    causal: the queries are the last Tq of the Tk positions and each sees only keys up to its own
    position (§3.2.3: "prevent leftward information flow"); with Tq = Tk that is the usual triangle.

    The one place where masks become the kernel's: `F.scaled_dot_product_attention` reads a boolean
    `attn_mask` as True = may attend, our convention, so only shapes change here. `dropout`: the probability
    of dropping an attention weight (`model.attention_dropout` while training; not in the paper, whose §5.4
    drops sublayer outputs and embeddings only: 0).
    The kernel is `transformer.kernels.scaled_dot_product_attention` (the same maths, faster on CPU).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    may_attend = None if key_mask is None else key_mask[:, None, None, :]  # [B, Tk] -> [B, 1, 1, Tk]
    kernel_causal = False
    if causal and tq > 1:  # a single (newest) query may see every key: nothing to mask
        if tq == tk and may_attend is None:
            kernel_causal = True  # the kernel's own triangle: no mask tensor, flash attention on GPU
        else:
            seen = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)  # [Tq, Tk]
            may_attend = seen if may_attend is None else may_attend & seen  # [B, 1, Tq, Tk]
    return scaled_dot_product_attention(q, k, v, attn_mask=may_attend, is_causal=kernel_causal, dropout_p=dropout)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, T, H * Dh] -> [B, H, T, Dh], Dh being Dk or Dv."""
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)  # [B, T, H, Dh] -> [B, H, T, Dh]


def merge_heads(x: Tensor) -> Tensor:
    """[B, H, T, Dv] -> [B, T, D]: Concat(head_1, ..., head_h)."""
    b, h, t, dv = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dv)  # [B, T, H, Dv] -> [B, T, D]


class SelfAttention(nn.Module):
    """MultiHead(X) = Concat(head_1, ..., head_h) W^O, head_i = Attention(X W_i^Q, X W_i^K, X W_i^V) (§3.2.2).

    W^Q, W^K ([H*Dk, D] each) and W^V ([D, D]) of all heads are one fused bias-free projection; W^O is
    bias-free too. `d_k` (None: D / H) is the width of each head's queries and keys; values stay D / H wide.
    With `bias` (Marian's variant) each projection has a bias, initialised to zero. `dropout`: on the
    attention weights while training (`model.attention_dropout`; 0 = the paper).
    """

    def __init__(self, *, d_model: int, heads: int, d_k: int | None = None, bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.widths = [heads * (d_k or d_model // heads)] * 2 + [d_model]  # rows of W^Q, W^K, W^V
        self.in_proj = Linear(d_model, sum(self.widths), bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)  # W^O
        for block in self.in_proj.weight.split(self.widths):  # each gets its own Xavier bounds
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        _zero_biases(self.in_proj, self.out_proj)

    def forward(self, x: Tensor, *, key_mask: Tensor | None = None, causal: bool = False,
                past: PastKV | None = None) -> tuple[Tensor, PastKV | None]:
        """x: [B, T, D] -> (out [B, T, D], with `past`: the keys and values of every position attended).

        key_mask, causal: as in `attention`. past: earlier positions (incremental decoding); x holds the
        positions that follow them.
        """
        q, k, v = (split_heads(y, self.heads) for y in self.in_proj(x).split(self.widths, dim=-1))  # [B, H, T, Dk|Dv]
        if past is None:
            out = attention(q, k, v, key_mask=key_mask, causal=causal, dropout=self.dropout if self.training else 0.0)
            return self.out_proj(merge_heads(out)), None
        k = append_positions(past.k, past.rows, k.permute(2, 0, 1, 3))  # [L, B, H, Dk]
        v = append_positions(past.v, past.rows, v.permute(2, 0, 1, 3))  # [L, B, H, Dv]
        out = attention(q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), key_mask=key_mask, causal=causal)
        return self.out_proj(merge_heads(out)), PastKV(k, v)


class CrossAttention(nn.Module):
    """Encoder-decoder attention (§3.2.3): queries from the decoder, keys and values from the encoder
    output ("memory"). Bias-free projections: W^Q [H*Dk, D], W^K [H*Dk, D] and W^V [D, D] fused, W^O [D, D];
    with `bias` (Marian's variant) each has a bias, initialised to zero. `d_k` and `dropout` as in `SelfAttention`.
    """

    def __init__(self, *, d_model: int, heads: int, d_k: int | None = None, bias: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.widths = [heads * (d_k or d_model // heads), d_model]  # rows of W^K, W^V
        self.q_proj = Linear(d_model, self.widths[0], bias=bias)  # W^Q
        self.kv_proj = Linear(d_model, sum(self.widths), bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)  # W^O
        nn.init.xavier_uniform_(self.q_proj.weight)
        for block in self.kv_proj.weight.split(self.widths):
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.out_proj.weight)
        _zero_biases(self.q_proj, self.kv_proj, self.out_proj)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """memory [B, S, D] -> keys [B, H, S, Dk] and values [B, H, S, Dv]. Computed once per source sentence."""
        k, v = self.kv_proj(memory).split(self.widths, dim=-1)  # [B, S, H*Dk], [B, S, D]
        # contiguous: each is read whole by the matmuls of every decoding step
        return split_heads(k, self.heads).contiguous(), split_heads(v, self.heads).contiguous()

    def forward(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor | None) -> Tensor:
        """x: [B*K, T, D], memory_kv from `memory_kv` of B sources, src_mask [B, S] (True = real token; None:
        no padding) -> [B*K, T, D].

        K >= 1 rows per source (beam search's beams: rows b*K .. b*K+K-1 belong to source b) share the
        source's keys and values: the K*T queries of a source attend together, so the K/V are neither
        copied per beam nor moved when beams are reordered.
        """
        b, (rows, t, d) = memory_kv[0].shape[0], x.shape
        q = split_heads(self.q_proj(x).view(b, rows // b * t, -1), self.heads)  # [B, H, K*T, Dk]
        k, v = memory_kv
        out = attention(q, k, v, key_mask=src_mask, dropout=self.dropout if self.training else 0.0)  # [B, H, K*T, Dv]
        return self.out_proj(merge_heads(out).view(rows, t, d))

    def weights(self, x: Tensor, memory_kv: tuple[Tensor, Tensor], src_mask: Tensor | None) -> Tensor:
        """The weights softmax(Q K^T / sqrt(d_k)) that `forward` applies to V, from the same inputs:
        [B*K, H, T, S] float32, 0 on padding keys.

        For looking at a model (reports, word alignments) only: `forward`'s fused kernel never materialises
        them, and nothing in training or search calls this (transformer/evaluation/alignment.py does, from a hook).
        """
        (b, _, s, _), (rows, t, d) = memory_kv[0].shape, x.shape
        q = split_heads(self.q_proj(x).view(b, rows // b * t, -1), self.heads)  # [B, H, K*T, Dk]
        scores = q.float() @ memory_kv[0].float().transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, K*T, S]
        if src_mask is not None:
            scores = scores.masked_fill(~src_mask[:, None, None, :], float("-inf"))
        weights = scores.softmax(dim=-1).view(b, self.heads, rows // b, t, s)  # [B, H, K, T, S]
        return weights.transpose(1, 2).reshape(rows, self.heads, t, s)  # [B, K, H, T, S] -> [B*K, H, T, S]


def _zero_biases(*layers: nn.Linear) -> None:
    for layer in layers:
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


# ----------------------------------------------------------------------------------------------------
# §3.3 Position-wise feed-forward network

# The nonlinearity between W_1 and W_2: the paper's ReLU, or what Marian models use instead.
ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "swish": F.silu}  # gelu: exact (erf); swish = SiLU: x·σ(x)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2 (§3.3); `activation` replaces max(0, .) by GELU or swish
    (Marian's variants). `dropout` on the hidden activation (`model.activation_dropout`; 0 = the paper, whose
    §5.4 drops sublayer outputs only)."""

    def __init__(self, *, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.activation = ACTIVATION_FUNCTIONS[activation]
        for layer in (self.w1, self.w2):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.dropout(self.activation(self.w1(x))))  # [B, T, D] -> [B, T, F] -> [B, T, D]


# ----------------------------------------------------------------------------------------------------
# §3.5 Positional encoding


def sinusoids(length: int, d_model: int, *, start: int = 0, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5).

    Rows are positions start .. start+length-1: [length, D]. An odd D ends with an unpaired sine.
    Computed in float64 (angles reach thousands of radians), then cast to `dtype`.
    """
    pos = torch.arange(start, start + length, dtype=torch.float64, device=device)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
    angles = pos[:, None] / 10000.0 ** (two_i / d_model)  # [length, ceil(D/2)]
    table = torch.empty(length, d_model, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table.to(dtype)


class SinusoidalPositions(nn.Module):
    """§3.5 sinusoids for any position: a precomputed table, and on-demand rows beyond it.

    The table is a non-persistent buffer: it moves with `.to(device)` but is not in the state_dict (it
    is a pure function of D). Positions past its end are computed per call instead of growing the
    buffer, so the module never changes during a forward (identical on every DDP rank, no recompiles).
    """

    def __init__(self, d_model: int, table_length: int = 1024):
        super().__init__()
        self.d_model = d_model
        self.register_buffer("table", sinusoids(table_length, d_model), persistent=False)

    def forward(self, start: int, length: int) -> Tensor:
        """Positions start .. start+length-1: [length, D]."""
        if start + length <= self.table.shape[0]:
            return self.table[start : start + length]
        return sinusoids(length, self.d_model, start=start, dtype=self.table.dtype, device=self.table.device)


class LearnedPositions(nn.Module):
    """Learned positional embeddings, the alternative of §3.5 (Table 3 row (E); Gehring et al. 2017): row p
    of a trained table [max_positions, D] is added to the embedding at position p, in place of PE(p).

    One table serves the encoder and the decoder, as the one sinusoid function does (fairseq and
    tensor2tensor keep a table per stack); it is a parameter, in the state_dict as `positions.weight`.
    Initialised N(0, D^-0.5), as fairseq initialises its learned positions (and we our token embeddings).
    There is no row past the table: a position >= max_positions raises a one-line ConfigError saying what
    to change, checked on Python ints before any indexing. A training run's own decode settings are checked
    against the table when its config is built (config.TrainJob); other settings (e.g. translate.py's
    decode.* overrides) fail here: when a source of more than max_positions - 1 pieces is encoded, or when a
    decoding step would read position max_positions (a hypothesis reached max_positions tokens unended).
    """

    def __init__(self, max_positions: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, d_model))
        nn.init.normal_(self.weight, mean=0.0, std=d_model**-0.5)

    def forward(self, start: int, length: int) -> Tensor:
        """Positions start .. start+length-1: [length, D]."""
        rows = self.weight.shape[0]
        if start + length > rows:
            raise ConfigError(
                f"position {start + length - 1} is past the learned position table (model.max_positions={rows}): "
                f"this model reads at most {rows - 1} source pieces and writes at most {rows - 1} target tokens; "
                "crop inputs with decode.max_input_len and outputs with decode.max_len_a/max_len_b (training: "
                "lower data.max_len), or train with a larger model.max_positions")
        return self.weight[start : start + length]


# ----------------------------------------------------------------------------------------------------
# Incremental decoding: the decoder cache that search's single steps carry


class PastKV(NamedTuple):
    """Self-attention keys and values of the positions decoded so far, time-major: [L, B', H, Dk] and
    [L, B', H, Dv].

    rows [B] (or None: all B' = B rows in order) says which of them each of the B rows continues: beam
    search's reorder, applied while the next position is appended (one copy of the past, not two).
    """

    k: Tensor
    v: Tensor
    rows: Tensor | None = None


def append_positions(past: Tensor, rows: Tensor | None, new: Tensor) -> Tensor:
    """past [L, B', H, Dh] (rows [B] of it, or all), then new [T, B, H, Dh] -> a new [L + T, B, H, Dh]
    (Dh: Dk for keys, Dv for values).

    Without autograd the rows are gathered straight into the result, which time-major order keeps
    contiguous; with autograd (out= is not differentiable) they are gathered, then concatenated.
    """
    if rows is None:
        return torch.cat([past, new])
    if torch.is_grad_enabled():
        return torch.cat([past.index_select(1, rows), new])
    out = new.new_empty(past.shape[0] + new.shape[0], *new.shape[1:])
    torch.index_select(past, 1, rows, out=out[: past.shape[0]])
    out[past.shape[0] :] = new
    return out


@dataclasses.dataclass(frozen=True)
class DecoderCache:
    """What incremental decoding keeps between steps, one entry per decoder layer.

    It decodes `beams` rows per source sentence: row b * beams + k is beam k of source b. Cross-attention
    keys/values are projected once per source by `Transformer.init_cache` and shared by the source's rows.
    Each `decode` step returns a new cache whose self-attention keys/values (one per row, time-major) have
    its positions appended. `reorder_beams` copies nothing: it records which rows continue, and the next
    step gathers them while appending (`append_positions`), one copy of the past per step. Nothing is
    mutated in place, so any cache stays valid and autograd works through it.
    """

    self_k: list[Tensor]  # per layer [L, B*K', H, Dk], L = positions decoded so far (K' = K unless reordered)
    self_v: list[Tensor]  # per layer [L, B*K', H, Dv]
    cross_k: list[Tensor]  # per layer [B, H, S, Dk]
    cross_v: list[Tensor]  # per layer [B, H, S, Dv]
    src_mask: Tensor  # [B, S] bool, True = real token
    beams: int = 1  # K, rows per source
    rows: Tensor | None = None  # [B*K] long: the self_k/self_v row each row continues (None: the same row)

    @classmethod
    def empty(cls, decoder: Decoder, encoder_out: EncoderOut, beams: int = 1) -> DecoderCache:
        """`Transformer.init_cache`: no target positions yet, and each layer's cross-attention K/V."""
        if not _is_int(beams) or beams < 1:
            raise ValueError(f"beams={beams!r} is invalid: decode at least one row per source")
        cross = [layer.cross_attn.memory_kv(encoder_out.out) for layer in decoder.layers]
        k, v = cross[0]  # [B, H, S, Dk], [B, H, S, Dv], in the dtype the projections give (autocast may lower it)
        no_keys = k.new_empty(0, k.shape[0] * beams, k.shape[1], k.shape[3])  # [0, B*K, H, Dk]
        no_values = v.new_empty(0, v.shape[0] * beams, v.shape[1], v.shape[3])  # [0, B*K, H, Dv]
        return cls(
            self_k=[no_keys] * len(cross),
            self_v=[no_values] * len(cross),
            cross_k=[k for k, _ in cross],
            cross_v=[v for _, v in cross],
            src_mask=encoder_out.src_mask,
            beams=beams,
        )

    @property
    def length(self) -> int:
        """Target positions decoded so far; the next one is at this position."""
        return self.self_k[0].shape[0]

    def reorder_beams(self, beams: Tensor) -> DecoderCache:
        """A cache with K' rows per source in which beam k of source b continues beam beams[b, k] of the
        same source (beams: [B, K'] int64, values < self.beams; K' may differ, e.g. 1 -> K after a first
        step shared by all beams). Only the self-attention keys/values move: those of cross-attention
        belong to the source.
        """
        if beams.dim() != 2 or beams.shape[0] != self.src_mask.shape[0]:
            raise ValueError(f"reorder_beams wants beam indices of shape [{self.src_mask.shape[0]}, beams] "
                             f"(one row per source), got {list(beams.shape)}")
        first_row = torch.arange(0, beams.shape[0] * self.beams, self.beams, device=beams.device)  # [B]
        rows = (beams + first_row[:, None]).view(-1)  # [B*K'] rows of this cache
        if self.rows is not None:  # reordered twice without a step between: compose
            rows = self.rows[rows]
        return dataclasses.replace(self, rows=rows, beams=beams.shape[1])

    def select_sentences(self, keep: Tensor) -> DecoderCache:
        """The cache of sources `keep` ([B'] int64) only, in that order: search drops finished sentences.

        The self-attention rows are only recorded, as by `reorder_beams` (the next step gathers them). The
        cross-attention K/V and the source mask are copied, cut to the longest kept source (sources are
        right-padded, so the cut keys were padding, never attended): later steps attend over fewer keys.
        """
        beam_rows = keep[:, None] * self.beams + torch.arange(self.beams, device=keep.device)  # [B', K]
        rows = beam_rows.view(-1) if self.rows is None else self.rows[beam_rows.view(-1)]
        src_mask = self.src_mask.index_select(0, keep)
        width = int(src_mask.sum(dim=1).max())  # one host sync per selection
        return dataclasses.replace(
            self,
            cross_k=[k[:, :, :width].index_select(0, keep) for k in self.cross_k],  # [B', H, width, Dk]
            cross_v=[v[:, :, :width].index_select(0, keep) for v in self.cross_v],
            src_mask=src_mask[:, :width].contiguous(),
            rows=rows,
        )
