"""The GPU check: one command to run where a GPU is lent (about 6 minutes on one H100, by design).

    python benchmarks/gpu_check.py                     # on the GPU; writes the figures into docs/BENCHMARKS.md
    python benchmarks/gpu_check.py --smoke             # the same code on the CPU with a tiny model (~1 min)
    python benchmarks/gpu_check.py --out DIR           # also DIR/gpu_check.json and DIR/gpu_check.md
    python benchmarks/gpu_check.py --write FILE        # the section goes into FILE instead of docs/BENCHMARKS.md
    python benchmarks/gpu_check.py --no-tests          # without step 1 (tools/gpu_node/run.sh has run them)

Steps, each timed and reported even when another fails:
1. the CUDA-only tests (`pytest -m cuda`; on the CPU collected only, all skipped);
2. train.py's own update: `transformer.training.update.train_step` on a `Run` that `build_run` makes from the
   composed config (`model=base`, train.py's defaults: the planner's passes from train.tokens_per_update and
   train.max_tokens, train.precision=auto, fused Adam, the Noam schedule, the prefetching data path), on a
   synthetic corpus shaped like WMT14 EN-DE after its 37k-piece vocabulary (random pieces, lengths around 27
   per side). Timed: the paper's max_tokens (4096: 7 passes an update on one GPU) and a GPU-sized one (2
   passes), the latter with train.compile off and on. Reported: target tokens/s and source + target tokens/s,
   MFU against the datasheet bf16 dense peak of the detected GPU (`DATASHEET_BF16_TFLOPS`) and against the bf16
   matmul peak measured in the same run, peak memory, the first update's time (compilation, with compile on);
   then the loss of update 50 in bf16 and in fp32 from the same start on the same batches (goal: within 1 %);
3. beam-4 decoding of the base model: ours in fp32 and bf16, and CTranslate2 on the same weights (exported by
   transformer/interop/ct2_export.py) where `ctranslate2` is importable.
Expected on one H100 (an estimate until the check has run there): CUDA tests < 1 min, matmul peak 5 s, the
three timed setups 20-40 s each eager and 1-3 min of compilation, the two 50-update runs 30 s, decoding 30 s:
about 6 minutes. `--smoke` runs every step on the CPU with a 2-layer d_model 32 model (compile with
dynamo's eager backend: inductor takes minutes on a CPU) and a few repeats, so CI proves the script runs; its figures mean
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

import _common as common
from _common import describe, machine, matmul_peak, median, table, versions, write_section
from data.batching import TokenArrays
from data.pipeline import Prepared, Split
from data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from train_step import step_flops
from transformer import distributed
from transformer.cli import compose_config, to_job
from transformer.model import Transformer, TransformerConfig
from transformer.search import beam_search
from transformer.training import run as run_module
from transformer.training.run import build_run, compile_for_batches
from transformer.training.run_record import Window
from transformer.training.start import Start
from transformer.training.update import StepOutcome, train_step

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## GPU check"

# bf16 dense Tensor Core peaks in TFLOP/s, from NVIDIA's datasheets (the "with sparsity" figures halved):
# H100 Tensor Core GPU datasheet (SXM 1,979 / NVL 1,671 / PCIe 1,513 sparse), H200 datasheet (SXM 1,979 /
# NVL 1,671 sparse), A100 datasheet (312 dense, SXM and PCIe alike). First match of the device name wins.
DATASHEET_BF16_TFLOPS = (
    (("H100", "PCIe"), "H100 PCIe", 756.0),
    (("H100", "NVL"), "H100 NVL", 835.0),
    (("H100",), "H100 SXM", 989.0),
    (("H200", "NVL"), "H200 NVL", 835.0),
    (("H200",), "H200 SXM", 989.0),
    (("A100",), "A100", 312.0),
)
LOSS_UPDATES = 50  # the bf16-vs-fp32 comparison: the loss of this update


def datasheet_peak(device: torch.device) -> tuple[str, float] | None:
    """(datasheet name, bf16 dense FLOP/s) of the GPU, or None (a CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for words, label, tflops in DATASHEET_BF16_TFLOPS:
        if all(word.lower() in name.lower() for word in words):
            return label, tflops * 1e12
    return None


def sizes(smoke: bool) -> dict:
    """The model, the corpus and the repeats. Full: base; the update is train.tokens_per_update (25k)."""
    if smoke:
        return {"model": ["model.d_model=32", "model.heads=2", "model.d_ff=64", "model.encoder_layers=2",
                          "model.decoder_layers=2"], "vocab": 500, "pairs": 2000, "mean_length": 12,
                "tokens_per_update": 1200, "setups": {"paper max_tokens": 600, "GPU-sized": 1200},
                "warmup": 1, "repeats": 2, "loss_updates": 3, "decode": (8, 12, 10), "decode_repeats": 2}
    return {"model": [], "vocab": 37000, "pairs": 60_000, "mean_length": 27, "tokens_per_update": 25_000,
            "setups": {"paper max_tokens": 4096, "GPU-sized": 12_500}, "warmup": 3, "repeats": 20,
            "loss_updates": LOSS_UPDATES, "decode": (100, 25, 30), "decode_repeats": 10}


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
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=420)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"command": " ".join(command[2:]), "status": result.returncode, "summary": summary,
            "ok": result.returncode == 0, "tail": (result.stdout + result.stderr)[-2000:] if result.returncode else ""}


# ------------------------------------------------------------------------------- train.py's own update


@dataclasses.dataclass(frozen=True)
class SyntheticVocab:
    """What a run reads of its vocabulary (data.vocab.Vocab) for a corpus of random piece ids."""

    size: int
    model_proto: bytes = b""
    sha256: str = "0" * 64

    def token_config(self) -> dict[str, int | None]:
        return {"vocab_size": self.size, "target_vocab_size": None, "pad_id": PAD_ID, "unk_id": UNK_ID,
                "bos_id": BOS_ID, "eos_id": EOS_ID}


def synthetic_corpus(*, vocab: int, pairs: int, mean_length: int, seed: int = 0) -> Prepared:
    """Pairs shaped like WMT14 EN-DE in pieces: log-normal source lengths (median `mean_length`, a long tail
    to 4 ×), targets 10 % longer with their own spread; random ordinary pieces. In memory, where train.py's
    data path (BatchStream, Prefetcher, collate) reads a prepared cache."""
    rng = np.random.default_rng(seed)
    cap = 4 * mean_length
    src_len = np.clip(rng.lognormal(np.log(mean_length), 0.5, pairs), 1, cap).astype(np.int64)
    tgt_len = np.clip(src_len * rng.lognormal(np.log(1.1), 0.15, pairs), 1, cap).astype(np.int64)

    def flat(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return rng.integers(EOS_ID + 1, vocab, int(offsets[-1]), dtype=np.int32), offsets

    (src, src_offsets), (tgt, tgt_offsets) = flat(src_len), flat(tgt_len)
    train = Split(dataset=None, src_lengths=src_len, tgt_lengths=tgt_len, report=None,
                  cache_entry=Path("synthetic-wmt-shaped"),
                  tokens=TokenArrays(src=src, src_offsets=src_offsets, tgt=tgt, tgt_offsets=tgt_offsets))
    return Prepared(vocab=SyntheticVocab(vocab), vocab_path=Path("synthetic"), splits={"train": train})


def make_run(s: dict, data: Prepared, device: torch.device, run_dir: Path, *, max_tokens: int, precision: str,
             compile: bool, smoke: bool):
    """The Run train.py would build with these overrides (transformer/training/run.py `build_run`)."""
    overrides = [f"run_dir={run_dir}", f"device={device.type}", "seed=1", *s["model"],
                 f"train.tokens_per_update={s['tokens_per_update']}", f"train.max_tokens={max_tokens}",
                 f"train.precision={precision}", f"train.compile={str(compile).lower()}", "train.test_at_end=false"]
    job = to_job(compose_config(overrides))
    dist = distributed.DistInfo(rank=0, world_size=1, local_rank=0)
    original = run_module.compile_for_batches
    if smoke:  # inductor (and AOTAutograd) take minutes on a CPU: dynamo alone is the code path
        run_module.compile_for_batches = lambda module: compile_for_batches(module, backend="eager")
    try:
        return build_run(job, dist=dist, device=device, run_dir=run_dir, start=Start(), data=data,
                         started=time.monotonic())
    finally:
        run_module.compile_for_batches = original


class Updates:
    """Runs train_step, as train.py's loop does, and records each update's seconds, tokens and loss."""

    def __init__(self, run, device: torch.device):
        self.run, self.device, self.window = run, device, Window(device)
        self.stop = types.SimpleNamespace(requested=False)  # train.py's StopRequest, without signal handlers
        self.records: list[dict] = []
        prefetcher, self.counted = run.batches, None
        next_update = prefetcher.next_update

        def counting(stream):  # the update's batches as train_step receives them
            batches = next_update(stream)
            self.counted = [(b.src.shape[0], b.src_tokens, b.tgt_tokens) for _, b in batches]
            return batches
        prefetcher.next_update = counting

    def one(self) -> dict:
        self.window.sums.zero_()
        common.sync(self.device)
        start = time.perf_counter()
        outcome = train_step(self.run, self.window, self.stop)
        common.sync(self.device)
        seconds = time.perf_counter() - start
        if outcome is not StepOutcome.UPDATE:
            raise RuntimeError(f"train_step returned {outcome}")
        loss, _, tokens = self.window.sums.tolist()
        record = {"seconds": seconds, "passes": len(self.counted), "loss": loss / tokens,
                  "src_tokens": sum(c[1] for c in self.counted), "tgt_tokens": sum(c[2] for c in self.counted),
                  "flops": sum(step_flops(self.run.model.config, b, src / b, tgt / b) for b, src, tgt in self.counted)}
        self.records.append(record)
        return record


@contextlib.contextmanager
def tf32_kept():
    """The TF32 flags as they were before, after: `build_run` sets them for its precision (train.precision=fp32:
    off), and the decoding that follows runs as translate.py does, with the device rule's TF32."""
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


@tf32_kept()
def check_training(device: torch.device, smoke: bool, workdir: Path, progress=lambda partial: None) -> dict:
    """The training rows and the bf16-against-fp32 loss; `progress` gets what is measured after each row (a time
    cap during the next one keeps them)."""
    s = sizes(smoke)
    data = synthetic_corpus(vocab=s["vocab"], pairs=s["pairs"], mean_length=s["mean_length"])
    measured = matmul_peak(device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                           n=512 if smoke else None, repeats=3 if smoke else 7)
    sheet = datasheet_peak(device)
    rows = []
    result = {"rows": rows, "matmul_peak_tflops": measured / 1e12,
              "datasheet": None if sheet is None else {"gpu": sheet[0], "bf16_tflops": sheet[1] / 1e12},
              "loss": None, "vocab": s["vocab"], "tokens_per_update": s["tokens_per_update"]}
    runs = [(label, max_tokens, False) for label, max_tokens in s["setups"].items()]
    runs.append((list(s["setups"])[-1], list(s["setups"].values())[-1], True))
    for label, max_tokens, compiled in runs:
        gc.collect()  # the last row's run and its Updates hold each other (next_update's closure): free them first
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        run = make_run(s, data, device, workdir / f"{label}-{compiled}".replace(" ", "-"), max_tokens=max_tokens,
                       precision="auto", compile=compiled, smoke=smoke)
        precision = "bf16" if isinstance(run.autocast, torch.autocast) else "fp32"
        updates = Updates(run, device)
        first = updates.one()["seconds"]  # with compile on: the compilation
        for _ in range(s["warmup"]):
            updates.one()
        timed_records = [updates.one() for _ in range(s["repeats"])]
        seconds = sum(r["seconds"] for r in timed_records)
        tgt = sum(r["tgt_tokens"] for r in timed_records)
        src = sum(r["src_tokens"] for r in timed_records)
        flops = sum(r["flops"] for r in timed_records)
        rows.append({"setup": label, "compile": compiled, "precision": precision, "max_tokens": max_tokens,
                     "passes": run.state.update_freq, "tgt_tokens_per_update": tgt / len(timed_records),
                     "ms_per_update": 1e3 * median([r["seconds"] for r in timed_records]),
                     "tgt_tokens_per_s": tgt / seconds, "src_tgt_tokens_per_s": (src + tgt) / seconds,
                     "mfu_datasheet": flops / seconds / sheet[1] if sheet else None,
                     "mfu_measured": flops / seconds / measured,
                     "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                     "first_update_s": first})
        r = rows[-1]
        print(f"train {label} (max_tokens {max_tokens}, {r['passes']} passes), compile {compiled}: "
              f"{r['ms_per_update']:.1f} ms/update, {r['tgt_tokens_per_s']:,.0f} tgt tok/s, "
              f"first update {first:.1f} s", flush=True)
        del run, updates
        progress(result)
    loss = {}
    for precision in ("bf16", "fp32"):  # same seed, same start, same batches; eager (on a CPU: bf16 emulated)
        run = make_run(s, data, device, workdir / f"loss-{precision}", max_tokens=list(s["setups"].values())[-1],
                       precision=precision, compile=False, smoke=smoke)
        updates = Updates(run, device)
        for _ in range(s["loss_updates"]):  # fp32: the reference, float32 matmuls (build_run turned TF32 off)
            last = updates.one()
        loss[precision] = last["loss"]
        del run, updates
    relative = abs(loss["bf16"] - loss["fp32"]) / abs(loss["fp32"])
    print(f"loss of update {s['loss_updates']}: bf16 {loss['bf16']:.4f}, fp32 {loss['fp32']:.4f} "
          f"({100 * relative:.2f} %)", flush=True)
    result["loss"] = {"updates": s["loss_updates"], "bf16": loss["bf16"], "fp32": loss["fp32"],
                      "relative_difference": relative, "within_1_percent": relative <= 0.01}
    return result


# ------------------------------------------------------------------------------------------- decoding


def ctranslate2_missing() -> str | None:
    """Why the CTranslate2 row cannot run here, or None."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError as error:
        return f"not run: ctranslate2 is not importable here ({error}; pip install -e '.[bench]')"
    return None


def check_decoding(device: torch.device, smoke: bool, workdir: Path) -> list[dict]:
    s = sizes(smoke)
    sentences, src_len, out_len = s["decode"]
    config = TransformerConfig(**{**SyntheticVocab(s["vocab"]).token_config(), **model_fields(smoke)})
    torch.manual_seed(0)
    model = Transformer(config).to(device).eval()
    generator = torch.Generator().manual_seed(2)
    src = torch.randint(EOS_ID + 1, config.vocab_size, (sentences, src_len), generator=generator).to(device)
    src[:, -1] = config.eos_id
    options = dict(beam=4, lenpen=1.0, lenpen_style="power", min_len=out_len - 1, max_len_a=0, max_len_b=out_len - 1)
    rows = []
    missing = ctranslate2_missing()
    if missing is None:  # exported before ours turns to bf16: the same fp32 weights
        import ctranslate2

        from transformer.interop import ct2_export

        tokens = [f"t{i}" for i in range(config.vocab_size)]  # CTranslate2 takes token strings, not ids
        ct2_dir = ct2_export.save_ctranslate2(ct2_export.ctranslate2_spec(model.cpu(), tokens, tokens),
                                              workdir / "ct2")
        model.to(device)
        ct2_src = [[tokens[i] for i in row[:-1]] for row in src.tolist()]  # CTranslate2 appends the EOS
    for precision in ("fp32", "bf16"):
        engine = model if precision == "fp32" else model.to(torch.bfloat16)
        seconds = timed(device, lambda: beam_search(engine, src, **options), s["decode_repeats"], warmup=1)
        rows.append({"engine": f"ours {precision}", "tokens_per_s": sentences * out_len / seconds,
                     "seconds": seconds})
        print(f"decode beam 4 ours {precision}: {sentences * out_len / seconds:,.0f} tokens/s", flush=True)
    if missing is not None:
        rows.append({"engine": "CTranslate2", "tokens_per_s": None, "seconds": None, "note": missing})
        return rows
    compute_types = {"fp32": "float32", "bf16": "bfloat16"} if device.type == "cuda" else {"fp32": "float32"}
    for precision, compute_type in compute_types.items():
        translator = ctranslate2.Translator(str(ct2_dir), device=device.type, compute_type=compute_type,
                                            inter_threads=1)
        seconds = timed(device, lambda: translator.translate_batch(
            ct2_src, beam_size=4, min_decoding_length=out_len, max_decoding_length=out_len, length_penalty=1.0,
            max_batch_size=0), s["decode_repeats"], warmup=1)
        rows.append({"engine": f"CTranslate2 {precision}", "tokens_per_s": sentences * out_len / seconds,
                     "seconds": seconds, "note": "transformer/interop/ct2_export.py, the same weights"})
        print(f"decode beam 4 CTranslate2 {precision}: {sentences * out_len / seconds:,.0f} tokens/s", flush=True)
    return rows


def model_fields(smoke: bool) -> dict:
    """The model's architecture fields as the training runs compose them (configs/model/base.yaml + overrides)."""
    job = to_job(compose_config(sizes(smoke)["model"]))
    return dataclasses.asdict(job.model)


# ------------------------------------------------------------------------------------------- the report


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def save_report(report: dict, args: argparse.Namespace, *, seconds: float, final: bool) -> str:
    """gpu_check.json and gpu_check.md in --out, and the section of --write (default on a GPU: BENCHMARKS.md),
    with the steps done so far (`final`: all of them); returns the Markdown."""
    report["seconds"] = seconds
    text = markdown({**report, **{name: report.get(name, {"error": "not yet run", "ok": False})
                                  for name in ("tests", "training", "decoding")}})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(text)
    write = args.write or (None if args.smoke else ROOT / "docs" / "BENCHMARKS.md")
    if write and (final or args.write):
        write_section(write, HEADING, text)
    return text


def markdown(report: dict) -> str:
    tests, train, decode = report["tests"], report["training"], report["decoding"]
    model, (sentences, src_len, out_len) = report["model"], report["decode_work"]
    lines = [HEADING, "",
             f"Measured {report['date']} on {report['machine']}; {report['versions']}. Command: "
             f"`{report['command']}` (total {report['seconds']:.0f} s).", "",
             f"CUDA tests (`{tests.get('command', '')}`): {tests.get('summary', tests.get('error'))}.", ""]
    if isinstance(train, dict) and "rows" in train:
        sheet = train["datasheet"]
        sheet_text = (f"the {sheet['gpu']} datasheet's bf16 dense peak ({sheet['bf16_tflops']:.0f} TFLOP/s)"
                      if sheet else "no datasheet peak (a CPU, or a GPU not in DATASHEET_BF16_TFLOPS): n/a")
        lines += [f"Training: train.py's update (`train_step` on `build_run`'s Run: the planner's passes, "
                  f"train.precision=auto, fused Adam) of {model}, train.tokens_per_update="
                  f"{train['tokens_per_update']:,}, on a synthetic WMT-shaped corpus (vocabulary "
                  f"{train['vocab']:,}). MFU counts the non-pad tokens' FLOPs against {sheet_text} and against "
                  f"the matmul peak measured in the same run ({train['matmul_peak_tflops']:.2f} TFLOP/s):", "",
                  table(["setup", "max_tokens × passes", "compile", "precision", "tgt tokens/update", "ms/update",
                         "tgt tokens/s", "src+tgt tokens/s", "MFU (datasheet)", "MFU (measured peak)",
                         "peak memory", "first update"],
                        [[r["setup"], f"{r['max_tokens']:,} × {r['passes']}", "on" if r["compile"] else "off",
                          r["precision"], f"{r['tgt_tokens_per_update']:,.0f}", f"{r['ms_per_update']:.1f}",
                          f"{r['tgt_tokens_per_s']:,.0f}", f"{r['src_tgt_tokens_per_s']:,.0f}",
                          percent(r["mfu_datasheet"]), percent(r["mfu_measured"]),
                          "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f} GiB",
                          f"{r['first_update_s']:.1f} s"] for r in train["rows"]]), ""]
        loss = train["loss"]
        lines += [f"bf16 against fp32 (TF32 off), the loss of update {loss['updates']} from the same start on the "
                  f"same batches (eager): bf16 {loss['bf16']:.4f}, fp32 {loss['fp32']:.4f}, relative difference "
                  f"{100 * loss['relative_difference']:.2f} % (goal: within 1 %: "
                  f"{'met' if loss['within_1_percent'] else 'not met'}).", ""] if loss else [
                  f"bf16 against fp32: not measured ({train.get('error', 'not reached')}).", ""]
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
    parser.add_argument("--no-tests", action="store_true", help="skip step 1, `pytest -m cuda` (run.sh runs it)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("error: no CUDA device is visible: run with --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    # train.py's device rule: cuda:LOCAL_RANK with TF32 matmuls (transformer/distributed.py)
    device = distributed.pick_device("cpu" if args.smoke else "cuda", training=True)
    started = time.perf_counter()
    config = TransformerConfig(**{**SyntheticVocab(sizes(args.smoke)["vocab"]).token_config(),
                                  **model_fields(args.smoke)})
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(device), "model": describe(config),
              "decode_work": sizes(args.smoke)["decode"], "versions": versions("ctranslate2"),
              "command": "python benchmarks/gpu_check.py" + (" --smoke" if args.smoke else "")}
    def partial(name: str):
        """What a step has measured so far, saved as it comes."""
        def save(figures: dict) -> None:
            report[name] = {**figures, "ok": False, "error": "not finished"}
            save_report(report, args, seconds=time.perf_counter() - started, final=False)
        return save

    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        steps = {"tests": (lambda: {"command": "-m cuda tests", "summary": "not run (--no-tests)", "ok": True})
                 if args.no_tests else (lambda: check_tests(args.smoke)),
                 "training": lambda: check_training(device, args.smoke, Path(workdir), progress=partial("training")),
                 "decoding": lambda: check_decoding(device, args.smoke, Path(workdir))}
        for name, step in steps.items():
            try:
                report[name] = step()
            except Exception as error:  # one failing step must not hide the others' figures (nor its own so far)
                report[name] = {**report.get(name, {}), "ok": False,
                                "error": f"{type(error).__name__}: {error}"[:500]}
                print(f"{name}: failed: {report[name]['error']}", file=sys.stderr, flush=True)
            except KeyboardInterrupt:  # run.sh's time cap (SIGINT): what was measured before still counts
                report[name] = {**report.get(name, {}), "ok": False,
                                "error": "interrupted: the time cap (run.sh's BUDGET_S) ended it"}
                print(f"{name}: interrupted", file=sys.stderr, flush=True)
                break
            finally:  # the figures so far written after every step: a cap or a crash later loses none of them
                save_report(report, args, seconds=time.perf_counter() - started, final=False)
        for name in steps:
            report.setdefault(name, {"error": "not run: the time cap ended an earlier step", "ok": False})
    text = save_report(report, args, seconds=time.perf_counter() - started, final=True)
    print(text)
    failed = [name for name in ("tests", "training", "decoding")
              if isinstance(report[name], dict) and not report[name].get("ok", True)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
