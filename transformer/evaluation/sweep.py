"""Which checkpoint? Every kept checkpoint of a run, and every average of its last k, decoded and scored.

    python evaluate.py checkpoint=<run_dir> src=dev.en ref=dev.de checkpoints=all
    python evaluate.py checkpoint=<run_dir> testset=wmt13 checkpoints=all

The candidates, in this order: each numbered checkpoint (step-*.pt, oldest first), best.pt, averaged.pt,
then the average of the last k numbered checkpoints for k = 1 … N (the paper averaged the last 5 for base
models and the last 20 for big ones; k = 1 is the newest checkpoint itself). Each is decoded with the
same settings and scored as a single evaluation would be (`Translator.translate`, `sacrebleu_scores`), so
a row equals `evaluate.py checkpoint=<that .pt>`; the averages are made in memory with
`checkpoint.average`, exactly as `python -m transformer.checkpoint average` would write them.

Only the numbered checkpoints still on disk are seen: training deletes all but the newest
`train.keep_last` (default 10). A run meant to be swept keeps what it wants compared (e.g.
`train.keep_last=0`, keep all; a checkpoint of the base model is ~0.7 GB with its Adam moments).

Decodes are cached in run_dir/eval/cache/, keyed by the model's content (a SHA-256 of its weights, config
and vocabulary), the decode settings, the device type and the source text: a second sweep decodes
nothing, and identical models (k = 1 and the newest checkpoint, averaged.pt and the window it averages,
best.pt and the numbered checkpoint it copies) are decoded once. Delete the folder to start afresh.

Outputs (in `out`, default run_dir/eval/<test set>/): checkpoints.md (the table, also on stdout),
checkpoints.json, and checkpoints.png (BLEU against the update, and BLEU against the window k).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data.files import atomic_write
from transformer import checkpoint as ckpt
from transformer.config import ConfigError, DecodeConfig
from transformer.evaluation.scoring import sacrebleu_scores
from transformer.decoding.translation import Translator

log = logging.getLogger(__name__)

__all__ = ["Candidate", "Row", "sweep_run_dir", "candidates", "model_digest", "DecodeCache", "sweep_checkpoints"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One model to score: a checkpoint file, or the average of the last `window` numbered checkpoints."""

    label: str  # step-00001500.pt | best.pt | averaged.pt | last 3
    kind: str  # numbered | best | averaged | window
    paths: tuple[Path, ...]  # the file, or the numbered files a window averages (oldest first)
    window: int | None = None  # k of a last-k average


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the table: a candidate's update, the updates it averages, its scores."""

    label: str
    kind: str
    step: int | None
    averaged_steps: list[int] | None
    window: int | None
    bleu: float
    chrf: float
    tokbleu: float
    digest: str  # the model's content hash (rows with the same digest are the same model)
    cached: bool  # its translation came from the cache (or from an identical model earlier in this sweep)


def sweep_run_dir(checkpoint) -> Path:
    """The run directory `checkpoint=` names, or a one-line error: the sweep needs a run, not a file."""
    if checkpoint is None or isinstance(checkpoint, (list, tuple)) or Path(str(checkpoint)).is_file():
        raise ConfigError(f"checkpoints=all scores every checkpoint of a run, but checkpoint={checkpoint} is not a "
                          "run directory: give checkpoint=<run_dir>")
    path = Path(str(checkpoint))
    if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
        path = path.parent
    if not ckpt.checkpoint_dir(path).is_dir():
        raise ConfigError(f"checkpoints=all: {path} has no checkpoints/ folder; give checkpoint=<run_dir> of a run "
                          "that has trained")
    if not ckpt.list_numbered(path):
        raise ConfigError(f"checkpoints=all: no numbered checkpoints (step-*.pt) in {ckpt.checkpoint_dir(path)}: "
                          "train with train.save_every_steps, and train.keep_last large enough to keep them")
    return path


def candidates(run_dir: Path) -> list[Candidate]:
    """Every numbered checkpoint, best.pt, averaged.pt (those that exist), and the last-k windows; the run
    has numbered checkpoints (`sweep_run_dir`)."""
    numbered = ckpt.list_numbered(run_dir)
    found = [Candidate(label=path.name, kind="numbered", paths=(path,)) for _, path in numbered]
    for kind, path in (("best", ckpt.best_path(run_dir)), ("averaged", ckpt.averaged_path(run_dir))):
        if path.is_file():
            found.append(Candidate(label=path.name, kind=kind, paths=(path,)))
    paths = [path for _, path in numbered]
    for k in range(1, len(paths) + 1):
        found.append(Candidate(label=f"last {k}", kind="window", paths=tuple(paths[-k:]), window=k))
    return found


def model_digest(state: dict) -> str:
    """SHA-256 of what decides a loaded checkpoint's translations: its weights (names, dtypes, shapes,
    bytes), model config and vocabulary. Not the optimizer state or the step, so copies of one model
    (best.pt of a numbered checkpoint, an average of one checkpoint) share a digest."""
    digest = hashlib.sha256()
    digest.update(json.dumps(state.get("model_config"), sort_keys=True).encode())
    spm = state.get("spm_model")
    if isinstance(spm, torch.Tensor):
        digest.update(spm.contiguous().numpy().tobytes())
    for name in sorted(state["model"]):
        tensor = state["model"][name]
        if not isinstance(tensor, torch.Tensor):
            digest.update(f"{name}={tensor!r}\n".encode())
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _sha256(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode("utf-8")).hexdigest()


class DecodeCache:
    """Translations by (model digest, decode settings, device type, source text), one JSON file each under
    `directory`, written atomically; also which digest the average of which digests has, so that a rerun
    need not average again."""

    def __init__(self, directory: Path, *, decode: DecodeConfig, device: torch.device, sources: list[str]):
        self.directory = directory
        self.settings = json.dumps({"decode": asdict(decode), "device": torch.device(device).type}, sort_keys=True)
        self.source_digest = _sha256(*sources)

    def _read(self, name: str) -> dict | None:
        path = self.directory / f"{name}.json"
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # absent, or unreadable: decode again
            return None

    def _write(self, name: str, value: dict) -> None:
        atomic_write(self.directory / f"{name}.json", json.dumps(value) + "\n", what="decode cache entry")

    def translation_key(self, digest: str) -> str:
        return _sha256("translation", digest, self.settings, self.source_digest)

    def translation(self, digest: str, lines: int) -> list[str] | None:
        entry = self._read(self.translation_key(digest))
        hypotheses = entry.get("hypotheses") if isinstance(entry, dict) else None
        return hypotheses if isinstance(hypotheses, list) and len(hypotheses) == lines else None

    def store_translation(self, digest: str, hypotheses: list[str], label: str) -> None:
        self._write(self.translation_key(digest), {"model": digest, "label": label, "settings": self.settings,
                                                   "hypotheses": hypotheses})

    def average_digest(self, digests: list[str]) -> str | None:
        entry = self._read(_sha256("average", *digests))
        return entry.get("digest") if isinstance(entry, dict) else None

    def store_average_digest(self, digests: list[str], digest: str) -> None:
        self._write(_sha256("average", *digests), {"inputs": digests, "digest": digest})


def sweep_checkpoints(checkpoint, *, sources: list[str], references: list[str], set_name: str, lang: str,
                      decode: DecodeConfig, device: torch.device, out: Path | None) -> int:
    """Score every candidate of the run `checkpoint` names; print and write the table, the plot, the best
    window. evaluate.py's `checkpoints=all`."""
    run_dir = sweep_run_dir(checkpoint)
    cache = DecodeCache(run_dir / "eval" / "cache", decode=decode, device=device, sources=sources)
    found = candidates(run_dir)
    file_digests: dict[Path, tuple[str, int | None]] = {}  # path -> (digest, step)
    scored: dict[str, tuple[float, float, float]] = {}  # digest -> scores, each model scored once
    rows, decoded = [], 0
    for candidate in found:
        state = None
        if candidate.kind == "window":
            inputs = [_file_digest(path, file_digests)[0] for path in candidate.paths]
            digest = cache.average_digest(inputs)
            steps = [file_digests[path][1] for path in candidate.paths]
            if digest is None:
                state = ckpt.average(list(candidate.paths))
                digest = model_digest(state)
                cache.store_average_digest(inputs, digest)
            step, averaged_steps = max(steps), steps
        else:
            digest, step = _file_digest(candidate.paths[0], file_digests)
            averaged_steps = _averaged_steps(candidate.paths[0]) if candidate.kind == "averaged" else None
        hypotheses = cache.translation(digest, len(sources))
        cached = hypotheses is not None
        if hypotheses is None:
            if candidate.kind != "window":
                translator = Translator.load(str(candidate.paths[0]), device, decode=decode)
            else:
                state = state if state is not None else ckpt.average(list(candidate.paths))
                translator = Translator.from_state(state, device, name=f"the average of the {candidate.label}",
                                                   decode=decode)
            log.info("decoding %d lines with %s", len(sources), candidate.label)
            hypotheses = translator.translate(sources, progress=True, source=set_name)
            del translator, state
            decoded += 1
            cache.store_translation(digest, hypotheses, candidate.label)
        if digest not in scored:
            by_name = {s.name: s.score for s in sacrebleu_scores(hypotheses, references, lang=lang)}
            scored[digest] = (by_name["BLEU"], by_name["chrF2"], by_name["tokBLEU"])
        bleu, chrf, tokbleu = scored[digest]
        rows.append(Row(label=candidate.label, kind=candidate.kind, step=step, averaged_steps=averaged_steps,
                        window=candidate.window, bleu=bleu, chrf=chrf, tokbleu=tokbleu, digest=digest,
                        cached=cached))
    report = _report(rows, run_dir, set_name, decode_count=decoded)
    print(report, end="", flush=True)
    out = out if out is not None else run_dir / "eval" / set_name
    atomic_write(out / "checkpoints.md", report)
    atomic_write(out / "checkpoints.json", json.dumps(
        {"testset": set_name, "lang": lang, "lines": len(sources), "decode": asdict(decode),
         "keep_last": _keep_last(run_dir), "decoded": decoded, "best_window": _best_window(rows).window,
         "rows": [asdict(row) for row in rows]}, indent=2) + "\n")
    _plot(rows, out / "checkpoints.png", title=f"{run_dir.name} on {set_name}")
    log.info("decoded with %d of %d models (the others were cached); wrote %s", decoded, len(rows),
             out / "checkpoints.md")
    return 0


def _file_digest(path: Path, memo: dict) -> tuple[str, int | None]:
    """(model digest, step) of a checkpoint file, memory-mapped: only its weights are read."""
    if path not in memo:
        state = ckpt.load(path, mmap=True)
        memo[path] = (model_digest(state), state.get("step"))
    return memo[path]


def _averaged_steps(path: Path) -> list[int] | None:
    steps = ckpt.load(path, mmap=True).get("averaged_steps")
    return list(steps) if isinstance(steps, (list, tuple)) else None


def _keep_last(run_dir: Path) -> int | None:
    """train.keep_last of the run, from the config its newest numbered checkpoint records."""
    numbered = ckpt.list_numbered(run_dir)
    config = ckpt.load(numbered[-1][1], mmap=True).get("config") or {}
    value = (config.get("train") or {}).get("keep_last")
    return value if isinstance(value, int) else None


def _best_window(rows: list[Row]) -> Row:
    """The last-k average with the highest BLEU; on a tie the smaller k."""
    windows = [row for row in rows if row.kind == "window"]
    return max(windows, key=lambda row: (row.bleu, -row.window))


def _steps(steps: list[int] | None) -> str:
    if not steps:
        return "–"
    return f"{min(steps)}–{max(steps)} ({len(steps)})" if len(steps) > 1 else str(steps[0])


def _report(rows: list[Row], run_dir: Path, set_name: str, *, decode_count: int) -> str:
    """The Markdown table, the best window, and what the sweep could not see."""
    lines = ["| Checkpoint | Update | Averages updates | BLEU | chrF2 | tokBLEU |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row.label} | {row.step if row.step is not None else '–'} | {_steps(row.averaged_steps)} "
                     f"| {row.bleu:.2f} | {row.chrf:.2f} | {row.tokbleu:.2f} |")
    best = _best_window(rows)
    numbered = [row for row in rows if row.kind == "numbered"]
    keep_last = _keep_last(run_dir)
    kept = "all kept" if keep_last == 0 else f"train.keep_last={keep_last}" if keep_last else "train.keep_last"
    lines += ["", f"Best averaging window: the last {best.window} checkpoint{'s' if best.window > 1 else ''} "
                  f"(updates {min(best.averaged_steps)}–{max(best.averaged_steps)}): BLEU {best.bleu:.2f} on {set_name}.",
              f"Seen: the {len(numbered)} numbered checkpoints in {ckpt.checkpoint_dir(run_dir)} (updates "
              f"{numbered[0].step}–{numbered[-1].step}; {kept}): training deletes older ones, so for a run meant "
              "to be swept set train.keep_last to the number of checkpoints to compare (0 keeps all).",
              f"Decoded {decode_count} of {len(rows)} rows now; the others came from {run_dir / 'eval' / 'cache'} or "
              "from an identical model above."]
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: Path, *, title: str) -> None:
    """checkpoints.png: BLEU of each numbered checkpoint (and best.pt, averaged.pt) against its update, and of
    each last-k average against k."""
    from matplotlib.figure import Figure  # here: only the sweep draws. A bare Figure renders with Agg, no GUI.

    figure = Figure(figsize=(11, 4), layout="constrained")
    by_update, by_window = figure.subplots(1, 2)
    numbered = [row for row in rows if row.kind == "numbered"]
    by_update.plot([r.step for r in numbered], [r.bleu for r in numbered], "o-", markersize=3 if len(numbered) > 40 else 6,
                   label="numbered checkpoints")
    for kind, marker in (("best", "*"), ("averaged", "s")):
        for row in (r for r in rows if r.kind == kind and r.step is not None):
            by_update.plot([row.step], [row.bleu], marker, markersize=11, label=row.label)
    by_update.set(title="BLEU by update", xlabel="update (training step)", ylabel="BLEU (sacreBLEU)")
    by_update.legend()
    by_update.grid(alpha=0.3)
    windows = [row for row in rows if row.kind == "window"]
    by_window.plot([r.window for r in windows], [r.bleu for r in windows], "o-", color="tab:green")
    best = _best_window(rows)
    by_window.plot([best.window], [best.bleu], "*", markersize=14, color="tab:red", label=f"best: last {best.window}")
    by_window.set(title="BLEU of the average of the last k checkpoints", xlabel="k (checkpoints averaged)",
                  ylabel="BLEU (sacreBLEU)")
    by_window.xaxis.get_major_locator().set_params(integer=True)
    by_window.legend()
    by_window.grid(alpha=0.3)
    figure.suptitle(title)
    atomic_write(path, lambda f: figure.savefig(f, format="png", dpi=100), what="figure")
