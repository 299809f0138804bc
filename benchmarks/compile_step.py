"""train.compile=true against eager on CPU: step time over variable-length batches, and what compiling costs.

    python benchmarks/compile_step.py                       # prints a Markdown section (a few minutes on CPU)
    python benchmarks/compile_step.py --write docs/BENCHMARKS.md

A training step as train.py makes it (forward, label-smoothed loss, backward, fused Adam) on a small model
(d_model 256, 3+3 layers, 8k vocabulary: 10M parameters), once eager and once through
`transformer.training.run.compile_for_batches` (torch.compile, inductor, dynamic shapes). The batches have the shapes token
batching gives: 24 random (B, S, T) with B × max(S, T) ≈ 5000 tokens; every shape is stepped once to warm up
(and compile), then the 24 are timed in turns with the other engine, several rounds, medians per step.
Recompilations are counted (dynamo's frame counter): the point of `compile_for_batches` is that there are
none after the first batches.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import load_average, load_remark, machine, median, write_section  # noqa: E402
from transformer.training.run import compile_for_batches  # noqa: E402
from transformer.loss import label_smoothed_nll  # noqa: E402
from transformer.model import Transformer, TransformerConfig  # noqa: E402
from transformer.training.schedule import make_optimizer  # noqa: E402

HEADING = "## torch.compile on CPU"


def shapes(count: int, tokens: int, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        s = rng.randint(8, 60)
        t = max(4, min(80, int(s * rng.uniform(0.8, 1.3))))
        out.append((max(1, tokens // max(s, t)), s, t))
    return out


def batches(config: TransformerConfig, dims) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for b, s, t in dims:
        src = torch.randint(4, config.vocab_size, (b, s), generator=g)
        src[:, -1] = config.eos_id
        out.append((src, torch.randint(4, config.vocab_size, (b, t), generator=g),
                    torch.randint(4, config.vocab_size, (b, t), generator=g)))
    return out


def stepper(module: torch.nn.Module, model: Transformer):
    optimizer = make_optimizer(model.parameters())

    def step(src, tgt_in, tgt_out):
        loss, _ = label_smoothed_nll(module(src, tgt_in), tgt_out, epsilon=0.1, ignore_index=model.config.pad_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(rounds: int, count: int, tokens: int) -> str:
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=8000, d_model=256, heads=4, d_ff=1024, encoder_layers=3,
                               decoder_layers=3, dropout=0.1)
    eager_model = Transformer(config).train()
    compiled_model = Transformer(config).train()
    compiled_model.load_state_dict(eager_model.state_dict())
    data = batches(config, shapes(count, tokens))
    engines = {"eager": stepper(eager_model, eager_model),
               "compiled": stepper(compile_for_batches(compiled_model), compiled_model)}
    before = load_average()
    started = time.perf_counter()
    for batch in data:
        engines["compiled"](*batch)
    first_pass = time.perf_counter() - started
    frames_after_warmup = dynamo_utils.counters["stats"]["unique_graphs"]
    for batch in data:
        engines["eager"](*batch)
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for batch in data:
            for name, step in engines.items():
                start = time.perf_counter()
                step(*batch)
                times[name].append(time.perf_counter() - start)
    recompiled = dynamo_utils.counters["stats"]["unique_graphs"] - frames_after_warmup
    after = load_average()
    eager, compiled = median(times["eager"]), median(times["compiled"])
    return "\n".join([
        HEADING, "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine(torch.device('cpu'))}, torch {torch.__version__}. "
        f"Command: `python benchmarks/compile_step.py`. {load_remark(before, after)}.", "",
        f"A small model (d_model 256, 3+3 layers, 8k vocabulary, dropout 0.1), {count} batch shapes "
        f"of about {tokens} tokens as token batching makes them, a training step each (fused Adam), "
        f"{rounds} rounds in turns, medians:", "",
        "| engine | step time | first pass over the shapes (compiles) | graphs compiled after it |",
        "| --- | --- | --- | --- |",
        f"| eager | {eager * 1000:.0f} ms | | |",
        f"| `train.compile=true` (inductor, dynamic shapes) | {compiled * 1000:.0f} ms ({eager / compiled:.2f}× eager) "
        f"| {first_pass:.0f} s, {frames_after_warmup} graphs | {recompiled} |", "",
        "tests/training/test_compile.py checks the graph count on every run of the suite (40 shapes, no recompilation).", "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    section = measure(args.rounds, args.shapes, args.tokens)
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
