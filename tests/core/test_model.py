"""Properties of transformer/model.py, each checked against an independent computation."""

import dataclasses
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import (BOS, EOS, PAD, TOL, VOCAB, assert_cached_decoding_matches_full_forward, padded, tiny_config,
                     tiny_model)
from transformer import model as model_module
from transformer.search import beam_search, greedy_search
from transformer.model import (
    ENCODE_GROUP,
    DecoderCache,
    EncoderOut,
    SinusoidalPositions,
    Transformer,
    TransformerConfig,
    attention,
    sinusoids,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    src = padded([7, 4, 1, 6], last=EOS, seed=seed)  # row 2 is just EOS
    tgt_in = padded([6, 3, 5, 1], first=BOS, seed=seed + 1)  # row 3 is just BOS
    return src, tgt_in


# ----------------------------------------------------------------------------------------------------
# Parity with torch.nn's reference layers (copied weights, attention biases zeroed)


def copy_linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    dst.weight.copy_(weight)
    if bias is None:
        dst.bias.zero_()
    else:
        dst.bias.copy_(bias)


def copy_norm(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    dst.weight.copy_(src.weight)
    dst.bias.copy_(src.bias)


def final_norm_like(ours: nn.LayerNorm | None) -> nn.Module:
    if ours is None:
        return nn.Identity()
    norm = nn.LayerNorm(ours.normalized_shape)
    copy_norm(norm, ours)
    return norm


@pytest.mark.parametrize("norm_first", [False, True])
@torch.no_grad()
def test_encoder_stack_matches_torch_nn_encoder_layers(norm_first):
    model = tiny_model(norm_first=norm_first)
    c = model.config
    reference = []
    for ours in model.encoder.layers:
        ref = nn.TransformerEncoderLayer(c.d_model, c.heads, dim_feedforward=c.d_ff, dropout=0.0, activation="relu",
                                         batch_first=True, norm_first=norm_first).eval()
        ref.self_attn.in_proj_weight.copy_(ours.self_attn.in_proj.weight)  # rows W^Q, W^K, W^V in both
        ref.self_attn.in_proj_bias.zero_()
        copy_linear(ref.self_attn.out_proj, ours.self_attn.out_proj.weight)
        copy_linear(ref.linear1, ours.ffn.w1.weight, ours.ffn.w1.bias)
        copy_linear(ref.linear2, ours.ffn.w2.weight, ours.ffn.w2.bias)
        copy_norm(ref.norm1, ours.self_attn_norm)
        copy_norm(ref.norm2, ours.ffn_norm)
        reference.append(ref)
    ref_final = final_norm_like(model.encoder.final_norm)

    src, _ = batch()
    real = src != PAD
    x = torch.randn(*src.shape, c.d_model)
    ours_out = model.encoder(x, real)
    theirs = x
    for ref in reference:
        theirs = ref(theirs, src_key_padding_mask=~real)  # torch.nn: True = blocked
    theirs = ref_final(theirs)
    assert (ours_out[real] - theirs[real]).abs().max() <= TOL


@pytest.mark.parametrize("norm_first", [False, True])
@torch.no_grad()
def test_decoder_stack_matches_torch_nn_decoder_layers(norm_first):
    model = tiny_model(norm_first=norm_first)
    c = model.config
    reference = []
    for ours in model.decoder.layers:
        ref = nn.TransformerDecoderLayer(c.d_model, c.heads, dim_feedforward=c.d_ff, dropout=0.0, activation="relu",
                                         batch_first=True, norm_first=norm_first).eval()
        ref.self_attn.in_proj_weight.copy_(ours.self_attn.in_proj.weight)
        ref.self_attn.in_proj_bias.zero_()
        copy_linear(ref.self_attn.out_proj, ours.self_attn.out_proj.weight)
        cross_in_proj = torch.cat([ours.cross_attn.q_proj.weight, ours.cross_attn.kv_proj.weight])  # W^Q; W^K; W^V
        ref.multihead_attn.in_proj_weight.copy_(cross_in_proj)
        ref.multihead_attn.in_proj_bias.zero_()
        copy_linear(ref.multihead_attn.out_proj, ours.cross_attn.out_proj.weight)
        copy_linear(ref.linear1, ours.ffn.w1.weight, ours.ffn.w1.bias)
        copy_linear(ref.linear2, ours.ffn.w2.weight, ours.ffn.w2.bias)
        copy_norm(ref.norm1, ours.self_attn_norm)
        copy_norm(ref.norm2, ours.cross_attn_norm)
        copy_norm(ref.norm3, ours.ffn_norm)
        reference.append(ref)
    ref_final = final_norm_like(model.decoder.final_norm)

    src, tgt_in = batch()
    src_real, tgt_real = src != PAD, tgt_in != PAD
    memory = torch.randn(*src.shape, c.d_model)
    y = torch.randn(*tgt_in.shape, c.d_model)
    ours_out, _ = model.decoder(y, memory=memory, src_mask=src_real)
    t = tgt_in.shape[1]
    blocked_future = torch.ones(t, t, dtype=torch.bool).triu(diagonal=1)  # torch.nn: True = blocked
    theirs = y
    for ref in reference:
        theirs = ref(theirs, memory, tgt_mask=blocked_future, tgt_key_padding_mask=~tgt_real,
                     memory_key_padding_mask=~src_real)
    theirs = ref_final(theirs)
    assert (ours_out[tgt_real] - theirs[tgt_real]).abs().max() <= TOL


# ----------------------------------------------------------------------------------------------------
# §3.4-3.5 Embeddings and positions


def paper_sinusoid(pos: int, k: int, d_model: int) -> float:
    i = k // 2
    angle = pos / 10000 ** (2 * i / d_model)
    return math.sin(angle) if k % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize("d_model", [16, 17])
def test_sinusoids_equal_the_paper_formula_for_even_and_odd_width(d_model):
    length, start = 60, 5
    table = sinusoids(length, d_model, start=start, dtype=torch.float64)
    expected = torch.tensor(
        [[paper_sinusoid(pos, k, d_model) for k in range(d_model)] for pos in range(start, start + length)],
        dtype=torch.float64,
    )
    assert table.shape == (length, d_model)
    assert (table - expected).abs().max() <= 1e-12
    if d_model % 2:  # the unpaired last coordinate is a sine
        last_angle = (start + 3) / 10000 ** ((d_model - 1) / d_model)
        assert table[3, -1].item() == pytest.approx(math.sin(last_angle), abs=1e-12)


def test_positions_past_the_table_are_computed_and_the_table_is_not_saved():
    positions = SinusoidalPositions(16, table_length=8)
    for start, length in [(0, 8), (5, 20), (30, 1)]:  # inside, across and past the table's end
        rows = positions(start=start, length=length)
        assert (rows.double() - sinusoids(length, 16, start=start, dtype=torch.float64)).abs().max() <= 1e-6
    model = tiny_model()
    assert "positions.table" in dict(model.named_buffers())
    assert not any("positions" in key for key in model.state_dict())


def test_embedding_is_shared_scaled_by_sqrt_d_model_and_adds_positions():
    model = tiny_model()
    tokens = padded([5, 3], first=BOS)
    expected = model.embedding.weight[tokens] * math.sqrt(32) + sinusoids(5, 32)
    assert (model.embed(tokens) - expected).abs().max() <= TOL


def test_embedding_init_has_zero_pad_row_and_std_d_model_to_the_minus_half():
    torch.manual_seed(0)
    model = Transformer(tiny_config(vocab_size=2000))
    weight = model.embedding.weight
    assert torch.count_nonzero(weight[PAD]) == 0
    assert weight[4:].std().item() == pytest.approx(32**-0.5, rel=0.05)


@torch.no_grad()
def test_output_projection_is_the_shared_embedding_matrix():
    model = tiny_model()
    hidden = {}

    def keep_decoder_output(module, args, out):
        hidden["x"] = out[0]

    model.decoder.register_forward_hook(keep_decoder_output)
    src, tgt_in = batch()
    logits = model(src, tgt_in)
    assert (logits - hidden["x"] @ model.embedding.weight.T).abs().max() <= TOL  # x E^T, no bias
    vocab_by_width = [p for p in model.parameters() if p.shape == (VOCAB, 32)]
    assert len(vocab_by_width) == 1 and vocab_by_width[0] is model.embedding.weight


def test_log_probs_are_the_log_softmax_of_the_logits_in_float32_with_or_without_autograd():
    model = tiny_model()
    src, tgt_in = batch()
    logits = model(src, tgt_in)
    expected = torch.log_softmax(logits.detach().double(), dim=-1)
    log_probs = model.log_probs(logits)
    assert (log_probs.double() - expected).abs().max() <= TOL
    log_probs[..., 5].sum().backward()  # with autograd: differentiable, and the logits are left alone
    assert model.embedding.weight.grad is not None and torch.equal(logits.detach(), model(src, tgt_in).detach())
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            log_probs = model.log_probs(model(src, tgt_in).to(dtype))
            assert log_probs.dtype == torch.float32
            assert (log_probs.double() - expected).abs().max() <= (TOL if dtype == torch.float32 else 0.1)


# ----------------------------------------------------------------------------------------------------
# §3.2 Attention


def explicit_attention(q, k, v, may_attend):
    """softmax(Q K^T / sqrt(d_k)) V written out in float64, with -inf where may_attend is False."""
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~may_attend, float("-inf"))
    return (scores.softmax(dim=-1) @ v.double()).float()


@pytest.mark.parametrize(("tq", "with_key_mask"), [(5, False), (5, True), (2, False), (2, True), (1, True)])
def test_attention_masks_match_explicit_softmax(tq, with_key_mask):
    torch.manual_seed(0)
    b, h, tk, dh = 3, 2, 5, 4
    q, k, v = torch.randn(b, h, tq, dh), torch.randn(b, h, tk, dh), torch.randn(b, h, tk, dh)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True, False, True, True, False]])
    # causal with Tq < Tk: the queries are positions tk-tq .. tk-1, query i sees keys <= tk-tq+i
    query_pos = torch.arange(tk - tq, tk)
    may_attend = (torch.arange(tk)[None, :] <= query_pos[:, None]).expand(b, 1, tq, tk)
    if with_key_mask:
        may_attend = may_attend & key_mask[:, None, None, :]
    expected = explicit_attention(q, k, v, may_attend)
    out = attention(q, k, v, key_mask=key_mask if with_key_mask else None, causal=True)
    assert (out - expected).abs().max() <= TOL
    if with_key_mask:
        out = attention(q, k, v, key_mask=key_mask)
        assert (out - explicit_attention(q, k, v, key_mask[:, None, None, :].expand(b, 1, tq, tk))).abs().max() <= TOL


# ----------------------------------------------------------------------------------------------------
# Incremental decoding


@torch.no_grad()
def test_cached_decoding_matches_full_forward_at_every_step():
    assert_cached_decoding_matches_full_forward(tiny_model(), *batch())


@torch.no_grad()
def test_cached_decoding_of_several_positions_at_once_matches_full_forward():
    model = tiny_model()
    src, tgt_in = batch()
    full = model(src, tgt_in)
    encoder_out = model.encode(src)
    cache = model.init_cache(encoder_out)
    first, cache = model.decode(tgt_in[:, :2], encoder_out, cache)
    rest, cache = model.decode(tgt_in[:, 2:], encoder_out, cache)
    assert cache.length == tgt_in.shape[1]
    assert (torch.cat([first, rest], dim=1) - full).abs().max() <= TOL


@pytest.mark.parametrize("grad", [False, True])  # two code paths: gather into the result / gather, then cat
@pytest.mark.parametrize("shared_first_step", [False, True])
def test_beams_decoding_matches_full_forward_after_reorder(shared_first_step, grad):
    """Three beams per source, each fed its own tokens, reordered mid-sentence as beam search does: every
    row's logits equal a full forward pass of its source and its own prefix. shared_first_step: decode BOS
    once per source, then grow to three rows per source, as beam search starts."""
    torch.set_grad_enabled(grad)
    try:
        check_beams_decoding(shared_first_step)
    finally:
        torch.set_grad_enabled(True)


def check_beams_decoding(shared_first_step: bool) -> None:
    model = tiny_model()
    src, _ = batch()
    b, k, steps = src.shape[0], 3, 6
    encoder_out = model.encode(src)
    feed = padded([steps] * (b * k), first=BOS, seed=5)  # [B*K, steps]: row r's token at each step
    cache = model.init_cache(encoder_out, beams=k)
    prefix = feed[:, :0]
    if shared_first_step:
        logits, cache = model.decode(feed[::k, :1], encoder_out, model.init_cache(encoder_out))
        assert (logits[:, 0] - model(src, feed[::k, :1])[:, 0]).abs().max() <= TOL
        cache = cache.reorder_beams(torch.zeros(b, k, dtype=torch.long))
        prefix = feed[:, :1]
    assert cache.beams == k and cache.cross_k[0].shape[0] == b  # one cross-attention K/V per source
    for t in range(prefix.shape[1], steps):
        if t in (2, 4):  # beam j of source i continues beam choice[i, j] of source i
            choice = torch.randint(0, k, (b, k), generator=torch.Generator().manual_seed(t))
            cache = cache.reorder_beams(choice)
            prefix = prefix[(torch.arange(b)[:, None] * k + choice).view(-1)]
        prefix = torch.cat([prefix, feed[:, t : t + 1]], dim=1)
        # encoder_out is not repeated per beam: with a cache, decode reads the source side from the cache
        logits, cache = model.decode(feed[:, t : t + 1], encoder_out, cache)
        full = model(src.repeat_interleave(k, dim=0), prefix)
        assert (logits[:, 0] - full[:, t]).abs().max() <= TOL, f"step {t}"
    assert torch.equal(cache.src_mask, src != PAD)


def test_cache_rejects_beam_indices_of_another_shape_and_zero_beams():
    model = tiny_model()
    src, _ = batch()
    encoder_out = model.encode(src)
    cache = model.init_cache(encoder_out, beams=2)
    with pytest.raises(ValueError, match=r"reorder_beams wants beam indices of shape \[4, beams\]"):
        cache.reorder_beams(torch.zeros(8, dtype=torch.long)[:, None])
    with pytest.raises(ValueError, match="beams=0 is invalid"):
        model.init_cache(encoder_out, beams=0)


@torch.no_grad()
def test_decoding_from_a_cache_leaves_it_unchanged():
    model = tiny_model()
    src, tgt_in = batch()
    encoder_out = model.encode(src)
    tgt_in = torch.cat([tgt_in, tgt_in.flip(0)]).view(2, 4, -1).transpose(0, 1).reshape(8, -1)  # 2 beams each
    _, cache = model.decode(tgt_in[:, :3], encoder_out, model.init_cache(encoder_out, beams=2))
    kept = [k.clone() for k in cache.self_k]
    first, _ = model.decode(tgt_in[:, 3:4], encoder_out, cache)
    model.decode(tgt_in[:, 3:4].flip(0), encoder_out, cache)  # another continuation of the same prefix
    model.decode(tgt_in[:, 3:4], encoder_out, cache.reorder_beams(torch.tensor([[1, 0]] * 4)))
    again, _ = model.decode(tgt_in[:, 3:4], encoder_out, cache)
    assert cache.length == 3 and all(torch.equal(k, kept_k) for k, kept_k in zip(cache.self_k, kept))
    assert torch.equal(first, again)


@torch.no_grad()
def test_cross_attention_keys_values_are_projected_once_per_source():
    model = tiny_model()
    calls = []
    for layer in model.decoder.layers:
        layer.cross_attn.kv_proj.register_forward_hook(lambda module, args, out: calls.append(1))
    src, tgt_in = batch()
    encoder_out = model.encode(src)
    cache = model.init_cache(encoder_out)
    assert len(calls) == model.config.decoder_layers
    for t in range(tgt_in.shape[1]):
        _, cache = model.decode(tgt_in[:, t : t + 1], encoder_out, cache)
    assert len(calls) == model.config.decoder_layers
    assert isinstance(cache, DecoderCache)


@torch.no_grad()
def test_float64_cached_decoding_matches_full_forward_to_rounding():
    model = tiny_model().double()
    src, tgt_in = batch()
    full = model(src, tgt_in)
    assert full.dtype == torch.float64
    encoder_out = model.encode(src)
    cache = model.init_cache(encoder_out)
    steps = []
    for t in range(tgt_in.shape[1]):
        logits, cache = model.decode(tgt_in[:, t : t + 1], encoder_out, cache)
        steps.append(logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-12


@torch.no_grad()
def test_bfloat16_autocast_runs_full_and_cached_decoding():
    model = tiny_model()
    src, tgt_in = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(src, tgt_in)
        encoder_out = model.encode(src)
        cache = model.init_cache(encoder_out)
        for t in range(tgt_in.shape[1]):
            logits, cache = model.decode(tgt_in[:, t : t + 1], encoder_out, cache)
            cache = cache.reorder_beams(torch.zeros(src.shape[0], 1, dtype=torch.long))
    assert torch.isfinite(full).all() and torch.isfinite(logits).all()
    assert (logits[:, 0].float() - full[:, -1].float()).abs().max() <= 0.1


# ----------------------------------------------------------------------------------------------------
# Masking: causality, padding


@torch.no_grad()
def test_changing_target_token_t_changes_no_logits_before_t():
    model = tiny_model()
    src, _ = batch()
    tgt_in = padded([6, 6, 6, 6], first=BOS, seed=5)
    logits = model(src, tgt_in)
    for t in range(1, tgt_in.shape[1]):
        changed = tgt_in.clone()
        changed[:, t] = 4 + (changed[:, t] - 3) % (VOCAB - 4)  # another ordinary token
        new = model(src, changed)
        assert (new[:, :t] - logits[:, :t]).abs().max() <= TOL, f"position {t} leaked backwards"
        assert (new[:, t] - logits[:, t]).abs().max() > 1e-3  # ... while it does reach position t


@torch.no_grad()
def test_extra_padding_does_not_change_outputs_at_real_positions():
    model = tiny_model()
    src, tgt_in = batch()
    logits = model(src, tgt_in)
    encoded = model.encode(src).out
    src_real, tgt_real = src != PAD, tgt_in != PAD

    more_src = F.pad(src, (0, 5), value=PAD)
    more_tgt = F.pad(tgt_in, (0, 4), value=PAD)
    assert (model.encode(more_src).out[:, : src.shape[1]][src_real] - encoded[src_real]).abs().max() <= TOL
    assert (model(more_src, tgt_in)[tgt_real] - logits[tgt_real]).abs().max() <= TOL
    assert (model(src, more_tgt)[:, : tgt_in.shape[1]][tgt_real] - logits[tgt_real]).abs().max() <= TOL


@torch.no_grad()
def test_what_lies_under_padding_does_not_change_outputs_at_real_positions():
    model = tiny_model()
    c = model.config
    src, tgt_in = batch()
    src_real, tgt_real = src != PAD, tgt_in != PAD

    # encoder: any vector at a padded source position
    x = torch.randn(*src.shape, c.d_model)
    noisy_x = torch.where(src_real[..., None], x, 100 * torch.randn_like(x))
    assert (model.encoder(noisy_x, src_real)[src_real] - model.encoder(x, src_real)[src_real]).abs().max() <= TOL

    # decoder: any encoder output at a padded source position
    memory = torch.randn(*src.shape, c.d_model)
    noisy_memory = torch.where(src_real[..., None], memory, 100 * torch.randn_like(memory))
    y = model.embed(tgt_in)
    clean, _ = model.decoder(y, memory=memory, src_mask=src_real)
    noisy, _ = model.decoder(y, memory=noisy_memory, src_mask=src_real)
    assert (clean[tgt_real] - noisy[tgt_real]).abs().max() <= TOL

    # targets: any token after a row's end
    garbage = torch.where(tgt_real, tgt_in, torch.randint(4, VOCAB, tgt_in.shape))
    assert (model(src, garbage)[tgt_real] - model(src, tgt_in)[tgt_real]).abs().max() <= TOL


def kernel_masks(monkeypatch) -> list[tuple[bool, bool]]:
    """(given a mask, is_causal) of every call of the attention kernel from here on."""
    calls, kernel = [], model_module.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, dropout_p=0.0):
        calls.append((attn_mask is not None, is_causal))
        return kernel(q, k, v, attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p)

    monkeypatch.setattr(model_module, "scaled_dot_product_attention", spy)
    return calls


def test_a_source_batch_without_padding_attends_with_no_mask_and_a_padded_one_with_masks(monkeypatch):
    """Encoder self-attention, decoder self-attention (the kernel's own triangle) and cross-attention, in
    that order per layer: no mask tensor at all for sources of one length, so that the kernel may choose
    any implementation (flash attention takes none); the source mask only where a source is padded."""
    model = tiny_model()
    calls = kernel_masks(monkeypatch)
    unpadded = padded([5, 5, 5], last=EOS)
    _, tgt_in = batch()
    tgt_in = tgt_in[:3]
    no_mask = [(False, False)] * 2 + [(False, True), (False, False)] * 2
    with_mask = [(True, False)] * 2 + [(False, True), (True, False)] * 2
    model(unpadded, tgt_in)
    assert calls == no_mask
    calls.clear()
    model(padded([5, 3, 5], last=EOS), tgt_in)
    assert calls == with_mask
    calls.clear()
    model(unpadded, tgt_in, src_padded=False)  # told (train.py, from the batch): no look at the tokens
    assert calls == no_mask
    calls.clear()
    masked = model(unpadded, tgt_in, src_padded=True)  # "may hold padding": an all-True mask, the same output
    assert calls == with_mask
    assert (masked - model(unpadded, tgt_in)).abs().max() <= TOL


def test_a_batch_without_padding_gives_the_outputs_its_sentences_get_in_a_padded_batch():
    model = tiny_model()
    src, tgt_in = padded([6, 6, 6], last=EOS, seed=3), padded([4, 5, 3], first=BOS, seed=4)
    longer = padded([9], last=EOS, seed=5)
    both_src = torch.cat([F.pad(src, (0, 3), value=PAD), longer])  # [4, 9]: the same sentences, padded
    both_tgt = torch.cat([tgt_in, F.pad(padded([2], first=BOS, seed=6), (0, 3), value=PAD)])
    assert not model.encode(src).padded and model.encode(both_src).padded
    alone, together = model(src, tgt_in), model(both_src, both_tgt)[:3]
    real = tgt_in != PAD
    assert (alone[real] - together[real]).abs().max() <= TOL
    assert (model.encode(src).out - model.encode(both_src).out[:3, :6]).abs().max() <= TOL


@pytest.mark.parametrize("search", ["beam", "greedy"])
def test_search_finds_the_same_translations_with_or_without_the_source_mask(search, monkeypatch):
    model = tiny_model()
    src = padded([6, 6, 6, 6], last=EOS, seed=8)
    run = (lambda: beam_search(model, src, beam=3, max_len_b=8)) if search == "beam" else \
        (lambda: greedy_search(model, src, max_len_b=8))
    with torch.inference_mode():
        unmasked = run()
        monkeypatch.setattr(model, "encode", functools.partial(Transformer.encode, model, padded=True))
        masked = run()
    assert [[h.tokens for h in hyps] for hyps in unmasked] == [[h.tokens for h in hyps] for hyps in masked]
    for hyps, others in zip(unmasked, masked):
        for h, other in zip(hyps, others):
            assert h.score == pytest.approx(other.score, abs=1e-5)


def test_search_encodes_a_big_batch_in_groups_of_similar_length_with_the_same_outputs(monkeypatch):
    """In inference mode a batch of more than ENCODE_GROUP sources is encoded a group of similar lengths at a
    time, each group as wide as its longest source: the outputs at real positions are the one-batch ones;
    left-padded sources, which a cut would truncate, are encoded as one batch."""
    model = tiny_model()
    lengths = [1 + (7 * i) % 23 for i in range(3 * ENCODE_GROUP + 5)]  # 1..23 tokens, mixed order
    src = padded(lengths, last=EOS)
    real = src != PAD
    with torch.no_grad():  # autograd's mode: one batch
        whole = model.encode(src).out
    shapes, encoder = [], model.encoder.forward  # [rows, width] of each call of the encoder stack

    def recorded(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(x.shape[:2]))
        return encoder(x, mask)

    monkeypatch.setattr(model.encoder, "forward", recorded)
    with torch.inference_mode():
        grouped = model.encode(src).out
    assert (grouped[real] - whole[real]).abs().max() <= TOL
    assert [rows for rows, _ in shapes] == [ENCODE_GROUP] * 3 + [5]
    assert [width for _, width in shapes] == sorted((width for _, width in shapes), reverse=True)
    assert sum(rows * width for rows, width in shapes) < 0.7 * src.numel()  # padding not encoded

    left = torch.stack([row.roll(int((row == PAD).sum())) for row in src])  # the same rows, padding first
    with torch.no_grad():
        expected = model.encode(left).out
    shapes.clear()
    with torch.inference_mode():
        out = model.encode(left).out
    assert shapes == [tuple(left.shape)] and (out[left != PAD] - expected[left != PAD]).abs().max() <= TOL


def test_all_padding_source_row_raises_instead_of_nan():
    model = tiny_model()
    src, tgt_in = batch()
    src[1] = PAD
    with pytest.raises(ValueError, match=r"^source row 1 is all padding: "):
        model(src, tgt_in)
    with pytest.raises(ValueError, match="source row 0 is all padding"):
        model.encode(torch.zeros(2, 0, dtype=torch.long))


# ----------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(d_model=500, heads=8),
            "model.d_model=500 is not divisible by model.heads=8: choose d_model a multiple of heads",
        ),
        (dict(heads=0), "model.heads=0 is invalid: set it to a positive integer"),
        (dict(d_ff=-1), "model.d_ff=-1 is invalid"),
        (dict(encoder_layers=0), "model.encoder_layers=0 is invalid"),
        (dict(decoder_layers=2.0), "model.decoder_layers=2.0 is invalid"),
        (dict(vocab_size=0), "vocab_size=0 is invalid: set data.vocab_size to a positive integer"),
        (dict(dropout=1.0), "model.dropout=1.0 is invalid: choose a probability in [0, 1)"),
        (dict(dropout=-0.1), "model.dropout=-0.1 is invalid"),
        (dict(norm_first="yes"), "model.norm_first='yes' is invalid: set it to true or false"),
        (dict(eos_id=VOCAB), f"eos_id={VOCAB} is not a token id of a vocabulary of vocab_size={VOCAB}"),
        (dict(vocab_size=3), "eos_id=3 is not a token id of a vocabulary of vocab_size=3"),
        (dict(eos_id=1), "special token ids must be distinct (only bos_id may equal pad_id), got pad_id=0, "
                         "unk_id=1, bos_id=2, eos_id=1"),
        (dict(activation="tanh"), "model.activation=tanh is not one of relu, gelu, swish"),
        (dict(attention_bias=1), "model.attention_bias=1 is invalid: set it to true or false"),
        (dict(target_vocab_size=VOCAB + 1), f"target_vocab_size={VOCAB + 1} differs from vocab_size={VOCAB}, but "
                                            "one embedding serves both sides"),
        (dict(shared_embeddings=False, target_vocab_size=3),
         "eos_id=3 is not a token id of a vocabulary of target_vocab_size=3"),
    ],
)
def test_invalid_config_raises_one_line_actionable_message(overrides, message):
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)


def test_config_is_frozen_keyword_only_and_round_trips_through_asdict():
    config = tiny_config(norm_first=True)
    assert TransformerConfig(**dataclasses.asdict(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 64
    with pytest.raises(TypeError):
        TransformerConfig(VOCAB)


def test_presets_follow_table_3():
    base, big = TransformerConfig.base(), TransformerConfig.big(vocab_size=1000, dropout=0.1)
    assert (base.vocab_size, base.d_model, base.heads, base.d_ff, base.encoder_layers, base.decoder_layers,
            base.dropout, base.norm_first) == (37000, 512, 8, 2048, 6, 6, 0.1, False)
    assert (big.vocab_size, big.d_model, big.heads, big.d_ff, big.encoder_layers, big.decoder_layers,
            big.dropout) == (1000, 1024, 16, 4096, 6, 6, 0.1)
    assert TransformerConfig.big().dropout == 0.3


# ----------------------------------------------------------------------------------------------------
# Structure


def test_post_norm_has_no_final_norm_and_pre_norm_has_one_per_stack():
    post, pre = tiny_model(norm_first=False), tiny_model(norm_first=True)
    assert post.encoder.final_norm is None and post.decoder.final_norm is None
    assert isinstance(pre.encoder.final_norm, nn.LayerNorm) and isinstance(pre.decoder.final_norm, nn.LayerNorm)
    assert count_parameters(pre) - count_parameters(post) == 2 * 2 * 32


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def expected_parameters(c: TransformerConfig) -> int:
    """Counted from §3: shared embedding, bias-free attention (4 D x D), FFN with biases, 2 per LayerNorm."""
    d = c.d_model
    attention, ffn, norm = 4 * d * d, 2 * d * c.d_ff + c.d_ff + d, 2 * d
    encoder_layer = attention + ffn + 2 * norm
    decoder_layer = 2 * attention + ffn + 3 * norm
    final_norms = 2 * norm if c.norm_first else 0
    return c.vocab_size * d + c.encoder_layers * encoder_layer + c.decoder_layers * decoder_layer + final_norms


@pytest.mark.parametrize(("preset", "paper_millions"), [(TransformerConfig.base, 65), (TransformerConfig.big, 213)])
def test_parameter_counts_of_base_and_big(preset, paper_millions):
    config = preset(vocab_size=37000)
    with torch.device("meta"):  # no memory, no init time
        model = Transformer(config)
    count = count_parameters(model)
    print(f"{preset.__name__}: {count:,} parameters")
    assert count == expected_parameters(config)
    assert abs(count - paper_millions * 1e6) <= 0.05 * paper_millions * 1e6  # tests/evaluation/test_table3.py: the exact model
    assert count_parameters(tiny_model()) == expected_parameters(tiny_config())


# ----------------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_is_active_in_train_mode_and_off_in_eval_mode(norm_first):
    model = tiny_model(dropout=0.3, norm_first=norm_first)
    src, tgt_in = batch()
    src_real = src != PAD
    x = torch.randn(*src.shape, 32)
    model.train()
    assert not torch.allclose(model(src, tgt_in), model(src, tgt_in))
    dropped = model.embed(src) == 0  # §5.4: dropout on embeddings + positions ...
    assert 0.1 < dropped.float().mean() < 0.5
    assert not torch.allclose(model.encoder(x, src_real), model.encoder(x, src_real))  # ... and on sublayer outputs
    decoded, _ = model.decoder(x, memory=x, src_mask=src_real)
    assert not torch.allclose(decoded, model.decoder(x, memory=x, src_mask=src_real)[0])
    model.eval()
    with torch.no_grad():
        evaluated = model(src, tgt_in)
        assert torch.equal(evaluated, model(src, tgt_in))
        no_dropout = Transformer(tiny_config(dropout=0.0, norm_first=norm_first)).eval()
        no_dropout.load_state_dict(model.state_dict())
        assert (no_dropout(src, tgt_in) - evaluated).abs().max() <= TOL


def test_encoder_out_is_a_named_tuple_with_real_token_mask():
    model = tiny_model()
    src, _ = batch()
    encoder_out = model.encode(src)
    assert isinstance(encoder_out, EncoderOut)
    assert encoder_out.out.shape == (*src.shape, 32)
    assert encoder_out.src_mask.dtype == torch.bool and torch.equal(encoder_out.src_mask, src != PAD)
