"""Results tables in the paper's layout: Table 2 (test BLEU and training cost) and Table 3 (variations, dev
PPL and BLEU), one Markdown row per evaluation (`append_table_row`, `table_markdown`), and the training-cost
column (`training_flops`)."""

import logging
import math
import os
from pathlib import Path
from typing import Any

from data.files import atomic_write

log = logging.getLogger(__name__)


def training_flops(params_non_embedding: int, tokens: int) -> float:
    """Training compute ≈ 6 · N · tokens (Kaplan et al. 2020): per token 2N FLOPs forward (a multiply and
    an add per weight) and 4N backward.

    N = parameters outside the embedding (the shared embedding is a lookup on the input side);
    tokens = target tokens trained on (updates × target tokens per update). In an encoder-decoder each
    weight sees one side, and source and target are about equally long, so the target count stands for
    both sides. Left out: attention's length-dependent terms and the output projection (2·V·D per target
    token forward, 6·V·D with backward), about 40% on top of 6N for the base model at 37k vocabulary.
    This counts the model's arithmetic; the paper's Table 2 column is instead the hardware's capacity over
    the run, training time × GPUs × each GPU's sustained single-precision FLOPS (its footnote: 2.8, 3.7,
    6.0 and 9.5 TFLOPS for K80, K40, M40 and P100), several times larger (base: 8 P100 × 12 h, 3.3·10^18
    there, 6N·tokens ≈ 0.7·10^18). That figure is the table's GPU-hours column × the GPU's FLOPS, which
    no checkpoint records.
    """
    return 6.0 * float(params_non_embedding) * float(tokens)


# The row a caller passes: one evaluation of one model. `set` names the test or dev set it was scored on (the
# paper's are newstest2014 and newstest2013; a row of any other set says so); `lang` (the target language)
# places bleu/tokbleu in Table 2's EN-DE or EN-FR columns; in Table 3 "BLEU (dev)" is tokbleu, the paper's metric.
ROW_KEYS = ("model", "set", "lang", "bleu", "tokbleu", "ppl", "steps", "params", "gpu_hours", "flops",
            "N", "d_model", "d_ff", "h", "d_k", "d_v", "p_drop", "eps_ls", "positions")
_MISSING = "–"  # an en dash, for a value a run does not have


def _text(value: Any) -> str:
    return str(value).replace("\n", " ").replace("|", "\\|").strip() or _MISSING


def _fixed(decimals: int):
    return lambda value: f"{value:.{decimals}f}"


def _general(value: Any) -> str:
    return f"{value:g}"


def _integer(value: Any) -> str:
    return str(int(value))


def _power_of_ten(value: Any) -> str:  # the paper's "3.3 · 10^18"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa} · 10^{int(exponent)}"


def _millions(value: Any) -> str:
    return f"{value / 1e6:.0f}"


# (column title, key of the expanded row, number format), in the paper's order
TABLE2_COLUMNS = [
    ("Model", "model", _text),
    ("Test set", "set", _text),
    ("EN-DE BLEU (sacreBLEU)", "en_de_bleu", _fixed(2)),
    ("EN-DE tokBLEU", "en_de_tokbleu", _fixed(2)),
    ("EN-FR BLEU (sacreBLEU)", "en_fr_bleu", _fixed(2)),
    ("EN-FR tokBLEU", "en_fr_tokbleu", _fixed(2)),
    ("Training steps", "steps", _integer),
    ("GPU-hours", "gpu_hours", _fixed(1)),
    ("Training FLOPs", "flops", _power_of_ten),
]
TABLE3_COLUMNS = [
    ("Model", "model", _text),  # the paper's unlabelled first column (base, (A), ..., big)
    ("Dev set", "set", _text),
    ("N", "N", _integer),
    ("d_model", "d_model", _integer),
    ("d_ff", "d_ff", _integer),
    ("h", "h", _integer),
    ("d_k", "d_k", _integer),
    ("d_v", "d_v", _integer),
    ("P_drop", "p_drop", _general),
    ("ε_ls", "eps_ls", _general),
    ("positions", "positions", _text),  # sinusoidal (§3.5) | learned: row (E), the paper's free-text cell
    ("train steps", "steps", _integer),
    ("PPL (dev)", "ppl", _fixed(2)),
    ("BLEU (dev)", "tokbleu", _fixed(2)),
    ("params ×10^6", "params", _millions),
]
_TABLES = {
    "2": ("## Table 2: test BLEU and training cost (the paper's test set: newstest2014)", TABLE2_COLUMNS),
    "3": ("## Table 3: variations on the base model, dev PPL and BLEU (the paper's dev set: newstest2013); BLEU is "
          "tokBLEU", TABLE3_COLUMNS),
}


def _cell(value: Any, number_format) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return _MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _text(value)
    return number_format(value)


def _expand(row: dict[str, Any]) -> dict[str, Any]:
    """The row with Table 2's language columns filled from `lang`."""
    cells = dict(row)
    lang = row.get("lang")
    if lang in ("de", "fr"):
        cells[f"en_{lang}_bleu"], cells[f"en_{lang}_tokbleu"] = row.get("bleu"), row.get("tokbleu")
    elif row.get("bleu") is not None or row.get("tokbleu") is not None:
        log.warning("Table 2 has EN-DE and EN-FR columns only: the BLEU of %s (target %s) is left out of it",
                    row.get("model"), lang)
        cells["model"] = f"{row.get('model') or _MISSING} (→{lang})"
    return cells


def _table_lines(table: str) -> list[str]:
    heading, columns = _TABLES[table]
    titles = [title for title, _, _ in columns]
    return [heading, "", "| " + " | ".join(titles) + " |", "|" + "|".join(" --- " for _ in titles) + "|"]


def append_table_row(table_path: str | os.PathLike, row: dict[str, Any], table: str = "2") -> None:
    """Append one evaluation to Table 2 ("2": a test-set run), Table 3 ("3": a dev-set run) or both ("both").

    `row` holds any of ROW_KEYS: model (a name), set (the test or dev set's name), lang (target language: "de"
    fills Table 2's EN-DE columns, "fr" its EN-FR ones), bleu (sacreBLEU), tokbleu, ppl, steps, params (a count;
    shown in millions), gpu_hours, flops, and the architecture N, d_model, d_ff, h, d_k, d_v, p_drop, eps_ls,
    positions (sinusoidal | learned).
    Numbers are formatted per column; a missing key or None shows "–"; an unknown key is an error.
    Creates the file with both tables when absent; the write is atomic.
    """
    tables = {"2": ["2"], "3": ["3"], "both": ["2", "3"]}.get(str(table))
    if tables is None:
        raise ValueError(f"table must be '2', '3' or 'both', not {table!r}")
    unknown = sorted(set(row) - set(ROW_KEYS))
    if unknown:
        raise ValueError(f"unknown results-table keys {unknown}; known: {', '.join(ROW_KEYS)}")

    path = Path(table_path)
    if path.exists():
        lines = path.read_text(encoding="utf-8").splitlines()
    else:
        lines = ["# Results (the layout of the paper's Tables 2 and 3)", ""]
        for t in ("2", "3"):
            lines += _table_lines(t) + [""]

    for t in tables:
        heading, columns = _TABLES[t]
        cells = _expand(row) if t == "2" else row
        new_row = "| " + " | ".join(_cell(cells.get(key), number_format) for _, key, number_format in columns) + " |"
        if heading not in lines:  # a file from elsewhere, or a table someone deleted: add it at the end
            lines += ([""] if lines and lines[-1] else []) + _table_lines(t)
        pos = lines.index(heading) + 1
        while pos < len(lines) and not lines[pos].startswith(("|", "#")):  # to the table's header row
            pos += 1
        if pos == len(lines) or lines[pos].startswith("#"):  # a heading without its table
            lines[pos:pos] = _table_lines(t)[2:] + [""]
        while pos < len(lines) and lines[pos].startswith("|"):  # past the table's last row
            pos += 1
        lines.insert(pos, new_row)

    atomic_write(path, "\n".join(lines).rstrip("\n") + "\n", what="table", elsewhere="give another table=")


def table_markdown(row: dict[str, Any], table: str = "2") -> list[str]:
    """Table 2 ("2") or 3 ("3") as Markdown lines holding only `row` (as `append_table_row` writes it),
    heading excluded: for a report."""
    _, columns = _TABLES[table]
    cells = _expand(row) if table == "2" else row
    return _table_lines(table)[2:] + [
        "| " + " | ".join(_cell(cells.get(key), number_format) for _, key, number_format in columns) + " |"]
