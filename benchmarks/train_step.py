"""One training step (forward, label-smoothed loss, backward, Adam): ours against HF `MarianMTModel`.

    python benchmarks/train_step.py                 # small and base, fp32 and bf16 autocast (CPU: ~10 min)
    python benchmarks/train_step.py --quick         # small only (~1 min)
    python benchmarks/train_step.py --write docs/BENCHMARKS.md   # and replace the section there
    python benchmarks/train_step.py --profile base --precision fp32   # torch.profiler top entries instead

Both engines get the same batch (64 sentences × 32 source tokens, 64 × 32 target tokens, no padding), the
same loss function (`transformer.loss.label_smoothed_nll`, ε = 0.1, computed from each model's logits), the
same Adam (`transformer.training.schedule.make_optimizer`: torch's fused Adam) and the same dropout 0.1,
in training mode. Each engine's step is timed in turns with the other's (A B A B ...), medians after warm-up.

MFU = counted FLOPs / time / matmul peak, the peak measured in the same run: on CPU the faster of float32
`torch.mm` (MKL) and float32 oneDNN (what our model uses on CPU), on CUDA bf16 `torch.mm`. FLOPs per step
(matmuls only; ×3 for forward + backward):
    3 × (2 × [L·(4d² + 2d·d_ff)·S_tok + (L·(8d² + 2d·d_ff) + d·V)·T_tok] + 4·B·L·d·(S² + T² + S·T))

On CUDA (chosen automatically) the same script measures, instead, bf16 autocast steps at the paper's
25k-token batch for base and big: tokens/s, peak memory, MFU, and the projected wall time of the paper's
recipes (base 100k steps, big 300k steps of 25k tokens) on 1 and 8 GPUs.
"""

from __future__ import annotations

import _common as common
import contextlib
import time
from functools import partial

import torch

from _common import (alternate, describe, load_average, load_remark, machine, marian_model, matmul_peak, median,
                     model_configs, print_profile, random_tokens, table, versions, write_section)
from transformer.loss import label_smoothed_nll
from transformer.kernels import _ONEDNN_LINEAR, _onednn
from transformer.model import Transformer, TransformerConfig
from transformer.training.schedule import make_optimizer

HEADING_CPU = "## Training step"
HEADING_GPU = "## GPU: training step"
EPSILON = 0.1
PAPER_STEPS = {"base": 100_000, "big": 300_000}  # §5.2: base 100k steps (12 h), big 300k steps (3.5 days), 8 P100


def step_flops(config: TransformerConfig, batch: int, src_len: int, tgt_len: int) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 × forward), the formula of the docstring."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    le, ld = config.encoder_layers, config.decoder_layers
    s_tok, t_tok = batch * src_len, batch * tgt_len
    dense = le * (4 * d * d + 2 * d * f) * s_tok + (ld * (8 * d * d + 2 * d * f) + d * v) * t_tok
    # attention scores and weighted sums: encoder S², decoder self T², cross S·T (the formula
    # counts all three for L = the layer count of a symmetric model)
    layers = max(le, ld)
    attention = 4 * batch * layers * d * (src_len**2 + tgt_len**2 + src_len * tgt_len)
    return 3 * (2 * dense + attention)


def onednn_peak(repeats: int = 7, n: int = 2048) -> float:
    """FLOP/s of float32 n×n @ n×n in oneDNN (the kernel `transformer.kernels.linear` uses on CPU)."""
    if _ONEDNN_LINEAR is None:
        return 0.0
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        _onednn(a, b, None)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / median(times)


class Engines:
    """Ours and Marian with their optimizers and the shared batch; `step(name)` runs one training step."""

    def __init__(self, config: TransformerConfig, *, batch: int, src_len: int, tgt_len: int,
                 device: torch.device):
        self.device = device
        torch.manual_seed(0)
        self.ours = Transformer(config).to(device).train()
        self.marian = marian_model(config, device).train()
        self.optim = {"ours": make_optimizer(self.ours.parameters()),
                      "marian": make_optimizer(self.marian.parameters())}
        for optim in self.optim.values():  # a constant small lr: the schedule is not what is measured
            for group in optim.param_groups:
                group["lr"] = 1e-4
        v = config.vocab_size
        self.src = random_tokens(batch, src_len, v, seed=1, device=device)
        self.src[:, -1] = config.eos_id
        tgt = random_tokens(batch, tgt_len, v, seed=2, device=device)
        self.tgt_out = tgt.clone()
        self.tgt_out[:, -1] = config.eos_id
        self.tgt_in = torch.cat([torch.full_like(tgt[:, :1], config.bos_id), tgt[:, :-1]], dim=1)
        # Marian: the same ids; its decoder starts from PAD = vocab_size - 1, its mask is all ones.
        self.marian_tgt_in = self.tgt_in.clone()
        self.marian_tgt_in[:, 0] = v - 1
        self.src_mask = torch.ones_like(self.src)
        self.ignore = {"ours": config.pad_id, "marian": v - 1}
        self.tokens = self.src.numel() + self.tgt_out.numel()

    def logits(self, name: str) -> torch.Tensor:
        if name == "ours":
            return self.ours(self.src, self.tgt_in)
        return self.marian(input_ids=self.src, attention_mask=self.src_mask,
                           decoder_input_ids=self.marian_tgt_in, use_cache=False).logits

    def step(self, name: str, precision: str) -> None:
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if precision == "bf16"
                    else contextlib.nullcontext())
        with autocast:
            logits = self.logits(name)
        loss, _ = label_smoothed_nll(logits, self.tgt_out, epsilon=EPSILON, ignore_index=self.ignore[name])
        (loss / self.tgt_out.numel()).backward()
        self.optim[name].step()
        self.optim[name].zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------ CPU
def cpu_section(args) -> str:
    device = torch.device("cpu")
    names = ["small"] if args.quick else ["small", "base"]
    configs = model_configs()
    load_before = load_average()
    peaks = {"mkl": matmul_peak(device, torch.float32), "onednn": onednn_peak(),
             "bf16": matmul_peak(device, torch.bfloat16)}
    peak = max(peaks["mkl"], peaks["onednn"])
    rows, results = [], []
    for name in names:
        config = configs[name]
        engines = Engines(config, batch=64, src_len=32, tgt_len=32, device=device)
        flops = step_flops(config, 64, 32, 32)
        for precision in ("fp32", "bf16"):
            times = alternate({e: partial(engines.step, e, precision) for e in ("ours", "marian")},
                              device=device, warmup=args.warmup, repeats=args.repeats)
            t_ours, t_marian = median(times["ours"]), median(times["marian"])
            ratio = t_marian / t_ours
            mfu_ours, mfu_marian = flops / t_ours / peak, flops / t_marian / peak
            target = TARGETS.get((name, precision))
            met = "" if target is None else ("met" if target_met(target, ratio, mfu_ours) else "missed")
            rows.append([name, precision, f"{engines.tokens / t_ours:,.0f}", f"{engines.tokens / t_marian:,.0f}",
                         f"{ratio:.2f}×", f"{100 * mfu_ours:.0f} %", f"{100 * mfu_marian:.0f} %",
                         f"{t_ours:.2f} s / {t_marian:.2f} s", target_text(target), met])
            results.append((name, precision, times))
            print(f"{name} {precision}: ours {t_ours:.3f} s, marian {t_marian:.3f} s, ratio {ratio:.2f}, "
                  f"MFU {100 * mfu_ours:.0f} % vs {100 * mfu_marian:.0f} %  (load {load_average():.1f})", flush=True)
        del engines
    load_after = load_average()
    command = common.command_line("train_step.py")
    lines = [
        args.heading or HEADING_CPU, "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine(device)}; "
        f"{load_remark(load_before, load_after)}. "
        f"{versions('transformers')}. Command: `{command}` ({args.warmup} warm-up + {args.repeats} timed "
        "steps per engine and precision, medians).", "",
        f"Matmul peak measured in the same run (2048³): float32 `torch.mm` (MKL) {peaks['mkl'] / 1e9:.0f} "
        f"GFLOP/s, float32 oneDNN {peaks['onednn'] / 1e9:.0f} GFLOP/s, bf16 `torch.mm` {peaks['bf16'] / 1e9:.0f} "
        f"GFLOP/s. MFU divides by the faster float32 figure, {peak / 1e9:.0f} GFLOP/s, for both precisions and "
        "both engines.", "",
        "Batch: 64 × 32 source + 64 × 32 target tokens; tokens/s counts both (4,096 per step). Models: small = "
        f"{describe(configs['small'])}; base = {describe(configs['base'])}; dropout 0.1, label smoothing 0.1.", "",
        table(["model", "precision", "ours tokens/s", "Marian tokens/s", "ours / Marian", "MFU ours",
               "MFU Marian", "median step (ours / Marian)", "target", ""], rows),
    ]
    return "\n".join(lines) + "\n"


TARGETS = {("base", "fp32"): ("ratio", 1.2, "mfu", 0.60), ("base", "bf16"): ("ratio", 1.5)}


def target_met(target, ratio: float, mfu: float) -> bool:
    ok = ratio >= target[1]
    if len(target) > 2:
        ok = ok and mfu >= target[3]
    return ok


def target_text(target) -> str:
    if target is None:
        return ""
    text = f"≥ {target[1]}×"
    if len(target) > 2:
        text += f", MFU ≥ {100 * target[3]:.0f} %"
    return text


# ------------------------------------------------------------------------------------------ GPU
def gpu_section(args) -> str:
    device = torch.device("cuda")
    configs = model_configs()
    peak = matmul_peak(device, torch.bfloat16)
    seq = 32
    batch = 25_000 // seq  # the paper's ~25k source + ~25k target tokens per step (§5.1)
    rows, projections = [], []
    for name in (["base"] if args.quick else ["base", "big"]):
        config = configs[name]
        flops = step_flops(config, batch, seq, seq)
        engines = Engines(config, batch=batch, src_len=seq, tgt_len=seq, device=device)
        measured = {}
        for engine in ("ours", "marian"):  # alone, so that each peak memory is its own
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            times = alternate({engine: partial(engines.step, engine, "bf16")}, device=device,
                              warmup=args.warmup + 2, repeats=max(args.repeats, 10))[engine]
            measured[engine] = (median(times), torch.cuda.max_memory_allocated(device) / 2**30)
        (t_ours, mem_ours), (t_marian, mem_marian) = measured["ours"], measured["marian"]
        mfu = flops / t_ours / peak
        rows.append([name, f"{engines.tokens / t_ours:,.0f}", f"{engines.tokens / t_marian:,.0f}",
                     f"{t_marian / t_ours:.2f}×", f"{100 * mfu:.0f} %", f"{100 * flops / t_marian / peak:.0f} %",
                     f"{mem_ours:.1f} GiB", f"{mem_marian:.1f} GiB",
                     "≥ 50 %" if name == "big" else "", ("met" if mfu >= 0.5 else "missed") if name == "big" else ""])
        steps = PAPER_STEPS[name]
        projections.append([name, f"{steps:,}", f"{steps * t_ours / 3600:.1f} h",
                            f"{steps * t_ours / 8 / 3600:.1f} h"])
        print(f"{name}: ours {t_ours:.3f} s ({mem_ours:.1f} GiB), marian {t_marian:.3f} s, MFU {100 * mfu:.0f} %",
              flush=True)
        del engines
        torch.cuda.empty_cache()
    command = common.command_line("train_step.py")
    lines = [
        args.heading or HEADING_GPU, "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine(device)}; {versions('transformers')}. "
        f"Command: `{command}`. bf16 autocast, fused Adam, batch {batch} × {seq} source + {batch} × {seq} target "
        f"tokens (the paper's ~25k per side). bf16 matmul peak measured in the same run (8192³): "
        f"{peak / 1e12:.0f} TFLOP/s; MFU divides by it.", "",
        table(["model", "ours tokens/s", "Marian tokens/s", "ours / Marian", "MFU ours", "MFU Marian",
               "peak memory ours", "peak memory Marian", "target", ""], rows), "",
        "Projected wall time of the paper's recipes at the measured rate (25k-token steps; 8 GPUs assumes "
        "each takes 1/8 of the batch at the same tokens/s, i.e. perfect scaling: a lower bound):", "",
        table(["model", "steps", "1 GPU", "8 GPUs"], projections),
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ profile
def profile(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engines = Engines(model_configs()[args.profile], batch=64, src_len=32, tgt_len=32, device=device)
    for engine in ("ours", "marian"):
        print_profile(f"{engine}, {args.profile}, {args.precision}",
                      lambda: engines.step(engine, args.precision), args.rows)


def main() -> None:
    parser = common.parser(__doc__, repeats_what="steps")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = common.parse(parser)
    if args.profile:
        profile(args)
        return
    gpu = torch.cuda.is_available() and not args.cpu
    section = gpu_section(args) if gpu else cpu_section(args)
    print(section)
    if args.write:
        write_section(args.write, args.heading or (HEADING_GPU if gpu else HEADING_CPU), section)


if __name__ == "__main__":
    main()
