"""The GPU check: one short script to run where a GPU is lent (under 8 minutes on one H200).

    python benchmarks/gpu_check.py                     # on the GPU; writes the figures into docs/BENCHMARKS.md
    python benchmarks/gpu_check.py --smoke             # the same code on the CPU with a tiny model (~1 min)
    python benchmarks/gpu_check.py --out DIR           # also DIR/gpu_check.json and DIR/gpu_check.md

Steps, each timed and reported even when another fails:
1. the CUDA-only tests (`pytest -m cuda`: search and training on the GPU against the CPU, resume on the GPU);
2. training throughput of the base model in bf16 autocast with fused Adam at the paper's per-GPU batch on
   8 GPUs (3125 source + 3125 target tokens) and at the whole 25k batch on one GPU, torch.compile off and on:
   tokens/s, MFU against the bf16 matmul peak measured in the same run, peak memory;
3. beam-4 decoding of the base model (ours, bf16 and fp32): generated tokens/s, against CTranslate2 on the
   same weights where the export to CTranslate2 exists (issue #16; until then the row says so).
`--smoke` runs every step on the CPU with a 2-layer d_model 32 model and a few repeats, so CI proves the
script runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import _common as common
from _common import describe, machine, matmul_peak, median, table, versions, write_section
from train_step import step_flops
from transformer.loss import label_smoothed_nll
from transformer.model import Transformer, TransformerConfig
from transformer.training.schedule import make_optimizer
from transformer.search import beam_search

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## GPU check"
EPSILON = 0.1


def sizes(smoke: bool) -> dict:
    if smoke:
        return {"config": TransformerConfig(vocab_size=500, d_model=32, heads=2, d_ff=64, encoder_layers=2,
                                            decoder_layers=2, dropout=0.1),
                "batches": {"per GPU at 8 GPUs": (8, 16), "25k on one GPU": (16, 16)}, "repeats": 2,
                "decode": (8, 12, 10)}
    seq = 32  # source = target length; batch × seq tokens per side
    return {"config": TransformerConfig.base(vocab_size=37000),
            "batches": {"per GPU at 8 GPUs": (3125 // seq, seq), "25k on one GPU": (25_000 // seq, seq)},
            "repeats": 10, "decode": (100, 25, 30)}


def timed(device: torch.device, fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        common.sync(device)
        start = time.perf_counter()
        fn()
        common.sync(device)
        times.append(time.perf_counter() - start)
    return median(times)


def check_tests(smoke: bool) -> dict:
    """`pytest -m cuda` (on the CPU: collected only, all skipped)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=420)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"command": " ".join(command[2:]), "status": result.returncode, "summary": summary,
            "ok": result.returncode == 0, "tail": (result.stdout + result.stderr)[-2000:] if result.returncode else ""}


def train_once(model, optimizer, src: torch.Tensor, tgt: torch.Tensor, *, dtype: torch.dtype) -> None:
    """One training step: forward in autocast (on CUDA), label-smoothed loss per token, backward, Adam."""
    with torch.autocast(src.device.type, dtype=dtype, enabled=src.device.type == "cuda"):
        logits = model(src, tgt[:, :-1])
    loss, _ = label_smoothed_nll(logits, tgt[:, 1:], epsilon=EPSILON, ignore_index=0)
    (loss / tgt[:, 1:].numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_training(device: torch.device, smoke: bool) -> list[dict]:
    s = sizes(smoke)
    config, repeats = s["config"], s["repeats"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = matmul_peak(device, dtype, n=512 if smoke else None, repeats=3 if smoke else 7)
    rows = []
    for compiled in (False, True):
        for label, (batch, seq) in s["batches"].items():
            torch.manual_seed(0)
            model = Transformer(config).to(device).train()
            optimizer = make_optimizer(model.parameters())
            # On the CPU (--smoke) through AOTAutograd without inductor's C++ build: the code path, in seconds.
            forward = torch.compile(model, backend="aot_eager" if smoke else "inductor") if compiled else model
            generator = torch.Generator().manual_seed(1)
            src = torch.randint(4, config.vocab_size, (batch, seq), generator=generator).to(device)
            tgt = torch.randint(4, config.vocab_size, (batch, seq + 1), generator=generator).to(device)

            step = functools.partial(train_once, forward, optimizer, src, tgt, dtype=dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            step()  # the first step (compilation, with compile on)
            first = time.perf_counter() - start
            seconds = timed(device, step, repeats)
            memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            rows.append({"batch": label, "compile": compiled, "tokens_per_update": batch * seq,
                         "seconds": seconds, "first_step_seconds": first,
                         "tokens_per_s": 2 * batch * seq / seconds,  # source + target
                         "mfu": step_flops(config, batch, seq, seq) / seconds / peak, "peak_gib": memory,
                         "matmul_peak_tflops": peak / 1e12})
            print(f"train {label}, compile {compiled}: {seconds * 1e3:.1f} ms/step, "
                  f"MFU {100 * rows[-1]['mfu']:.0f} %", flush=True)
            del step, model, optimizer, forward  # before the next model: each peak memory is its own
    return rows


def check_decoding(device: torch.device, smoke: bool) -> list[dict]:
    s = sizes(smoke)
    sentences, src_len, out_len = s["decode"]
    torch.manual_seed(0)
    model = Transformer(s["config"]).to(device).eval()
    generator = torch.Generator().manual_seed(2)
    src = torch.randint(4, s["config"].vocab_size, (sentences, src_len), generator=generator).to(device)
    src[:, -1] = s["config"].eos_id
    options = dict(beam=4, lenpen=1.0, lenpen_style="power", min_len=out_len - 1, max_len_a=0, max_len_b=out_len - 1)
    rows = []
    for precision in ("fp32", "bf16"):
        engine = model if precision == "fp32" else model.to(torch.bfloat16)
        seconds = timed(device, lambda: beam_search(engine, src, **options), s["repeats"], warmup=1)
        rows.append({"engine": f"ours {precision}", "tokens_per_s": sentences * out_len / seconds,
                     "seconds": seconds})
        print(f"decode beam 4 ours {precision}: {sentences * out_len / seconds:,.0f} tokens/s", flush=True)
    rows.append({"engine": "CTranslate2", "tokens_per_s": None,
                 "seconds": None, "note": "not run: the export of our checkpoints to CTranslate2 is issue #16"})
    return rows


def markdown(report: dict) -> str:
    tests, train, decode = report["tests"], report["training"], report["decoding"]
    model, (sentences, src_len, out_len) = report["model"], report["decode_work"]
    lines = [HEADING, "",
             f"Measured {report['date']} on {report['machine']}; {report['versions']}. Command: "
             f"`{report['command']}` (total {report['seconds']:.0f} s).", "",
             f"CUDA tests (`{tests.get('command', '')}`): {tests.get('summary', tests.get('error'))}.", ""]
    if isinstance(train, list) and train:
        lines += [f"Training ({model}), bf16 autocast on CUDA, fused Adam; MFU against the matmul peak of that "
                  f"precision measured in the same run ({train[0]['matmul_peak_tflops']:.2f} TFLOP/s):", "",
                  table(["batch", "compile", "tokens/update (per side)", "ms/step", "tokens/s (src + tgt)", "MFU",
                         "peak memory", "first step"],
                        [[r["batch"], "on" if r["compile"] else "off", f"{r['tokens_per_update']:,}",
                          f"{r['seconds'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.0f} %",
                          "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB",
                          f"{r['first_step_seconds']:.1f} s"] for r in train]), ""]
    else:
        lines += [f"Training: {train}", ""]
    if isinstance(decode, list):
        lines += [f"Beam-4 decoding ({model}), {sentences} sentences × {src_len} source tokens, {out_len} output "
                  "tokens each:", "",
                  table(["engine", "generated tokens/s", "note"],
                        [[r["engine"], "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
                          r.get("note", "")] for r in decode])]
    else:
        lines += [f"Decoding: {decode}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the same steps on the CPU with a tiny model")
    parser.add_argument("--out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--write", type=Path, default=None,
                        help="Markdown file whose section to replace (default on a GPU: docs/BENCHMARKS.md)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device is visible: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(device),
              "model": describe(sizes(args.smoke)["config"]), "decode_work": sizes(args.smoke)["decode"],
              "versions": versions("ctranslate2"), "command": "python benchmarks/gpu_check.py"
              + (" --smoke" if args.smoke else "")}
    steps = {"tests": lambda: check_tests(args.smoke), "training": lambda: check_training(device, args.smoke),
             "decoding": lambda: check_decoding(device, args.smoke)}
    for name, step in steps.items():
        try:
            report[name] = step()
        except Exception as error:  # one failing step must not hide the others' figures
            report[name] = {"error": f"{type(error).__name__}: {error}"[:500], "ok": False}
            print(f"{name}: failed: {report[name]['error']}", file=sys.stderr, flush=True)
    report["seconds"] = time.perf_counter() - started
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(text)
    write = args.write or (None if args.smoke else ROOT / "docs" / "BENCHMARKS.md")
    if write:
        write_section(write, HEADING, text)
    failed = [name for name in ("tests", "training", "decoding")
              if isinstance(report[name], dict) and not report[name].get("ok", True)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
