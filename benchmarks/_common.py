"""Shared pieces of the benchmarks: the machine, timing, the matmul peak, the peer model, the Markdown output.

The peer is Hugging Face's `MarianMTModel` holding the weights of a random model of ours (transformer/interop/marian.py's
export: the same function, the same token ids), so the engines compute the same translations. It keeps
what Marian has and the paper has not: biases on the attention projections and a `final_logits_bias`
(zero, but added), and sinusoids laid out as [sin ... | cos ...] (the model dimension permuted to match).
None of them changes the matmul work per token.
"""

from __future__ import annotations

import argparse
import datetime
import dataclasses
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformer.interop import marian
from transformer import kernels  # noqa: E402
from transformer.kernels import keep_freed_memory  # noqa: E402
from transformer.model import Transformer, TransformerConfig  # noqa: E402


# ------------------------------------------------------------------------------------------ the machine
def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core CPU ({cpu_name()}; {kernels.cpu_vendor() or 'vendor unknown'}, torch ISA "
            f"{torch.backends.cpu.get_cpu_capability()}, float32 linear maps on "
            f"{'oneDNN' if kernels.onednn_for_float32() else 'MKL'} in training, "
            f"{'oneDNN' if kernels.onednn_for_float32(inference=True) else 'MKL'} in decoding), {mem:.0f} GiB RAM, "
            f"{torch.get_num_threads()} torch thread" + ("s" if torch.get_num_threads() != 1 else ""))


def load_average() -> float:
    return os.getloadavg()[0]


def print_profile(title: str, fn: Callable[[], object], rows: int) -> None:
    """Run fn once to warm up, then once under torch.profiler; print its top `rows` ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(f"=== {title}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def measured_on(script: str, *, threads: int, load_before: float) -> str:
    """The sentence that opens a CPU benchmark's section: when, on which CPU, threads, torch, the load before
    and after, and the command that made it."""
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"Measured {when} on {os.cpu_count()}-core CPU ({cpu_name()}), {threads} torch thread(s), torch "
            f"{torch.__version__}; 1-minute load average {load_before:.1f} before, {load_average():.1f} after. "
            f"Command: `{command_line(script)}`.")


def load_remark(before: float, after: float) -> str:
    """How the load average qualifies the figures: the benchmark itself keeps about one core busy."""
    text = f"1-minute load average {before:.1f} before, {after:.1f} after"
    if max(before, after) > 1.5:
        text += (" (other jobs shared the cores: absolute figures are pessimistic and noisy; the engines ran "
                 "in turns, so the ratios are fair)")
    return text


def versions(*names: str) -> str:
    """'python 3.11.7, torch 2.13.0, ...' for the packages that are importable."""
    out = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for name in names:
        try:
            module = __import__(name)
            out.append(f"{name} {module.__version__}")
        except ImportError:
            out.append(f"{name} not installed")
    return ", ".join(out)


# ------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(engines: dict[str, Callable[[], object]], *, device: torch.device, warmup: int,
              repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each engine, the engines taking turns (A B C A B C ...) so that a burst of load
    from other jobs falls on all of them alike. `warmup` untimed rounds first."""
    for _ in range(warmup):
        for fn in engines.values():
            fn()
            sync(device)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, fn in engines.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def matmul_peak(device: torch.device, dtype: torch.dtype, *, n: int | None = None, repeats: int = 7) -> float:
    """FLOP/s of a square n×n @ n×n matmul in `dtype`, the median of `repeats` (after one warm-up)."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    inner = 10 if device.type == "cuda" else 1
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            torch.mm(a, b)
        sync(device)
        if i:
            times.append((time.perf_counter() - start) / inner)
    return 2 * n**3 / median(times)


# ------------------------------------------------------------------------------------------ the peer
def ours_model(config: TransformerConfig, device: torch.device) -> Transformer:
    """Our random model of this shape (seed 0): the weights every engine of a benchmark holds."""
    torch.manual_seed(0)
    return Transformer(config).to(device)


def marian_model(config: TransformerConfig, device: torch.device):
    """`MarianMTModel` with the weights of `ours_model(config)` (transformer/interop/marian.py `marian_model`)."""
    model = marian.marian_model(ours_model(config, torch.device("cpu"))).to(device)
    embeddings = {id(model.model.encoder.embed_tokens.weight), id(model.model.decoder.embed_tokens.weight),
                  id(model.lm_head.weight)}
    if len(embeddings) != 1:
        raise RuntimeError("MarianMTModel did not tie its embeddings: the comparison would be unfair")
    return model


def random_tokens(batch: int, length: int, vocab: int, *, seed: int, device: torch.device) -> torch.Tensor:
    """[batch, length] ids in [4, vocab - 1): no special id of ours (0-3)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab - 1, (batch, length), generator=generator).to(device)


def model_configs(vocab_base: int = 37000) -> dict[str, TransformerConfig]:
    return {
        "small": TransformerConfig(vocab_size=8000, d_model=256, heads=4, d_ff=1024, encoder_layers=3,
                                   decoder_layers=3, dropout=0.1),
        "base": TransformerConfig.base(vocab_size=vocab_base),
        "big": TransformerConfig.big(vocab_size=vocab_base),
    }


def describe(config: TransformerConfig) -> str:
    c = dataclasses.asdict(config)
    return (f"d {c['d_model']}, {c['heads']} heads, {c['encoder_layers']}+{c['decoder_layers']} layers, "
            f"d_ff {c['d_ff']}, vocab {c['vocab_size']}")


# ------------------------------------------------------------------------------------------ Markdown
def table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(path: Path, heading: str, section: str) -> None:
    """Replace the `heading` section of a Markdown file (up to the next '## '), or append it."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start = text.find("\n" + heading + "\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        start += 1
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section.rstrip("\n") + "\n" + (text[end:] if end != -1 else "")
    path.write_text(text, encoding="utf-8")


def publish(section: str, path: Path | None, heading: str) -> None:
    """Print a benchmark's section, and replace its `heading` section of the Markdown file `path` if given."""
    print(section)
    if path:
        write_section(path, heading, section)


def parser(doc: str, *, repeats_what: str) -> argparse.ArgumentParser:
    """The options both speed benchmarks take; each script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model only")
    p.add_argument("--write", type=Path, help="Markdown file whose section to replace")
    p.add_argument("--threads", type=int, default=None, help="threads of every engine (default: all cores)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help=f"timed {repeats_what} per engine (default 5; quick 3)")
    p.add_argument("--cpu", action="store_true", help="the CPU benchmark even where CUDA is available")
    p.add_argument("--profile", choices=["small", "base", "big"], help="print torch.profiler tables instead")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--heading", help="the section's heading, '## ...' (default: the script's; one per CPU kind)")
    return p


def check_heading(parser: argparse.ArgumentParser, heading: str | None) -> None:
    """--heading must be a Markdown section heading (write_section finds the section by it)."""
    if heading is not None and not heading.startswith("## "):
        parser.error(f"--heading {heading!r}: give a Markdown section heading, '## ...'")


def command_line(script: str) -> str:
    """The command that is running, as a reader would type it: `python benchmarks/<script> <its arguments>`."""
    return shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]])


def parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, apply the thread count and the malloc settings of our entry points, fill the default repeats.

    The malloc settings are process-wide, so the peers measured in the same process get them too."""
    args = p.parse_args()
    check_heading(p, args.heading)
    keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    return args
