"""train.compile=true against eager on CPU: step time over variable-length batches, and what compiling costs.

    python benchmarks/compile_step.py                                    # the Multi30k model, fp32 and bf16
    python benchmarks/compile_step.py --models small,base --shapes 8 --rounds 2 --tokens 2048 \
        --write docs/BENCHMARKS.md                                       # and the paper's base model (~15 min)
    python benchmarks/compile_step.py --smoke                            # a tiny model, every step, briefly

A training step as train.py makes it (forward under the run's autocast, label-smoothed loss, backward, fused
Adam), once eager and once through `transformer.training.run.compile_for_batches` (torch.compile, inductor,
dynamic shapes), for each model (`small`: the Multi30k preset's shape, d_model 256, 3+3 layers, 8k vocabulary;
`base`: the paper's base model with a 37k vocabulary) and each precision (`fp32`; `bf16`: autocast, as the
Multi30k preset trains where the CPU has native bf16). The batches have the shapes token batching gives: random
(B, S, T) with B × max(S, T) ≈ --tokens; every shape is stepped once to warm up (and compile), then the shapes are
timed in turns with the other engine, several rounds, medians per step. Recompilations are counted (dynamo's
frame counter): the point of `compile_for_batches` is that there are none after the first batches.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import describe, load_average, measured_on, median, model_configs, table, write_section  # noqa: E402
from transformer.loss import label_smoothed_nll  # noqa: E402
from transformer.model import TransformerConfig, Transformer  # noqa: E402
from transformer.training.run import compile_for_batches  # noqa: E402
from transformer.training.schedule import make_optimizer  # noqa: E402

HEADING = "## torch.compile on CPU"
TINY = TransformerConfig(vocab_size=500, d_model=32, heads=2, d_ff=64, encoder_layers=1, decoder_layers=1, dropout=0.1)


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


def stepper(module: torch.nn.Module, model: Transformer, precision: str):
    optimizer = make_optimizer(model.parameters())
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())

    def step(src, tgt_in, tgt_out):
        with autocast:
            logits = module(src, tgt_in)
        loss, _ = label_smoothed_nll(logits, tgt_out, epsilon=0.1, ignore_index=model.config.pad_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def measure(config: TransformerConfig, precision: str, *, rounds: int, count: int, tokens: int) -> dict:
    """Eager against compiled for one model and precision: median step times, the first (compiling) pass over the
    shapes, and the graphs compiled during it and after it."""
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    torch.manual_seed(0)
    eager_model = Transformer(config).train()
    compiled_model = Transformer(config).train()
    compiled_model.load_state_dict(eager_model.state_dict())
    data = batches(config, shapes(count, tokens))
    engines = {"eager": stepper(eager_model, eager_model, precision),
               "compiled": stepper(compile_for_batches(compiled_model), compiled_model, precision)}
    started = time.perf_counter()
    for batch in data:
        engines["compiled"](*batch)
    first_pass = time.perf_counter() - started
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for batch in data:
        engines["eager"](*batch)
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for batch in data:
            for name, step in engines.items():
                start = time.perf_counter()
                step(*batch)
                times[name].append(time.perf_counter() - start)
    return {"eager": median(times["eager"]), "compiled": median(times["compiled"]), "first_pass": first_pass,
            "graphs": graphs, "recompiled": dynamo_utils.counters["stats"]["unique_graphs"] - graphs}


def section(args: argparse.Namespace, threads: int) -> str:
    configs = {"tiny": TINY} if args.smoke else model_configs()
    before, rows = load_average(), []
    for name in args.models.split(","):
        for precision in args.precision.split(","):
            r = measure(configs[name], precision, rounds=args.rounds, count=args.shapes, tokens=args.tokens)
            rows.append([name, precision, f"{r['eager'] * 1000:,.0f} ms", f"{r['compiled'] * 1000:,.0f} ms",
                         f"{r['eager'] / r['compiled']:.2f}×", f"{r['first_pass']:.0f} s, {r['graphs']} graph{'s' if r['graphs'] != 1 else ''}",
                         r["recompiled"]])
            print(" | ".join(map(str, rows[-1])), file=sys.stderr, flush=True)
    models = "; ".join(f"{name} = {describe(configs[name])}" for name in args.models.split(","))
    return "\n".join([
        HEADING, "",
        measured_on("compile_step.py", threads=threads, load_before=before), "",
        f"A training step as train.py makes it ({models}; dropout 0.1, fused Adam), {args.shapes} batch shapes of "
        f"about {args.tokens} tokens as token batching makes them, each stepped once by each engine to warm up, "
        f"then {args.rounds} round(s) in turns; medians:", "",
        table(["model", "precision", "eager step", "`train.compile=true` step", "speed-up",
               "first pass over the shapes (compiles)", "graphs compiled after it"], rows), "",
        "tests/training/test_compile.py checks the graph count on every run of the suite (40 shapes, no recompilation).",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small", help="comma-separated: small (the Multi30k shape), base, big")
    parser.add_argument("--precision", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=5000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 3 shapes of 200 tokens, 1 round")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    if args.smoke:
        args.models, args.shapes, args.tokens, args.rounds = "tiny", 3, 200, 1
    torch.set_num_threads(args.threads)
    text = section(args, args.threads)
    print(text)
    if args.write:
        write_section(args.write, HEADING, text)


if __name__ == "__main__":
    main()
