"""Greedy and beam-4 decoding: ours against `MarianMTModel.generate` and CTranslate2 (float32 and int8).

    python benchmarks/decode.py                     # small and base (CPU: ~10 min)
    python benchmarks/decode.py --quick             # small only (~1 min)
    python benchmarks/decode.py --write docs/BENCHMARKS.md   # and replace the section there
    python benchmarks/decode.py --profile base --mode beam   # torch.profiler top entries of ours instead

Work: 100 source sentences of 25 random tokens (the last one EOS), one batch, and exactly 30 output tokens
for every engine and sentence, so every engine runs 30 decoder steps over the same rows:
- ours: `beam_search` / `greedy_search` with min_len = max_len_b = 29, max_len_a = 0: 29 tokens, then EOS
  is the only token allowed (30 tokens counting EOS);
- HF: `generate(min_new_tokens=30, max_new_tokens=30, num_beams=4 or 1, do_sample=False)`;
- CTranslate2: `translate_batch(min_decoding_length=30, max_decoding_length=30, beam_size=4 or 1)`, built from
  our model by transformer/interop/ct2_export.py (`ctranslate2_spec`, CTranslate2's own spec API; float32 on disk, int8 is
  CTranslate2's quantisation at load time).
The length penalty is the plain |Y|^1.0 (`lenpen_style="power"`) everywhere. Generated tokens/s =
100 × 30 / seconds. The weights are random and the same in every engine (transformer/interop/marian.py exports ours to Marian and
CTranslate2); the work per token is what is measured, not the output. Threads are matched:
`torch.set_num_threads(n)` for ours and Marian, `intra_threads=n, inter_threads=1` for CTranslate2.
bf16 ("fast mode") is our model's weights cast to bfloat16, compared with CTranslate2's int8; ours int8 is
`decode.precision=int8` (kernels.int8_weights: per-channel int8 linear maps), on CPUs with torch's int8 kernels.

On CUDA (chosen automatically) the engines run on the GPU instead: ours fp32 and bf16, Marian fp32 and bf16,
CTranslate2 float32, bfloat16 and int8_bfloat16 where its wheel sees the GPU.
"""

from __future__ import annotations

import _common as common
import copy
import tempfile
import time
from pathlib import Path

import torch

from _common import (alternate, describe, load_average, load_remark, machine, marian_model, median,
                     model_configs, ours_model, print_profile, random_tokens, table, versions, write_section)
from transformer.interop import ct2_export
from transformer import kernels
from transformer.model import TransformerConfig
from transformer.search import beam_search, greedy_search

HEADING_CPU = "## Decoding"
HEADING_GPU = "## GPU: decoding"
SENTENCES, SRC_LEN, OUT_LEN = 100, 25, 30


def token_names(size: int) -> list[str]:
    """Token strings for CTranslate2 (it takes tokens, not ids) of a random model: "t<id>"."""
    return [f"t{i}" for i in range(size)]


class Engines:
    def __init__(self, config: TransformerConfig, *, device: torch.device, threads: int, workdir: Path,
                 with_ct2: bool):
        self.device = device
        self.ours = ours_model(config, device).eval()
        self.ours_bf16 = copy.deepcopy(self.ours).to(torch.bfloat16)
        self.marian = marian_model(config, device).eval()
        self.marian_bf16 = copy.deepcopy(self.marian).to(torch.bfloat16) if device.type == "cuda" else None
        self.src = random_tokens(SENTENCES, SRC_LEN, config.vocab_size, seed=3, device=device)
        self.src[:, -1] = config.eos_id
        self.src_mask = torch.ones_like(self.src)
        self.ct2 = {}
        self.ct2_tokens = None
        if with_ct2:
            import ctranslate2

            ct2_dir = workdir / "ct2"
            tokens = token_names(config.vocab_size)
            ct2_export.save_ctranslate2(ct2_export.ctranslate2_spec(self.ours.cpu(), tokens, tokens), ct2_dir)
            self.ours.to(device)
            names = {"float32": "float32", "int8": "int8"}
            if device.type == "cuda":
                names = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8_bfloat16"}
            for label, compute_type in names.items():
                self.ct2[label] = ctranslate2.Translator(str(ct2_dir), device=device.type,
                                                         compute_type=compute_type, inter_threads=1,
                                                         intra_threads=threads)
            self.ct2_tokens = [[tokens[i] for i in row[:-1]] for row in self.src.tolist()]  # CT2 appends the EOS

    def ours_fn(self, model, beam: int):
        options = dict(min_len=OUT_LEN - 1, max_len_a=0, max_len_b=OUT_LEN - 1, lenpen=1.0, lenpen_style="power")
        if beam == 1:
            return lambda: greedy_search(model, self.src, **options)
        return lambda: beam_search(model, self.src, beam=beam, **options)

    def ours_int8_fn(self, beam: int):
        """Ours with int8 linear maps (decode.precision=int8), on CPU where torch has the kernels."""
        search = self.ours_fn(self.ours, beam)

        def run():
            with kernels.int8_weights():
                return search()
        return run

    def marian_fn(self, model, beam: int):
        def run():
            with torch.inference_mode():
                return model.generate(input_ids=self.src, attention_mask=self.src_mask, num_beams=beam,
                                      do_sample=False, min_new_tokens=OUT_LEN, max_new_tokens=OUT_LEN,
                                      length_penalty=1.0)
        return run

    def ct2_fn(self, translator, beam: int):
        return lambda: translator.translate_batch(self.ct2_tokens, beam_size=beam, min_decoding_length=OUT_LEN,
                                                  max_decoding_length=OUT_LEN, length_penalty=1.0,
                                                  max_batch_size=0)

    def all(self, beam: int) -> dict:
        engines = {"ours fp32": self.ours_fn(self.ours, beam), "ours bf16": self.ours_fn(self.ours_bf16, beam)}
        if self.device.type == "cpu" and not kernels.why_no_int8():
            engines["ours int8"] = self.ours_int8_fn(beam)
        engines["Marian generate fp32"] = self.marian_fn(self.marian, beam)
        if self.marian_bf16 is not None:
            engines["Marian generate bf16"] = self.marian_fn(self.marian_bf16, beam)
        for label, translator in self.ct2.items():
            engines[f"CTranslate2 {label}"] = self.ct2_fn(translator, beam)
        return engines

    def check_lengths(self, beam: int) -> dict[str, int]:
        """Generated tokens per sentence of each engine (EOS counted where it is emitted): all must be 30."""
        lengths = {}
        for name, fn in self.all(beam).items():
            out = fn()
            if name.startswith("ours"):
                lengths[name] = max(len(h[0].tokens) + 1 for h in out)  # + the EOS
            elif name.startswith("Marian"):
                lengths[name] = out.shape[1] - 1  # minus the decoder start token
            else:
                lengths[name] = max(len(r.hypotheses[0]) for r in out)
        return lengths


TARGETS = {("beam 4", "ours fp32", "Marian generate fp32"): 2.0, ("beam 4", "ours fp32", "CTranslate2 float32"): 1.0,
           ("greedy", "ours fp32", "Marian generate fp32"): 1.2, ("greedy", "ours fp32", "CTranslate2 float32"): 1.0,
           ("beam 4", "ours bf16", "CTranslate2 int8"): 1.0, ("greedy", "ours bf16", "CTranslate2 int8"): 1.0,
           ("beam 4", "ours int8", "CTranslate2 int8"): 0.8, ("greedy", "ours int8", "CTranslate2 int8"): 0.8}


def run(args, device: torch.device) -> str:
    threads = torch.get_num_threads()
    names = ["small"] if args.quick else ["small", "base"]
    if device.type == "cuda":
        names = ["base"] if args.quick else ["base", "big"]
    configs = model_configs()
    try:
        import ctranslate2
        with_ct2 = device.type == "cpu" or ctranslate2.get_cuda_device_count() > 0
    except ImportError:
        with_ct2 = False
    load_before = load_average()
    rows, speed_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            engines = Engines(configs[name], device=device, threads=threads, workdir=Path(tmp) / name,
                              with_ct2=with_ct2)
            for beam, mode in ((4, "beam 4"), (1, "greedy")):
                lengths = engines.check_lengths(beam)
                if set(lengths.values()) != {OUT_LEN}:
                    raise RuntimeError(f"engines generated different lengths: {lengths}")
                times = alternate(engines.all(beam), device=device, warmup=args.warmup, repeats=args.repeats)
                tps = {engine: SENTENCES * OUT_LEN / median(t) for engine, t in times.items()}
                speed_rows.append([name, mode] + [f"{tps[e]:,.0f}" for e in tps])
                header_engines = list(tps)
                for (t_mode, ours, peer), target in TARGETS.items():
                    if t_mode != mode or peer not in tps or device.type != "cpu":
                        continue
                    ratio = tps[ours] / tps[peer]
                    rows.append([name, mode, ours, peer, f"{ratio:.2f}×",
                                 f"≥ {target}×" if name == "base" else "",
                                 ("met" if ratio >= target else "missed") if name == "base" else ""])
                print(f"{name} {mode}: " + ", ".join(f"{e} {v:,.0f} tok/s" for e, v in tps.items())
                      + f"  (load {load_average():.1f})", flush=True)
            del engines
    load_after = load_average()
    command = common.command_line("decode.py")
    heading = args.heading or (HEADING_GPU if device.type == "cuda" else HEADING_CPU)
    lines = [
        heading, "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine(device)}; "
        f"{load_remark(load_before, load_after)}. {versions('transformers', 'ctranslate2')}. "
        f"Command: `{command}` ({args.warmup} warm-up + {args.repeats} timed runs per engine, in turns, "
        f"medians). {SENTENCES} sentences × {SRC_LEN} source tokens in one batch, exactly {OUT_LEN} generated "
        f"tokens each; CTranslate2 with inter_threads=1, intra_threads={threads}. Models: small = "
        f"{describe(configs['small'])}; base = {describe(configs['base'])}"
        + (f"; big = {describe(configs['big'])}" if device.type == "cuda" else "") + ".", "",
        "Generated tokens/s:", "",
        table(["model", "search"] + header_engines, speed_rows),
    ]
    if rows:
        lines += ["", "Ratios (targets apply to base):", "",
                  table(["model", "search", "ours", "against", "ratio", "target", ""], rows)]
    return "\n".join(lines) + "\n"


def profile(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        engines = Engines(model_configs()[args.profile], device=device, threads=torch.get_num_threads(),
                          workdir=Path(tmp), with_ct2=False)
        beam = 4 if args.mode == "beam" else 1
        for label, fn in (("ours fp32", engines.ours_fn(engines.ours, beam)),
                          ("ours bf16", engines.ours_fn(engines.ours_bf16, beam)),
                          ("Marian generate fp32", engines.marian_fn(engines.marian, beam))):
            print_profile(f"{label}, {args.profile}, {args.mode}", fn, args.rows)


def main() -> None:
    parser = common.parser(__doc__, repeats_what="runs")
    parser.add_argument("--mode", choices=["beam", "greedy"], default="beam")
    args = common.parse(parser)
    if args.profile:
        profile(args)
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    section = run(args, device)
    print(section)
    if args.write:
        write_section(args.write, args.heading or (HEADING_GPU if device.type == "cuda" else HEADING_CPU), section)


if __name__ == "__main__":
    main()
