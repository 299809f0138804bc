"""transformer.evaluation.scoring against independent computations: sacreBLEU's own CLI, the published figures of two
real systems, perl's semantics for get_ende_bleu.sh's steps, and sacreBLEU's own test-set cache."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from transformer.evaluation.scoring import (
    lc_bleu,
    lc_norm_tok,
    moses_compound_split,
    replace_unicode_punctuation,
    sacrebleu_scores,
    tok_bleu,
    tokbleu_tokenize,
)
from transformer.evaluation.tables import TABLE2_COLUMNS, TABLE3_COLUMNS, append_table_row, training_flops
from transformer.evaluation.testsets import load_testset, read_lines

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ["fairseq_wmt19_en_de", "opus-mt_eng-deu"]  # systems/SOURCES.md: FAIR WMT19, OPUS-MT


def _cli_lines(ref: Path, hyp: Path) -> list[str]:
    """sacreBLEU's command line in its own process: one text line per metric, two decimals."""
    out = subprocess.run([sys.executable, "-m", "sacrebleu", str(ref), "-i", str(hyp), "-m", "bleu", "chrf",
                          "-f", "text", "-w", "2"], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]  # the CLI pads to align the "="


def _by_name(scores):
    return {s.name: s for s in scores}


# ----------------------------------------------------------------------------------------------------
# sacreBLEU and chrF equal sacreBLEU's own command line
# ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("system", SYSTEMS)
def test_bleu_and_chrf_lines_equal_sacrebleu_cli_on_real_systems(shared_data, system):
    ref = shared_data / "text" / "newstest2014.en-de.de"
    hyp = shared_data / "systems" / f"{system}.newstest2014.de"
    scores = _by_name(sacrebleu_scores(read_lines(hyp), read_lines(ref), "de"))
    assert _cli_lines(ref, hyp) == [scores["BLEU"].line, scores["chrF2"].line]


@pytest.mark.slow
def test_bleu_and_chrf_lines_equal_sacrebleu_cli_on_a_tiny_pair(tmp_path):
    hyps = ["Der Hund bellt laut .", "Es regnet  heute in Berlin. ", "„Ja“, sagte sie – nicht wirklich!", ""]
    refs = ["Der Hund bellte laut.", "Heute regnet es in Berlin.", "„Ja“, sagte sie, „nicht wirklich“!", "Leer"]
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("\n".join(hyps) + "\n", encoding="utf-8")
    ref.write_text("\r\n".join(refs), encoding="utf-8")  # CRLF and no final newline: the CLI copes, so must we
    scores = _by_name(sacrebleu_scores(read_lines(hyp), read_lines(ref), "de"))
    assert _cli_lines(ref, hyp) == [scores["BLEU"].line, scores["chrF2"].line]
    assert 0 < scores["BLEU"].score < 100


# ----------------------------------------------------------------------------------------------------
# The published figures of two real systems on newstest2014 EN-DE (systems/SOURCES.md)
# ----------------------------------------------------------------------------------------------------


# tokBLEU: the 2018 Moses perl scripts give 35.75 / 29.67, today's 35.76 / 29.68 (tokenizer.perl now also
# splits a line-final "NN."). sacremoses 0.2 ports the 2018 rule and gives the first; both are the paper's
# metric, so a sacremoses that adopts the new rule is accepted too.
@pytest.mark.parametrize("system, bleu, chrf, tok", [
    ("fairseq_wmt19_en_de", 34.97, 63.75, (35.75, 35.76)),
    ("opus-mt_eng-deu", 29.03, 59.71, (29.67, 29.68)),
])
def test_real_systems_reproduce_published_figures(shared_data, system, bleu, chrf, tok):
    refs = read_lines(shared_data / "text" / "newstest2014.en-de.de")
    hyps = read_lines(shared_data / "systems" / f"{system}.newstest2014.de")
    scores = sacrebleu_scores(hyps, refs, "de")
    assert [s.name for s in scores] == ["BLEU", "chrF2", "tokBLEU"]
    by_name = _by_name(scores)
    assert round(by_name["BLEU"].score, 2) == bleu
    assert round(by_name["chrF2"].score, 2) == chrf
    assert round(by_name["tokBLEU"].score, 2) in tok
    assert by_name["BLEU"].line.startswith(
        f"BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__} = {bleu:.2f} ")
    assert by_name["tokBLEU"].line.startswith("tokBLEU|tok:moses-de|split:compound|version:sacremoses-")
    assert f" = {by_name['tokBLEU'].score:.2f} " in by_name["tokBLEU"].line
    record = by_name["tokBLEU"].as_dict()
    assert record["name"] == "tokBLEU" and record["score"] == by_name["tokBLEU"].score
    assert record["line"] == by_name["tokBLEU"].line and record["ref_len"] > 60000


def test_mismatched_line_counts_are_a_one_line_error():
    with pytest.raises(ValueError, match=r"3 lines.*2") as error:
        sacrebleu_scores(["a", "b", "c"], ["a", "b"], "de")
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------------
# tokBLEU: get_ende_bleu.sh step by step
# ----------------------------------------------------------------------------------------------------


def test_compound_split_is_non_overlapping_like_perl():
    # perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g': after "1-2" the scan resumes at "-3", whose "-" has
    # no unconsumed character before it
    assert moses_compound_split("1-2-3") == "1 ##AT##-##AT## 2-3"
    assert moses_compound_split("e-mail-Adresse") == "e ##AT##-##AT## mail ##AT##-##AT## Adresse"
    assert moses_compound_split("rich-text format") == "rich ##AT##-##AT## text format"
    assert moses_compound_split("a - b -c d- e") == "a - b -c d- e"
    # perl reads bytes: a Unicode space is non-space to it (Python's \s would say otherwise)
    assert moses_compound_split("5\u2009-\u20096") == "5\u2009 ##AT##-##AT## \u20096"


def test_unicode_punctuation_follows_the_moses_script():
    assert replace_unicode_punctuation("“Ja”，sagte er。  Gut？（１）…’") == '"Ja",sagte er. Gut?(")...\''
    assert replace_unicode_punctuation("Ende．\tweiter") == "Ende. \tweiter"  # " *" is spaces only, not \s
    # the script's list is short: German quotes and en dashes are not in it
    assert replace_unicode_punctuation("„Ja“ – ‘nein’") == '„Ja" – ‘nein\''


def test_unicode_punctuation_is_replaced_on_the_hypothesis_only():
    curly = ["Er sagte “ ja ” und ging dann nach Hause ."]
    straight = ['Er sagte " ja " und ging dann nach Hause .']
    assert tok_bleu(curly, straight, "de").score == pytest.approx(100.0)
    assert tok_bleu(straight, curly, "de").score < 100.0  # the reference keeps its “ ”
    assert tokbleu_tokenize(curly, "de", hypothesis=False) == curly


def test_moses_escaping_and_no_aggressive_dash_split():
    line = 'Er sagte: "Tom & Jerry" <3 | [x] rich-text.'
    expected = "Er sagte : &quot; Tom &amp; Jerry &quot; &lt; 3 &#124; &#91; x &#93; rich ##AT##-##AT## text ."
    assert tokbleu_tokenize([line], "de", hypothesis=True) == [expected]
    assert tokbleu_tokenize([line], "de", hypothesis=False) == [expected]


def test_tok_bleu_is_multi_bleu_zero_when_an_ngram_order_has_no_match():
    # multi-bleu.perl: log(0) floored, so BLEU 0 (sacreBLEU's default "exp" smoothing would give > 0)
    score = tok_bleu(["ein kurzer Satz"], ["ein kurzer Satz"], "de")
    assert score.score == 0.0 and "100.0/100.0/100.0/0.0" in score.line


# ----------------------------------------------------------------------------------------------------
# Files and sacreBLEU test sets
# ----------------------------------------------------------------------------------------------------


def test_read_lines_replaces_bad_bytes_and_splits_on_newline_only(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"ein\xe2\x80\xa8Satz  \r\nbad \xff\xfe byte\n\nlast")  # U+2028 inside line 1
    assert read_lines(path) == ["ein\u2028Satz", "bad \ufffd\ufffd byte", "", "last"]


def test_filtered_wmt14_is_refused_for_the_full_set():
    with pytest.raises(ValueError, match="wmt14/full"):
        load_testset("wmt14", "en-de")
    with pytest.raises(ValueError, match="unknown sacreBLEU test set"):
        load_testset("newstest2014", "en-de")
    with pytest.raises(ValueError, match="no language pair 'en-xx'"):
        load_testset("wmt14/full", "en-xx")


@pytest.mark.slow
def test_load_testset_reads_the_shared_cache_in_a_fresh_process(shared_data, tmp_path):
    # sacreBLEU reads $SACREBLEU when imported: the way evaluate.py meets it
    script = ("import json, sys; from transformer.evaluation.testsets import load_testset; "
              "src, ref = load_testset('wmt14/full', 'en-de'); json.dump([src, ref], open(sys.argv[1], 'w'))")
    out = tmp_path / "lines.json"
    env = {**os.environ, "SACREBLEU": str(shared_data / "sacrebleu")}
    subprocess.run([sys.executable, "-c", script, str(out)], cwd=ROOT, env=env, check=True)
    import json
    src, ref = json.loads(out.read_text(encoding="utf-8"))
    assert len(src) == len(ref) == 3003
    assert src == read_lines(shared_data / "text" / "newstest2014.en-de.en")
    assert ref == read_lines(shared_data / "text" / "newstest2014.en-de.de")


def test_load_testset_follows_sacrebleu_set_after_import(shared_data, monkeypatch, tmp_path):
    from sacrebleu.dataset import DATASETS

    from transformer.evaluation.testsets import _dataset

    monkeypatch.setenv("SACREBLEU", str(tmp_path))  # a cache sacreBLEU did not see when imported
    assert Path(_dataset("wmt14/full")._outdir) == tmp_path / "wmt14/full"
    monkeypatch.setenv("SACREBLEU", str(shared_data / "sacrebleu"))
    src, ref = load_testset("wmt14/full", "en-de")
    assert len(src) == len(ref) == 3003
    assert src == read_lines(shared_data / "text" / "newstest2014.en-de.en")
    assert ref == read_lines(shared_data / "text" / "newstest2014.en-de.de")
    assert DATASETS["wmt14/full"]._outdir != str(tmp_path / "wmt14/full")  # sacreBLEU's own table untouched


# ----------------------------------------------------------------------------------------------------
# Results tables and training cost
# ----------------------------------------------------------------------------------------------------


def _markdown_tables(text: str) -> dict[str, list[list[str]]]:
    """{heading: rows of cells} for every pipe table under a "## " heading."""
    tables, heading = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line
        elif line.startswith("|"):
            assert line.endswith("|"), line
            tables.setdefault(heading, []).append([c.strip() for c in line.strip("|").split("|")])
    return tables


def test_two_appended_rows_render_as_the_papers_tables(tmp_path):
    path = tmp_path / "eval" / "table.md"
    append_table_row(path, {"model": "base", "set": "wmt14", "lang": "de", "bleu": 27.312, "tokbleu": 27.9,
                            "steps": 100000, "gpu_hours": 96, "flops": training_flops(44_000_000, 2_500_000_000)},
                     table="2")
    append_table_row(path, {"model": "big", "set": "newstest2013", "lang": "fr", "bleu": 41.0, "tokbleu": None,
                            "ppl": 4.33, "steps": 300000, "params": 213_000_000, "N": 6, "d_model": 1024, "d_ff": 4096,
                            "h": 16, "d_k": 64, "d_v": 64, "p_drop": 0.3, "eps_ls": 0.1, "positions": "sinusoidal"},
                     table="both")
    tables = _markdown_tables(path.read_text(encoding="utf-8"))
    assert len(tables) == 2
    (table2_heading, table2), (table3_heading, table3) = tables.items()
    assert "Table 2" in table2_heading and "Table 3" in table3_heading
    assert table2[0] == ["Model", "Test set", "EN-DE BLEU (sacreBLEU)", "EN-DE tokBLEU", "EN-FR BLEU (sacreBLEU)",
                         "EN-FR tokBLEU", "Training steps", "GPU-hours", "Training FLOPs"]
    assert table3[0] == ["Model", "Dev set", "N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "ε_ls", "positions",
                         "train steps", "PPL (dev)", "BLEU (dev)", "params ×10^6"]
    assert [title for title, _, _ in TABLE2_COLUMNS] == table2[0]
    assert [title for title, _, _ in TABLE3_COLUMNS] == table3[0]
    assert all(set(cell) == {"-"} for cell in table2[1]) and all(set(cell) == {"-"} for cell in table3[1])
    assert table2[2:] == [
        ["base", "wmt14", "27.31", "27.90", "–", "–", "100000", "96.0", "6.6 · 10^17"],
        ["big", "newstest2013", "–", "–", "41.00", "–", "300000", "–", "–"],
    ]
    assert table3[2:] == [["big", "newstest2013", "6", "1024", "4096", "16", "64", "64", "0.3", "0.1", "sinusoidal",
                           "300000", "4.33", "–", "213"]]
    for table in (table2, table3):
        assert len({len(row) for row in table}) == 1


def test_table2_keeps_other_target_languages_out_of_its_columns(tmp_path, caplog):
    path = tmp_path / "table.md"
    append_table_row(path, {"model": "finetuned", "lang": "ro", "bleu": 30.1, "tokbleu": 31.2, "steps": 5})
    (_, table2), _ = _markdown_tables(path.read_text(encoding="utf-8")).items()
    assert table2[2:] == [["finetuned (→ro)", "–", "–", "–", "–", "–", "5", "–", "–"]]
    assert "EN-DE and EN-FR columns only" in caplog.text


def test_table_rejects_unknown_keys_and_tables(tmp_path):
    with pytest.raises(ValueError, match="unknown results-table keys"):
        append_table_row(tmp_path / "t.md", {"en_de_bleu": 27.3})
    with pytest.raises(ValueError, match="table must be"):
        append_table_row(tmp_path / "t.md", {"model": "x"}, table="4")
    assert not (tmp_path / "t.md").exists()


def test_training_flops_is_six_n_tokens():
    assert training_flops(44_000_000, 2_500_000_000) == 6 * 44_000_000 * 2_500_000_000


# ------------------------------------------------------------------------- lcBLEU (the Multi30k papers' BLEU)


@pytest.mark.parametrize("lang, differing", [("de", []), ("en", []), ("fr", [694])])
def test_lc_norm_tok_reproduces_the_official_multi30k_references(shared_data, lang, differing):
    """The task's preprocessing applied to the raw test_2016_flickr references gives the official
    `lc.norm.tok` files: German and English line for line; French all but line 694 (the official
    normaliser put the period after a closing quote there, sacremoses' French rules before it)."""
    raw = read_lines(shared_data / "multi30k" / f"test_2016_flickr.{lang}")
    official = read_lines(shared_data / "multi30k" / "tok" / f"test_2016_flickr.lc.norm.tok.{lang}")
    ours = lc_norm_tok(raw, lang)
    assert len(ours) == len(official) == 1000
    assert [number for number, (a, b) in enumerate(zip(ours, official), start=1) if a != b] == differing


def test_the_lc_norm_tok_command_writes_the_official_reference_from_the_raw_one(shared_data, tmp_path):
    """`python -m transformer.evaluation.scoring lc-norm-tok de IN OUT` (how a validation set gets a tok_ref=
    file) writes the official German test file byte for byte, in a fresh process; a missing input is a
    one-line error with exit status 2 and nothing written."""
    out = tmp_path / "test.lc.norm.tok.de"
    command = [sys.executable, "-m", "transformer.evaluation.scoring", "lc-norm-tok", "de"]
    done = subprocess.run([*command, str(shared_data / "multi30k" / "test_2016_flickr.de"), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == (shared_data / "multi30k" / "tok" / "test_2016_flickr.lc.norm.tok.de").read_bytes()
    assert done.stdout.startswith(f"wrote {out}: 1000 lines")
    missing = subprocess.run([*command, str(tmp_path / "absent.de"), str(tmp_path / "x")], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "absent.de: no such file" in missing.stderr
    assert not (tmp_path / "x").exists()


def test_lc_bleu_lowercases_and_tokenizes_the_hypothesis_only():
    """The hypothesis goes through the pipeline; the reference is taken as it is (already tokenised): a
    cased, untokenised perfect translation scores 100, and the score equals multi-bleu's on the tokens."""
    refs = ["ein mann mit einem orangefarbenen hut , der etwas anstarrt .", "ein boston terrier läuft über gras ."]
    hyps = ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.", "Ein Boston Terrier läuft über Gras."]
    score = lc_bleu(hyps, refs, "de")
    assert score.score == pytest.approx(100.0)
    assert score.line.startswith("lcBLEU|case:lc|norm:moses-de|tok:moses-de|ref:tokenized|")
    worse = ["Ein Mann mit einem Hut, der etwas anstarrt.", "Ein Terrier läuft über Gras."]
    expected = sacrebleu.corpus_bleu([h.lower().replace(",", " ,").replace(".", " .") for h in worse], [refs],
                                     tokenize="none", smooth_method="none", force=True).score
    assert lc_bleu(worse, refs, "de").score == pytest.approx(expected)
    assert lc_bleu(worse, [r.upper() for r in refs], "de").score == 0  # the reference is not lowercased again
