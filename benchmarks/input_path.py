"""The input path against the GPU it feeds: updates per second that collating sustains on one CPU core.

    python benchmarks/input_path.py                          # prints a Markdown section (about a minute)
    python benchmarks/input_path.py --write docs/BENCHMARKS.md

What is timed (CPU time of the thread, so other jobs on the machine do not inflate it) is what train.py's
`Prefetcher` does on the host for each update: the BatchStream deals the
update's batches and `collate` pads them into tensors (on a GPU it also copies them to page-locked memory
and queues the transfer; this CPU-only build of torch cannot pin memory, so that part is not in the figure).
Data: the real 45.5k-pair EN-DE sample (`../shared/data/text`), encoded with a 37k BPE vocabulary as the
paper's base recipe does, batched by the plan train.py derives for 1 GPU (7 passes of 3,571 tokens) and for
rank 0 of 8 GPUs (1 pass of 3,125 tokens). One thread, one process; the fastest of 3 rounds of `--updates`.

What one H200 consumes is an estimate, not a measurement: the matmul FLOPs of each update's padded batches
(`train_step.step_flops`, forward and backward) at 60 % of the H200's dense bf16 peak (989 TFLOP/s), an
optimistic MFU for this model size, so the estimate errs on the side of a faster GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import load_average, machine, write_section  # noqa: E402
from train_step import step_flops  # noqa: E402

from data.batching import BatchStream, Prefetcher  # noqa: E402
from data.pipeline import prepare  # noqa: E402
from transformer.model import TransformerConfig  # noqa: E402
from transformer.training.start import plan_update  # noqa: E402

HEADING = "## Input path"
H200_BF16_PEAK = 989e12  # FLOP/s, dense bf16 (NVIDIA's H200 datasheet)
ASSUMED_MFU = 0.6
ROUNDS = 3


def prepared_sample(data: Path, work: Path):
    cfg = dict(src_lang="en", tgt_lang="de", vocab_size=37000, spm_model=None, dataset=None, subset=None,
               train_prefix=str(data / "text" / "train.en-de"), valid_prefix=str(data / "text" / "newstest2013"),
               test_prefix=None, num_workers=1, cache_dir=None)
    return prepare(cfg, work, splits=("train",), seed=1, log=lambda message: None)


def measure_world(prepared, world_size: int, updates: int) -> dict:
    plan, _ = plan_update(tokens_per_update=25000, world_size=world_size, max_tokens=4096)
    train = prepared.train
    stream = BatchStream(train.src_lengths, train.tgt_lengths, max_tokens=plan.max_tokens, seed=1,
                         world_size=world_size, rank=0, update_freq=plan.update_freq)
    batches = Prefetcher(train.tokens, torch.device("cpu"))
    config = TransformerConfig.base(vocab_size=prepared.vocab.size)
    for _ in range(5):  # warm-up: the Arrow pages, numpy's allocations
        batches.next_update(stream)
    flops, tokens, rounds = 0.0, 0, []
    for _ in range(ROUNDS):  # the fastest round: a loaded machine slows even a thread's CPU time (caches)
        seconds = 0.0
        for _ in range(updates):
            start = time.thread_time()  # CPU time of this thread: what one dedicated core needs
            update = batches.next_update(stream)
            seconds += time.thread_time() - start
            for _, batch in update:
                b, s = batch.src.shape
                t = batch.tgt_out.shape[1]
                flops += step_flops(config, b, s, t) * world_size / ROUNDS  # every rank's GPU does this much
                tokens += batch.tgt_tokens / ROUNDS
        rounds.append(seconds)
    seconds = min(rounds)
    gpu_seconds = flops / updates / world_size / (ASSUMED_MFU * H200_BF16_PEAK)  # per update, per GPU
    return {"world": world_size, "plan": f"{plan.update_freq} × {plan.max_tokens}", "updates_per_s": updates / seconds,
            "ms": 1000 * seconds / updates, "tgt_tokens": tokens / updates, "gpu_updates_per_s": 1 / gpu_seconds,
            "margin": (updates / seconds) * gpu_seconds}


def measure(data: Path, updates: int) -> str:
    torch.set_num_threads(1)
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="input_path_") as tmp:
        prepared = prepared_sample(data, Path(tmp))
        rows = [measure_world(prepared, world, updates) for world in (1, 8)]
    after = load_average()
    lines = [
        HEADING, "",
        f"Measured {time.strftime('%Y-%m-%d')} on {machine(torch.device('cpu'))}, one thread. "
        f"Command: `python benchmarks/input_path.py`. 1-minute load average {before:.1f} before, {after:.1f} after "
        "(the CPU time of the collating thread is measured, which other jobs inflate only through shared caches).",
        "",
        "What the host does per update (deal the batches, pad them into tensors: `data.batching.Prefetcher`) "
        "on the real EN-DE sample with the base recipe's 37k vocabulary and 25k-token updates, against what "
        f"one H200 would consume (estimate: the update's matmul FLOPs at {ASSUMED_MFU:.0%} of 989 TFLOP/s bf16; "
        "benchmarks/input_path.py says why).", "",
        "| GPUs | passes × tokens per rank | host CPU time per update | updates/s one core sustains "
        "| target tokens per update (rank 0) | updates/s one H200 consumes (est.) | margin |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['world']} | {r['plan']} | {r['ms']:.2f} ms | {r['updates_per_s']:,.0f} | "
                     f"{r['tgt_tokens']:,.0f} | {r['gpu_updates_per_s']:.1f} | {r['margin']:.0f}× |")
    lines += ["", "The batches of update n+1 are collated after update n's work is queued on the GPU and before "
              "the host waits for it (train.py), so this time overlaps the GPU's; the margin is how many times "
              "over the host could do it. Not included: the copy to page-locked memory and the transfer, which "
              "need a GPU (benchmarks/gpu_check.py).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--write", type=Path, help="Markdown file whose section of this name to replace")
    args = parser.parse_args()
    if not (args.data / "text" / "train.en-de.en").is_file():
        sys.exit(f"error: the WMT14 text sample is not at {args.data / 'text'} (use --data)")
    section = measure(args.data.resolve(), args.updates)
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
