"""train.compile=true with variable-length batches: dynamo must not compile a graph per batch shape.

Token batching gives every pass its own (B, S, T); a graph specialised to each would recompile every pass
(and after `torch._dynamo.config.recompile_limit` fall back to eager). `transformer.training.run.compile_for_batches` marks the
sizes dynamic. The graphs are counted with a backend that records each graph dynamo hands it and runs it
eagerly, so the test measures dynamo's decisions without paying for inductor's code generation.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformer.training.run import compile_for_batches  # noqa: E402
from transformer.loss import label_smoothed_nll  # noqa: E402
from transformer.model import Transformer  # noqa: E402
import helpers  # noqa: E402

SHAPES = 40


class GraphCounter:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return graph_module.forward


def random_shapes(count: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """(B, S, T) as token batching makes them: B >= 2 sentences of 2..40 pieces, per-batch lengths."""
    rng = random.Random(seed)
    return [(rng.randint(2, 24), rng.randint(2, 40), rng.randint(2, 40)) for _ in range(count)]


def train_passes(module: torch.nn.Module, model: Transformer, shapes) -> None:
    """Forward and backward of a random batch of each shape, as train.py's inner loop does."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for batch, src_len, tgt_len in shapes:
        src = torch.randint(4, vocab, (batch, src_len), generator=generator)
        src[:, -1] = model.config.eos_id
        tgt_in = torch.randint(4, vocab, (batch, tgt_len), generator=generator)
        tgt_out = torch.randint(4, vocab, (batch, tgt_len), generator=generator)
        loss, _ = label_smoothed_nll(module(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=model.config.pad_id)
        loss.backward()


@pytest.fixture
def tiny_model(one_torch_thread):
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield helpers.tiny_model(random_norms=False, vocab_size=64, heads=2, encoder_layers=1, decoder_layers=1,
                             dropout=0.1).train()
    torch._dynamo.reset()


def test_compiled_training_needs_one_graph_for_forty_batch_shapes(tiny_model):
    counter = GraphCounter()
    compiled = compile_for_batches(tiny_model, backend=counter)
    train_passes(compiled, tiny_model, random_shapes(2))
    graphs_for_two = counter.graphs
    train_passes(compiled, tiny_model, random_shapes(SHAPES, seed=1))
    assert graphs_for_two == 1, f"the forward was cut into {graphs_for_two} graphs (graph breaks)"
    assert counter.graphs == graphs_for_two, f"{counter.graphs - graphs_for_two} recompilations over {SHAPES} shapes"


def test_compiled_forward_equals_eager(tiny_model):
    tiny_model.eval()
    src = torch.randint(4, 64, (3, 7))
    src[:, -1] = tiny_model.config.eos_id
    tgt = torch.randint(4, 64, (3, 5))
    compiled = compile_for_batches(tiny_model, backend=GraphCounter())
    with torch.no_grad():
        torch.testing.assert_close(compiled(src, tgt), tiny_model(src, tgt))
