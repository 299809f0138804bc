"""Text to score: files read as sacreBLEU's command line reads them (`read_lines`), and sacreBLEU's named test
sets (`load_testset("wmt14/full", "en-de")`), read from its cache ($SACREBLEU), offline where the cache holds
them."""

import copy
import os

from data.lines import read_text_lines


def read_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a UTF-8 text file (data/lines.py: line ends, BOM; invalid bytes replaced by U+FFFD with a
    warning) with trailing whitespace removed, as sacreBLEU's command line reads hypotheses and references."""
    return [line.rstrip() for line in read_text_lines(path, str(path))]


def _sacrebleu_cache() -> str:
    return os.environ.get("SACREBLEU", os.path.join(os.path.expanduser("~"), ".sacrebleu"))


def _dataset(name: str):
    """sacreBLEU's dataset object, rooted at the cache $SACREBLEU names now.

    sacreBLEU reads $SACREBLEU once, when `sacrebleu` is imported, and roots every dataset there. A
    process that sets the variable later (a test, a notebook) gets a copy re-rooted at the current value.
    """
    from sacrebleu.dataset import DATASETS  # here: it must see $SACREBLEU as it is now (above)

    if name not in DATASETS:
        raise ValueError(f"unknown sacreBLEU test set {name!r} (`sacrebleu --list` shows them; "
                         "newstest2014 is wmt14/full)")
    dataset = DATASETS[name]
    outdir = os.path.join(_sacrebleu_cache(), dataset.name)
    if os.path.abspath(dataset._outdir) != os.path.abspath(outdir):
        dataset = copy.copy(dataset)  # sacreBLEU >= 2.2 keeps its paths in these two attributes
        dataset._outdir, dataset._rawdir = outdir, os.path.join(outdir, "raw")
    return dataset


def _testset(name: str):
    """sacreBLEU's dataset `name`; ValueError naming the fix for an unknown name or the filtered `wmt14`."""
    if name == "wmt14":
        raise ValueError("sacreBLEU's 'wmt14' is the filtered newstest2014 (2737 lines for en-de); "
                         "newstest2014 means the full 3003-line set: use testset=wmt14/full")
    return _dataset(name)


def testset_langpairs(name: str) -> list[str]:
    """The language pairs of a sacreBLEU test set; ValueError naming the fix for an unknown or refused name."""
    return sorted(_testset(name).langpairs)


def load_testset(name: str, langpair: str) -> tuple[list[str], list[str]]:
    """(source lines, reference lines) of a sacreBLEU test set, e.g. ("wmt14/full", "en-de").

    Reads sacreBLEU's cache ($SACREBLEU, default ~/.sacrebleu; offline with
    SACREBLEU=../shared/data/sacrebleu), downloading only what it lacks. The filtered `wmt14` is refused:
    newstest2014 means the full 3003-line set. A set with several references gives its first.
    """
    dataset = _testset(name)
    if langpair not in dataset.langpairs:
        raise ValueError(f"sacreBLEU test set {name!r} has no language pair {langpair!r} "
                         f"(it has {', '.join(sorted(dataset.langpairs))})")
    try:
        source = dataset.get_source_file(langpair)
        references = dataset.get_reference_files(langpair)
    except (Exception, SystemExit) as e:  # sacreBLEU's downloader exits on a bad checksum
        raise ValueError(f"cannot get sacreBLEU test set {name} {langpair} into the cache {_sacrebleu_cache()} "
                         f"({type(e).__name__}: {e}); offline, set SACREBLEU to a cache that holds it, "
                         "e.g. SACREBLEU=../shared/data/sacrebleu") from None
    src_lines, ref_lines = read_lines(source), read_lines(references[0])
    if len(src_lines) != len(ref_lines):
        raise ValueError(f"sacreBLEU test set {name} {langpair} in {_sacrebleu_cache()} is damaged: "
                         f"{len(src_lines)} source lines but {len(ref_lines)} reference lines")
    return src_lines, ref_lines

