"""Which CPU kernel for float32 linear maps is faster on this machine: oneDNN or plain `F.linear` (MKL's
sgemm), in training steps of a quickstart-sized model; the choice the model makes on this machine
(`transformer.kernels.choose_float32_kernel`: oneDNN on AMD CPUs with AVX-512) is printed beside the figures.

    python benchmarks/kernel_choice.py                    # 2 threads, 3 rounds of 5 steps each way
    python benchmarks/kernel_choice.py --threads 1 --d-model 512 --layers 6

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
from transformer.schedule import make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    main()
