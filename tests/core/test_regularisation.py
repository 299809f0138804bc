"""The regularisers beyond the paper's, each behind its own key (0 = the paper): dropout on the attention weights
(model.attention_dropout), on the feed-forward's hidden activation (model.activation_dropout), and decoupled
weight decay (train.weight_decay). Each checked against an independent computation with the same random mask."""

import pytest
import torch
import torch.nn.functional as F

from helpers import EOS, PAD, tiny_model
from transformer.config import ConfigError, ModelConfig, TrainConfig
from transformer.kernels import scaled_dot_product_attention
from transformer.model import FeedForward
from transformer.training.schedule import make_optimizer, set_weight_decay

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_attention_dropout_drops_weights_after_the_softmax_and_rescales_the_rest():
    """softmax(QK^T/√d_k) with the mask F.dropout draws for the weights' shape (the same seed), then times V."""
    q, k, v = (torch.randn(2, 3, n, 8, generator=torch.Generator().manual_seed(n)) for n in (5, 7, 7))
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = False
    torch.manual_seed(11)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.25)
    torch.manual_seed(11)
    kept = F.dropout(torch.ones(2, 3, 5, 7), p=0.25)  # 0 or 1/(1-p), as dropout applies it
    weights = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, (weights * kept) @ v)
    assert (kept == 0).any() and not torch.allclose(out, weights @ v)


def test_activation_dropout_drops_the_feed_forwards_hidden_units():
    """FFN(x) = W_2 · dropout(max(0, x W_1 + b_1)) + b_2 while training; the paper's FFN when evaluating."""
    torch.manual_seed(0)
    ffn, x = FeedForward(d_model=8, d_ff=16, dropout=0.3), torch.randn(4, 5, 8)
    torch.manual_seed(3)
    out = ffn(x)
    torch.manual_seed(3)
    kept = F.dropout(torch.ones(4, 5, 16), p=0.3)
    hidden = torch.relu(x @ ffn.w1.weight.T + ffn.w1.bias)
    torch.testing.assert_close(out, (hidden * kept) @ ffn.w2.weight.T + ffn.w2.bias)
    ffn.eval()
    torch.testing.assert_close(ffn(x), hidden @ ffn.w2.weight.T + ffn.w2.bias)


@pytest.mark.parametrize("key", ["attention_dropout", "activation_dropout"])
def test_the_extra_dropouts_act_only_while_training_and_only_where_set(key):
    """Evaluating, a model with the dropout gives the paper model's outputs (the same weights); training (with
    model.dropout 0), two passes differ only when the key is set."""
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    tgt = torch.tensor([[1, 5, 6], [1, 8, 9]])
    plain, dropping = tiny_model(seed=4), tiny_model(seed=4, **{key: 0.4})
    torch.testing.assert_close(dropping(src, tgt), plain(src, tgt))
    plain.train(), dropping.train()
    torch.testing.assert_close(plain(src, tgt), plain(src, tgt))
    assert not torch.allclose(dropping(src, tgt), dropping(src, tgt))


def test_weight_decay_is_decoupled_and_a_resumed_optimizer_takes_the_command_lines():
    """With a zero gradient, one update moves a weight by -lr · weight_decay · weight (AdamW's rule, not an
    L2 term in the gradient, which Adam would normalise away); loading a state saved without it keeps the run's."""
    weight = torch.nn.Parameter(torch.full((3,), 2.0))
    optimizer = make_optimizer([weight], fused=False, weight_decay=0.01)
    for group in optimizer.param_groups:
        group["lr"] = 0.5
    weight.grad = torch.zeros(3)
    optimizer.step()
    torch.testing.assert_close(weight.detach(), torch.full((3,), 2.0 - 0.5 * 0.01 * 2.0))

    saved = make_optimizer([torch.nn.Parameter(torch.zeros(3))], fused=False).state_dict()  # weight_decay 0
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["weight_decay"] == 0.0  # what load_state_dict does by itself
    set_weight_decay(optimizer, 0.01)
    assert optimizer.param_groups[0]["weight_decay"] == 0.01 and optimizer.param_groups[0]["decoupled_weight_decay"]


@pytest.mark.parametrize("make, key, value", [(ModelConfig, "attention_dropout", 1.0),
                                              (ModelConfig, "activation_dropout", -0.1),
                                              (TrainConfig, "weight_decay", -0.001)])
def test_out_of_range_regularisers_are_one_line_errors(make, key, value):
    with pytest.raises(ConfigError, match=key):
        make(**{key: value})
