"""Which CPU kernel for float32 linear maps is faster on this machine: oneDNN or plain `F.linear` (MKL's
sgemm), in training steps of a quickstart-sized model; the choice the model makes on this machine
(`transformer.kernels.choose_float32_kernel`: oneDNN on AMD CPUs with AVX-512) is printed beside the figures.
Decoding has its own choice (oneDNN on every AMD CPU): `--decode` times ours decoding benchmarks/decode.py's
synthetic work (100 sentences, exactly 30 tokens each) with each kernel, CTranslate2 float32 beside them.

    python benchmarks/kernel_choice.py                    # 2 threads, 3 rounds of 5 steps each way
    python benchmarks/kernel_choice.py --threads 1 --d-model 512 --layers 6
    python benchmarks/kernel_choice.py --decode --threads 1 --rounds 3 --models small base

The two take turns (oneDNN, plain, oneDNN, ...) so that load from other jobs falls on both alike; the model,
batch and optimizer are the same, and only `kernels.ONEDNN_FLOAT32` changes between them.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import machine

from transformer import kernels
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.training.schedule import make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--decode", action="store_true", help="decoding (greedy and beam 4) instead of training")
    parser.add_argument("--models", nargs="+", default=["small"], choices=["small", "base", "big"],
                        help="--decode: benchmarks/decode.py's model shapes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        return decoding(args)
    chosen = kernels.onednn_for_float32()
    config = TransformerConfig(vocab_size=1000, d_model=args.d_model, heads=4, d_ff=4 * args.d_model,
                               encoder_layers=args.layers, decoder_layers=args.layers, dropout=0.1)
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = make_optimizer(model.parameters())
    batch, length = 200, 24  # ~4,800 tokens per side: the quickstart's 5k-token batches
    src = torch.randint(4, 1000, (batch, length))
    tgt = torch.randint(4, 1000, (batch, length + 1))

    def step() -> None:
        logits = model(src, tgt[:, :-1])
        loss, _ = label_smoothed_nll(logits, tgt[:, 1:], epsilon=0.1, ignore_index=config.pad_id)
        (loss / (batch * length)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {"oneDNN": [], "plain F.linear": []}
    for _ in range(args.rounds):
        for name, onednn in (("oneDNN", True), ("plain F.linear", False)):
            kernels.ONEDNN_FLOAT32 = onednn
            step()  # warm-up
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    kernels.ONEDNN_FLOAT32 = chosen
    print(f"{machine(torch.device('cpu'))} ({kernels.cpu_vendor()}), ISA {torch.backends.cpu.get_cpu_capability()}, "
          "the model's choice: "
          f"{'oneDNN' if chosen else 'plain F.linear'}; "
          f"d_model {args.d_model}, {args.layers}+{args.layers} layers, {batch} × {length} tokens per side")
    for name, values in times.items():
        print(f"{name}: " + ", ".join(f"{v:.3f}" for v in values) + " s per step")


def decoding(args: argparse.Namespace) -> None:
    """Ours decoding with MKL and with oneDNN (packed weights) in turns, one warm-up run each, then
    CTranslate2 float32 on the same weights; generated tokens/s of the medians, and the ranges."""
    import statistics
    import tempfile
    from pathlib import Path

    from _common import model_configs
    from decode import OUT_LEN, SENTENCES, Engines

    kernels.keep_freed_memory()  # the malloc settings of our entry points and of benchmarks/decode.py
    chosen = kernels.onednn_for_float32(inference=True)
    print(f"{machine(torch.device('cpu'))}; the model's decoding choice: {'oneDNN' if chosen else 'MKL'}")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            engines = Engines(model_configs()[name], device=torch.device("cpu"), threads=args.threads,
                              workdir=Path(tmp), with_ct2=True)
            for beam in (1, 4):
                ours = engines.ours_fn(engines.ours, beam)  # the same search, with each kernel
                runs = {"MKL": (False, ours), "oneDNN": (True, ours),
                        "CTranslate2 float32": (chosen, engines.ct2_fn(engines.ct2["float32"], beam))}
                times: dict[str, list[float]] = {label: [] for label in runs}
                for round_ in range(args.rounds + 1):
                    for label, (onednn, run) in runs.items():
                        kernels.ONEDNN_FLOAT32_INFERENCE = onednn
                        start = time.perf_counter()
                        run()
                        if round_:  # round 0 warms up
                            times[label].append(time.perf_counter() - start)
                kernels.ONEDNN_FLOAT32_INFERENCE = chosen
                tokens = SENTENCES * OUT_LEN
                print(f"{name} {'greedy' if beam == 1 else f'beam {beam}'}: " + "; ".join(
                    f"{label} {tokens / statistics.median(v):,.0f} tokens/s ({min(v):.2f}-{max(v):.2f} s)"
                    for label, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
