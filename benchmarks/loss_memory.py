"""Peak memory of a training update with the chunked loss against the loss it replaced, on the CPU.

    python benchmarks/loss_memory.py                         # base model, 4,096 target tokens, fp32 and bf16
    python benchmarks/loss_memory.py --write docs/BENCHMARKS.md
    python benchmarks/loss_memory.py --smoke                 # a tiny model, seconds (the suite runs it)

An update is train.py's work for one pass: forward (bf16: under CPU autocast), the label-smoothed loss
(ε = 0.1), backward, Adam (`transformer.schedule.make_optimizer`), with the logits held by the caller until
the backward is done, as train.py holds them. "before" is `transformer/loss.py` at the git revision
`--before` (default 42eec8b, main before issue #49: log_softmax over one float32 [N, V] copy of the logits,
kept for the backward), read with `git show`, so the old code lives in git only; "after" is this checkout's.

Each (loss, precision) runs in a fresh process, in turns. The process first makes one update (Adam's moments,
the allocator's first pages), then resets the kernel's peak-RSS mark (/proc/self/clear_refs) and makes a
second: the figure is that update's peak resident memory over the resident memory before it. glibc's malloc
is told to serve every request over 64 KiB with its own mapping and to return it on free (mallopt), so the
resident memory follows the live tensors instead of keeping freed ones (train.py's `keep_freed_memory`
does the opposite, for speed). Linux only.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from _common import ROOT, describe, load_average, measured_on, random_tokens, table, write_section
from transformer.model import Transformer, TransformerConfig
from transformer.training.schedule import make_optimizer

HEADING = "## Loss memory"
EPSILON = 0.1


def loss_function(variant: str, revision: str):
    """`label_smoothed_nll` of this checkout ("after") or of transformer/loss.py at `revision` ("before")."""
    if variant == "after":
        from transformer.loss import label_smoothed_nll
        return label_smoothed_nll
    source = subprocess.run(["git", "show", f"{revision}:transformer/loss.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("loss_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"{revision}:transformer/loss.py", "exec"), module.__dict__)
    return module.label_smoothed_nll


def memory_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) for key in ("VmRSS", "VmHWM")}


def measure(args: argparse.Namespace) -> dict:
    """One process's figures for (args.variant, args.precision): run in a child (`--child`)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 0)
    torch.set_num_threads(args.threads)
    loss_fn = loss_function(args.variant, args.before)
    config = config_of(args)
    torch.manual_seed(0)
    model = Transformer(config).train()
    optimizer = make_optimizer(model.parameters())
    batch, length = args.tokens // args.length, args.length
    src = random_tokens(batch, length, config.vocab_size, seed=1, device=torch.device("cpu"))
    tgt = random_tokens(batch, length + 1, config.vocab_size, seed=2, device=torch.device("cpu"))

    def update() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(src, tgt[:, :-1])  # held until the backward is done, as in train.py
        loss, _ = loss_fn(logits, tgt[:, 1:], epsilon=EPSILON, ignore_index=config.pad_id)
        (loss / (batch * length)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    update()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the present VmRSS
    before = memory_kib()["VmRSS"]
    start = time.perf_counter()
    update()
    seconds = time.perf_counter() - start
    peak = memory_kib()["VmHWM"]
    return {"variant": args.variant, "precision": args.precision, "before_mib": before / 1024,
            "peak_mib": peak / 1024, "update_mib": (peak - before) / 1024, "seconds": seconds,
            "logits_mib": batch * length * config.vocab_size * (2 if args.precision == "bf16" else 4) / 2**20}


def config_of(args: argparse.Namespace) -> TransformerConfig:
    if args.smoke:
        return TransformerConfig(vocab_size=2000, d_model=32, heads=2, d_ff=64, encoder_layers=1,
                                 decoder_layers=1, dropout=0.1)
    return TransformerConfig.base(vocab_size=37000)


def child(args: argparse.Namespace, variant: str, precision: str) -> dict:
    command = [sys.executable, __file__, "--child", "--variant", variant, "--precision", precision,
               "--tokens", str(args.tokens), "--length", str(args.length), "--threads", str(args.threads),
               "--before", args.before] + (["--smoke"] if args.smoke else [])
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if result.returncode != 0:
        raise SystemExit(f"the {variant} / {precision} process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="target tokens of the update (and source tokens)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence, both sides; no padding")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", default="42eec8b", help="git revision of the loss to compare with")
    parser.add_argument("--smoke", action="store_true", help="a tiny model: checks that the script runs")
    parser.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    load_before = load_average()
    rows, measured = [], {}
    for precision in args.precisions:
        for variant in ("before", "after"):
            measured[variant, precision] = figures = child(args, variant, precision)
            print(json.dumps(figures), file=sys.stderr)
        before, after = measured["before", precision], measured["after", precision]
        for variant, figures in (("before", before), ("after", after)):
            rows.append([precision, f"{variant} ({args.before})" if variant == "before" else "after (chunked)",
                         f"{figures['logits_mib']:,.0f} MiB", f"{figures['before_mib']:,.0f} MiB",
                         f"{figures['peak_mib']:,.0f} MiB", f"{figures['update_mib']:,.0f} MiB",
                         f"{figures['seconds']:.2f} s"])
        rows.append([precision, "after − before", "", "", f"{after['peak_mib'] - before['peak_mib']:+,.0f} MiB",
                     f"{after['update_mib'] - before['update_mib']:+,.0f} MiB", ""])
    config = config_of(args)
    section = "\n".join([
        HEADING, "",
        measured_on("loss_memory.py", threads=args.threads, load_before=load_before), "",
        f"One update ({'tiny model' if args.smoke else 'base'}: {describe(config)}; {args.tokens // args.length} × "
        f"{args.length} source and target tokens, no padding; forward, label-smoothed loss, backward, Adam), each "
        "in a fresh process after one update of warm-up. Resident memory before the update, its peak during it, "
        "and the difference: what the update itself needs (activations, logits, the loss, gradients). The "
        "update's time is one update on shared cores: a rough figure.", "",
        table(["precision", "loss", "logits [N, V]", "resident before", "peak", "update's peak − before",
               "update time"], rows),
    ])
    print(section)
    if args.write:
        write_section(args.write, HEADING, section)


if __name__ == "__main__":
    main()
