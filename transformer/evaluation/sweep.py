"""Which checkpoint? Every kept checkpoint of a run, and every average of its last k, decoded and scored.

    python evaluate.py checkpoint=<run_dir> src=dev.en ref=dev.de checkpoints=all
    python evaluate.py checkpoint=<run_dir> testset=wmt13 checkpoints=all
    python evaluate.py 'checkpoint=[<run_a>,<run_b>]' src=dev.en ref=dev.de checkpoints=all   # an ensemble

The candidates, in this order: each numbered checkpoint (step-*.pt, oldest first), best.pt, averaged.pt,
then the average of the last k numbered checkpoints for k = 1 … N (the paper averaged the last 5 for base
models and the last 20 for big ones; k = 1 is the newest checkpoint itself). Each is decoded with the
same settings and scored as a single evaluation would be (`Translator.translate`, `steps.score`: with
`tok_ref=`, the Multi30k papers' lcBLEU too, which then picks the best window), so a row equals
`evaluate.py checkpoint=<that .pt>`; the averages are made in memory with `checkpoint.average`, exactly as
`python -m transformer.checkpoint average` would write them.

Several runs (`checkpoint=[<run_a>,<run_b>,...]`, runs that share a vocabulary, e.g. two seeds trained side
by side) are swept as one ensemble: best.pt of each, averaged.pt of each, and for k = 1 … the fewest any run
kept, the average of each run's own last k, the models decoded together (`Translator.from_states`, as
`evaluate.py 'checkpoint=[a.pt,b.pt]'` decodes). Its single numbered checkpoints are not rows: runs that
ended on a time budget did not save at the same updates.

Only the numbered checkpoints still on disk are seen: training deletes all but the newest
`train.keep_last` (default 10). A run meant to be swept keeps what it wants compared (e.g.
`train.keep_last=0`, keep all; a checkpoint of the base model is ~0.7 GB with its Adam moments).

Decodes are cached in run_dir/eval/cache/ (of an ensemble, its first run's), keyed by the model's content (a
SHA-256 of its weights, config and vocabulary), the decode settings, the device type, a multilingual model's
target language and the source text: a second sweep decodes nothing, and identical models (k = 1 and the newest
checkpoint, averaged.pt and the window it averages, best.pt and the numbered checkpoint it copies) are decoded
once. Delete the folder to start afresh.

Outputs (in `out`, default run_dir/eval/<test set>/, of an ensemble run_a/eval/<test set>/ensemble_<run_a>+<run_b>/):
checkpoints.md (the table, also on stdout), checkpoints.json, and checkpoints.png (the score that picks the
window, lcBLEU or BLEU, against the update (one run only) and against the window k).
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
from transformer.evaluation import steps as evaluation
from transformer.evaluation.steps import TestSet
from transformer.decoding.translation import Translator

log = logging.getLogger(__name__)

__all__ = ["Candidate", "Row", "sweep_run_dirs", "candidates", "model_digest", "DecodeCache", "sweep_checkpoints"]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One model to score: a checkpoint file, or the average of the last `window` numbered checkpoints; of an
    ensemble, one of these for each of its runs."""

    label: str  # step-00001500.pt | best.pt | averaged.pt | last 3
    kind: str  # numbered | best | averaged | window
    members: tuple[tuple[Path, ...], ...]  # for each run: the file, or the numbered files its window averages
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
    lcbleu: float | None  # with tok_ref= only
    digest: str  # the model's content hash (rows with the same digest are the same model)
    cached: bool  # its translation came from the cache (or from an identical model earlier in this sweep)
    members: list[dict] | None = None  # of an ensemble: each run's update and averaged updates (step, averaged_steps
    # above are then None)


def sweep_run_dirs(checkpoint) -> list[Path]:
    """The run directories `checkpoint=` names (one, or a list: an ensemble), or a one-line error: the sweep
    needs runs, not files."""
    names = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    if not names or any(name is None or Path(str(name)).is_file() for name in names):
        raise ConfigError(f"checkpoints=all scores every checkpoint of a run, but checkpoint={checkpoint} is not a "
                          "run directory: give checkpoint=<run_dir>, or [<run_dir>,<run_dir>] for an ensemble")
    run_dirs = []
    for name in names:
        path = Path(str(name))
        if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
            path = path.parent
        if not ckpt.checkpoint_dir(path).is_dir():
            raise ConfigError(f"checkpoints=all: {path} has no checkpoints/ folder; give checkpoint=<run_dir> of a "
                              "run that has trained")
        if not ckpt.list_numbered(path):
            raise ConfigError(f"checkpoints=all: no numbered checkpoints (step-*.pt) in {ckpt.checkpoint_dir(path)}: "
                              "train with train.save_every_steps, and train.keep_last large enough to keep them")
        run_dirs.append(path)
    if len(set(map(Path.resolve, run_dirs))) < len(run_dirs):
        raise ConfigError(f"checkpoint={checkpoint} names a run twice: an ensemble's runs must differ")
    return run_dirs


def candidates(run_dirs: list[Path]) -> list[Candidate]:
    """Of one run: every numbered checkpoint, best.pt, averaged.pt (those that exist), and the last-k windows.
    Of several (an ensemble): best.pt and averaged.pt where every run has one, and the windows up to the
    fewest numbered checkpoints any run kept. The runs have numbered checkpoints (`sweep_run_dirs`)."""
    numbered = [[path for _, path in ckpt.list_numbered(run_dir)] for run_dir in run_dirs]
    found = []
    if len(run_dirs) == 1:
        found += [Candidate(label=path.name, kind="numbered", members=((path,),)) for path in numbered[0]]
    for kind, where in (("best", ckpt.best_path), ("averaged", ckpt.averaged_path)):
        paths = [where(run_dir) for run_dir in run_dirs]
        if all(path.is_file() for path in paths):
            found.append(Candidate(label=paths[0].name, kind=kind, members=tuple((path,) for path in paths)))
    for k in range(1, min(map(len, numbered)) + 1):
        found.append(Candidate(label=f"last {k}", kind="window", members=tuple(tuple(paths[-k:]) for paths in numbered),
                               window=k))
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
    """Translations by (model digest, decode settings, device type, target language, source text), one JSON file
    each under `directory`, written atomically; also which digest the average of which digests has, so that a
    rerun need not average again. The target language is a multilingual model's tgt_lang (None for one pair):
    the same model and source decoded into French is not its German translation."""

    def __init__(self, directory: Path, *, decode: DecodeConfig, device: torch.device, sources: list[str],
                 tgt_lang: str | None = None):
        self.directory = directory
        settings = {"decode": asdict(decode), "device": torch.device(device).type}
        if tgt_lang is not None:  # a multilingual model's only: the entries of one-pair runs stay valid
            settings["tgt_lang"] = tgt_lang
        self.settings = json.dumps(settings, sort_keys=True)
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


def sweep_folder(run_dirs: list[Path], test: TestSet) -> Path:
    """Where a sweep writes unless out= says: beside the first run's own evaluations of the set, and an
    ensemble's in a folder of its own there (its table does not replace the first run's)."""
    out = run_dirs[0] / "eval" / test.folder
    return out / f"ensemble_{'+'.join(run_dir.name for run_dir in run_dirs)}" if len(run_dirs) > 1 else out


def sweep_checkpoints(checkpoint, *, test: TestSet, lang: str, decode: DecodeConfig, device: torch.device,
                      out: Path | None = None, tokenized: tuple[str, list[str]] | None = None) -> int:
    """Score every candidate of the run (or the ensemble of runs) `checkpoint` names; print and write the
    table, the plot, the best window (to `out`, else `sweep_folder`). evaluate.py's `checkpoints=all`;
    `tokenized` as for `steps.score`; a multilingual model translates into `test.language`."""
    run_dirs = sweep_run_dirs(checkpoint)
    if tokenized is not None and len(tokenized[1]) != len(test.references):  # before any decode
        raise ConfigError(f"tok_ref={tokenized[0]} has {len(tokenized[1])} lines but the reference has "
                          f"{len(test.references)}: give the tokenised reference of the same test set")
    cache = DecodeCache(run_dirs[0] / "eval" / "cache", decode=decode, device=device, sources=test.sources,
                        tgt_lang=test.language)
    file_digests: dict[Path, tuple[str, int | None]] = {}  # path -> (digest, step)
    scored: dict[str, dict[str, float]] = {}  # digest -> scores by name, each model scored once
    rows, decoded = [], 0
    for candidate in candidates(run_dirs):
        models = [_Model.of(paths, candidate, cache, file_digests) for paths in candidate.members]
        digest = models[0].digest if len(models) == 1 else _sha256("ensemble", *(model.digest for model in models))
        hypotheses = cache.translation(digest, len(test.sources))
        cached = hypotheses is not None
        if hypotheses is None:
            translator = Translator.from_states([model.take_weights() for model in models], device,
                                                names=[model.name for model in models], decode=decode,
                                                tgt_lang=test.language)
            log.info("decoding %d lines with %s", len(test.sources), candidate.label)
            hypotheses = translator.translate(test.sources, progress=True, source=test.name)
            del translator
            decoded += 1
            cache.store_translation(digest, hypotheses, candidate.label)
        del models  # a window's average made only to find its digest (a cached translation) goes with it
        if digest not in scored:
            scored[digest] = {s.name: s.score for s in evaluation.score(hypotheses, test, lang=lang,
                                                                         tokenized=tokenized)}
        scores = scored[digest]
        rows.append(Row(label=candidate.label, kind=candidate.kind, window=candidate.window,
                        bleu=scores["BLEU"], chrf=scores["chrF2"], tokbleu=scores["tokBLEU"],
                        lcbleu=scores.get("lcBLEU"), digest=digest, cached=cached,
                        **_updates(candidate, run_dirs, file_digests)))
    report = _report(rows, run_dirs, test.name, decode_count=decoded)
    print(report, end="", flush=True)
    out = out or sweep_folder(run_dirs, test)
    atomic_write(out / "checkpoints.md", report)
    best = _best_window(rows)
    atomic_write(out / "checkpoints.json", json.dumps(
        {"testset": test.name, "lang": lang, "lines": len(test.sources), "decode": asdict(decode),
         "runs": [{"run": str(run_dir), "keep_last": _keep_last(run_dir)} for run_dir in run_dirs],
         "decoded": decoded, "best_window": best.window, "best_by": _metric(best)[0],
         "rows": [asdict(row) for row in rows]}, indent=2) + "\n")
    title = " + ".join(run_dir.name for run_dir in run_dirs) + (" (an ensemble)" if len(run_dirs) > 1 else "")
    _plot(rows, out / "checkpoints.png", title=f"{title} on {test.name}")
    log.info("decoded with %d of %d models (the others were cached); wrote %s", decoded, len(rows),
             out / "checkpoints.md")
    return 0


@dataclass
class _Model:
    """One run's model of a candidate: its content digest, and its weights once they are needed."""

    name: str  # for error messages: the file, or which average
    digest: str
    paths: tuple[Path, ...]
    window: bool
    state: dict | None = None  # a window's average, when it was made to find its digest

    @classmethod
    def of(cls, paths: tuple[Path, ...], candidate: Candidate, cache: DecodeCache, memo: dict) -> _Model:
        if candidate.kind != "window":
            return cls(name=str(paths[0]), digest=_file_digest(paths[0], memo)[0], paths=paths, window=False)
        name = f"the average of the {candidate.label} in {paths[0].parent}"
        inputs = [_file_digest(path, memo)[0] for path in paths]
        digest, state = cache.average_digest(inputs), None
        if digest is None:
            state = ckpt.average(list(paths))
            digest = model_digest(state)
            cache.store_average_digest(inputs, digest)
        return cls(name=name, digest=digest, paths=paths, window=True, state=state)

    def take_weights(self) -> dict:
        """The checkpoint dict to build the model from, handed over rather than kept: once the model is built,
        the loaded file (Adam moments too) or the average is freed."""
        state, self.state = self.state, None
        if state is None:
            state = ckpt.average(list(self.paths)) if self.window else ckpt.load(self.paths[0])
        return state


def _updates(candidate: Candidate, run_dirs: list[Path], memo: dict) -> dict:
    """A row's updates: `step` and `averaged_steps` of one run's model, or each run's as `members`."""
    members = []
    for run_dir, paths in zip(run_dirs, candidate.members):
        if candidate.kind == "window":
            steps = [_file_digest(path, memo)[1] for path in paths]
            step, averaged = max(steps), steps
        else:
            step = _file_digest(paths[0], memo)[1]
            averaged = _averaged_steps(paths[0]) if candidate.kind == "averaged" else None
        members.append({"run": str(run_dir), "step": step, "averaged_steps": averaged})
    if len(members) == 1:
        return {"step": members[0]["step"], "averaged_steps": members[0]["averaged_steps"]}
    return {"step": None, "averaged_steps": None, "members": members}


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


def _metric(row: Row) -> tuple[str, float]:
    """What picks the best window: lcBLEU where tok_ref= gave it (the task's own metric), else BLEU."""
    return ("lcBLEU", row.lcbleu) if row.lcbleu is not None else ("BLEU", row.bleu)


def _best_window(rows: list[Row]) -> Row:
    """The last-k average with the highest score (`_metric`); on a tie the smaller k."""
    windows = [row for row in rows if row.kind == "window"]
    return max(windows, key=lambda row: (_metric(row)[1], -row.window))


def _steps(steps: list[int] | None) -> str:
    if not steps:
        return "–"
    return f"{min(steps)}–{max(steps)} ({len(steps)})" if len(steps) > 1 else str(steps[0])


def _span(steps: list[int]) -> str:
    return f"{min(steps)}–{max(steps)}" if len(steps) > 1 else str(steps[0])


def _row_updates(row: Row) -> tuple[str, str]:
    """The Update and Averages updates cells: of one run, or each run's joined by +."""
    if row.members is None:
        return (str(row.step) if row.step is not None else "–"), _steps(row.averaged_steps)
    return (" + ".join(str(m["step"]) if m["step"] is not None else "–" for m in row.members),
            " + ".join(_steps(m["averaged_steps"]) for m in row.members))


def _window_steps(row: Row) -> list[list[int]]:
    """The updates a window row averages, for each run."""
    return [m["averaged_steps"] for m in row.members] if row.members is not None else [row.averaged_steps]


def _seen(run_dir: Path) -> str:
    numbered = [step for step, _ in ckpt.list_numbered(run_dir)]
    keep_last = _keep_last(run_dir)
    kept = "all kept" if keep_last == 0 else f"train.keep_last={keep_last}" if keep_last else "train.keep_last"
    return (f"the {len(numbered)} numbered checkpoints in {ckpt.checkpoint_dir(run_dir)} (updates "
            f"{numbered[0]}–{numbered[-1]}; {kept})")


def _report(rows: list[Row], run_dirs: list[Path], set_name: str, *, decode_count: int) -> str:
    """The Markdown table, the best window, and what the sweep could not see."""
    lc = rows[0].lcbleu is not None
    lines = ["| Checkpoint | Update | Averages updates | BLEU | chrF2 | tokBLEU |" + (" lcBLEU |" if lc else ""),
             "| --- | ---: | --- | ---: | ---: | ---: |" + (" ---: |" if lc else "")]
    for row in rows:
        update, averaged = _row_updates(row)
        lines.append(f"| {row.label} | {update} | {averaged} | {row.bleu:.2f} | {row.chrf:.2f} | {row.tokbleu:.2f} |"
                     + (f" {row.lcbleu:.2f} |" if lc else ""))
    best = _best_window(rows)
    metric, score = _metric(best)
    of_each = " of each run" if len(run_dirs) > 1 else ""
    lines += ["", f"Best averaging window: the last {best.window} checkpoint{'s' if best.window > 1 else ''}{of_each} "
                  f"(updates {' + '.join(_span(steps) for steps in _window_steps(best))}): {metric} {score:.2f} "
                  f"on {set_name}.",
              f"Seen: {'; '.join(_seen(run_dir) for run_dir in run_dirs)}: training deletes older ones, so for a run "
              "meant to be swept set train.keep_last to the number of checkpoints to compare (0 keeps all).",
              f"Decoded {decode_count} of {len(rows)} rows now; the others came from "
              f"{run_dirs[0] / 'eval' / 'cache'} or from an identical model above."]
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: Path, *, title: str) -> None:
    """checkpoints.png: the score of each numbered checkpoint (and best.pt, averaged.pt) against its update (one
    run), and of each last-k average against k."""
    from matplotlib.figure import Figure  # here: only the sweep draws. A bare Figure renders with Agg, no GUI.

    numbered = [row for row in rows if row.kind == "numbered"]
    windows = [row for row in rows if row.kind == "window"]
    best = _best_window(rows)
    metric = _metric(best)[0]
    figure = Figure(figsize=(11 if numbered else 6, 4), layout="constrained")
    axes = figure.subplots(1, 2 if numbered else 1)
    by_update, by_window = axes if numbered else (None, axes)
    if numbered:
        by_update.plot([r.step for r in numbered], [_metric(r)[1] for r in numbered], "o-",
                       markersize=3 if len(numbered) > 40 else 6, label="numbered checkpoints")
        for kind, marker in (("best", "*"), ("averaged", "s")):
            for row in (r for r in rows if r.kind == kind and r.step is not None):
                by_update.plot([row.step], [_metric(row)[1]], marker, markersize=11, label=row.label)
        by_update.set(title=f"{metric} by update", xlabel="update (training step)", ylabel=metric)
        by_update.legend()
        by_update.grid(alpha=0.3)
    by_window.plot([r.window for r in windows], [_metric(r)[1] for r in windows], "o-", color="tab:green")
    by_window.plot([best.window], [_metric(best)[1]], "*", markersize=14, color="tab:red",
                   label=f"best: last {best.window}")
    by_window.set(title=f"{metric} of the average of the last k checkpoints", xlabel="k (checkpoints averaged)",
                  ylabel=metric)
    by_window.xaxis.get_major_locator().set_params(integer=True)
    by_window.legend()
    by_window.grid(alpha=0.3)
    figure.suptitle(title)
    atomic_write(path, lambda f: figure.savefig(f, format="png", dpi=100), what="figure")
