"""transformer/hf.py and transformer/interop/ against the real clients: `transformers` (MarianMTModel, MarianTokenizer, generate) and
CTranslate2. Small random Marian models are built and saved by `transformers` itself, imported, and compared;
the session's tiny trained model is exported and compared with translate.py's output."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import import_extra  # noqa: E402

pytestmark = pytest.mark.extras("transformers", "ctranslate2")  # the test extra; CI runs them (.ci/run)
transformers = import_extra("transformers")
ctranslate2 = import_extra("ctranslate2")
import sentencepiece as spm  # noqa: E402

from data.vocab import MarianVocab  # noqa: E402
from transformer.interop import ct2_export  # noqa: E402
from transformer.interop import marian as marian_interop  # noqa: E402  (tests name a fixture `marian`)
from transformer import hf  # noqa: E402
from transformer.search import beam_search, greedy_search  # noqa: E402
from transformer.decoding.translation import Translator, pad_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SOURCE_TEXT = [
    "the quick brown fox jumps over the lazy dog", "a small house stands by the river",
    "we walked to the station in the rain", "she reads a book every evening", "the children play in the garden",
    "my brother works at the old factory", "they sold their car last week", "the weather is cold in winter",
    "he opened the window and looked outside", "our teacher explained the lesson twice",
]
TARGET_TEXT = [
    "der schnelle braune fuchs springt über den faulen hund", "ein kleines haus steht am fluss",
    "wir gingen im regen zum bahnhof", "sie liest jeden abend ein buch", "die kinder spielen im garten",
    "mein bruder arbeitet in der alten fabrik", "sie haben letzte woche ihr auto verkauft",
    "im winter ist das wetter kalt", "er öffnete das fenster und schaute hinaus",
    "unser lehrer erklärte die lektion zweimal",
]
# Real sentences, with characters neither SentencePiece model has seen (→ UNK) and a language token.
PROBES = ["the dog walked to the garden", "a brown house in the rain ☃ Ω", "every evening she reads",
          "Zürich's café — naïve", ">>de<< the children play", "the lazy fox"]


def train_spm(texts: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts * 20), model_writer=model, vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, minloglevel=2,
                                   hard_vocab_limit=False)
    return model.getvalue()


@pytest.fixture(scope="module")
def spm_models() -> dict[str, bytes]:
    return {"source": train_spm(SOURCE_TEXT, 70), "target": train_spm(TARGET_TEXT, 70),
            "shared": train_spm(SOURCE_TEXT + TARGET_TEXT, 90)}


def pieces_of(model: bytes) -> list[str]:
    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i))]


def write_marian(directory: Path, spm_models: dict[str, bytes], *, activation: str, separate_spm: bool,
                 share: bool = True, scale_embedding: bool = False, biases: bool = True, logits_bias: bool = True,
                 d_model: int = 15, heads: int = 3, seed: int = 0, separate_vocabs: bool = False,
                 eos_bias: float = 7.0) -> Path:
    """A random MarianMTModel + MarianTokenizer saved by transformers: Marian's ids (EOS=0, UNK=1, PAD last;
    with `separate_vocabs`, a table per side, PAD at id 2 of both)."""
    source = spm_models["source" if separate_spm else "shared"]
    target = spm_models["target" if separate_spm else "shared"]

    def id_table(*piece_lists: list[str]) -> list[str]:
        table = ["</s>", "<unk>"] + (["<pad>"] if separate_vocabs else [])
        for piece in (piece for pieces in piece_lists for piece in pieces):
            if piece not in table:
                table.append(piece)
        return table + ([] if separate_vocabs else ["<pad>"])

    if separate_vocabs:
        table, target_table = id_table(pieces_of(source), [">>de<<"]), id_table(pieces_of(target))
    else:
        table = target_table = id_table(pieces_of(source), pieces_of(target), [">>de<<"])
    vocab_size, pad = len(table), table.index("<pad>")
    config = transformers.MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=len(target_table), d_model=d_model, encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=22, decoder_ffn_dim=22,
        activation_function=activation, scale_embedding=scale_embedding, share_encoder_decoder_embeddings=share,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
        forced_eos_token_id=0, max_position_embeddings=128, dropout=0.1)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "embed_positions" in name:
                continue
            if name.endswith("proj.bias") and not biases or name == "final_logits_bias" and not logits_bias:
                tensor.zero_()
            elif "layer_norm.weight" in name:
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            else:
                tensor.copy_(0.5 * torch.randn_like(tensor))
        if logits_bias:
            model.final_logits_bias[0, 0] += eos_bias  # EOS likelier: some hypotheses end before the length cap
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    (directory / "source.spm").write_bytes(source)
    (directory / "target.spm").write_bytes(target)
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(table)}))
    separate = {}
    if separate_vocabs:
        (directory / "target_vocab.json").write_text(json.dumps({p: i for i, p in enumerate(target_table)}))
        separate = {"target_vocab_file": str(directory / "target_vocab.json"), "separate_vocabs": True}
    tokenizer = transformers.MarianTokenizer(source_spm=str(directory / "source.spm"),
                                             target_spm=str(directory / "target.spm"),
                                             vocab=str(directory / "vocab.json"), source_lang="en", target_lang="de",
                                             **separate)
    tokenizer.save_pretrained(directory)
    return directory


VARIANTS = {
    "relu-shared-spm": dict(activation="relu", separate_spm=False),
    "swish-two-spm": dict(activation="swish", separate_spm=True),
    "gelu-untied-scaled": dict(activation="gelu", separate_spm=True, share=False, scale_embedding=True),
    "gelu-two-vocabularies": dict(activation="gelu", separate_spm=True, share=False, separate_vocabs=True,
                                  eos_bias=12.0),
    "relu-no-biases-even": dict(activation="relu", separate_spm=False, biases=False, logits_bias=False,
                                d_model=16, heads=4),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def imported(request, tmp_path_factory, spm_models, one_torch_thread):
    """(the Marian directory, our run directory, the transformers model, its tokenizer, our model, our vocab)."""
    base = tmp_path_factory.mktemp(request.param)
    marian_dir = write_marian(base / "marian", spm_models, **VARIANTS[request.param])
    run_dir = base / "run"
    marian_interop.import_marian(marian_dir, run_dir)
    model, vocab, _ = marian_interop.load_model(run_dir)
    theirs = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
    return marian_dir, run_dir, theirs, tokenizer, model, vocab, request.param


def sources(tokenizer, vocab, texts):
    ids = [row + [vocab.eos_id] for row in vocab.encode(texts)]
    return ids, pad_rows(ids, vocab.pad_id, "cpu")


def test_import_sets_the_options_of_each_variant(imported):
    _, _, theirs, _, model, vocab, name = imported
    c, spec = model.config, VARIANTS[name]
    assert isinstance(vocab, MarianVocab)
    assert (c.pad_id, c.unk_id, c.eos_id, c.bos_id) == (theirs.config.pad_token_id, 1, 0, theirs.config.pad_token_id)
    assert c.target_size == theirs.config.decoder_vocab_size and c.vocab_size == theirs.config.vocab_size
    assert (c.target_vocab_size is not None) == spec.get("separate_vocabs", False)
    assert c.activation == spec["activation"]
    assert c.attention_bias == spec.get("biases", True)
    assert c.logits_bias == spec.get("logits_bias", True)
    assert c.scale_embedding == spec.get("scale_embedding", False)
    assert c.shared_embeddings == spec.get("share", True)


def test_imported_token_ids_equal_marian_tokenizers(imported):
    _, _, _, tokenizer, _, vocab, _ = imported
    ids, _ = sources(tokenizer, vocab, PROBES)
    assert ids == tokenizer(PROBES).input_ids
    assert any(vocab.unk_id in row for row in ids)  # the unseen characters are UNK in both
    target = tokenizer(text_target=TARGET_TEXT[:3]).input_ids
    assert [row + [vocab.eos_id] for row in vocab.encode_target(TARGET_TEXT[:3])] == target


def test_imported_vocabulary_maps_pieces_to_words_and_aligns_a_translation(imported):
    """alignment=true on an imported model: each side's pieces (its own model and table) mapped to their words,
    a language code the first word's one piece, and the aligner's links inside both sentences."""
    from transformer.evaluation.alignment import Aligner

    _, _, _, _, model, vocab, _ = imported
    for text, target in [*((p, False) for p in PROBES), *((t, True) for t in TARGET_TEXT[:3])]:
        ids, words = vocab.encode_words(text, target=target)
        assert ids == (vocab.encode_target if target else vocab.encode)([text])[0], text
        assert words == sorted(words) and set(words) == set(range(len(text.split()))), (text, words)
    assert vocab.encode_words(">>de<< the children play")[1][:2] == [0, 1]  # the code alone is word 0
    assert vocab.pieces(vocab.encode_target(["ein haus"])[0], target=True) == \
        [vocab.target_pieces[i] for i in vocab.encode_target(["ein haus"])[0]]
    links = Aligner(model=model, vocab=vocab, layer=0).align(SOURCE_TEXT[1], TARGET_TEXT[1])
    assert {j for _, j in links} == set(range(len(TARGET_TEXT[1].split())))  # every target word linked once
    assert all(0 <= i < len(SOURCE_TEXT[1].split()) for i, _ in links)


def test_imported_logits_equal_transformers_on_a_padded_batch(imported):
    _, _, theirs, tokenizer, model, vocab, _ = imported
    _, src = sources(tokenizer, vocab, PROBES)
    tgt_ids = [[vocab.bos_id] + row for row in vocab.encode_target(TARGET_TEXT[: len(PROBES)])]
    tgt = pad_rows(tgt_ids, vocab.pad_id, "cpu")
    with torch.no_grad():
        ours = model(src, tgt)
        expected = theirs(input_ids=src, attention_mask=(src != vocab.pad_id).long(), decoder_input_ids=tgt).logits
    real = tgt != vocab.pad_id
    assert real.sum() > 20
    torch.testing.assert_close(ours[real], expected[real], atol=1e-4, rtol=1e-4)


def test_imported_greedy_and_beam_equal_generate(imported):
    """Greedy and beam 4 with the power length penalty are the same search in both: PAD masked, |Y| counts
    EOS, and at the cap only EOS (ours: max_len_b tokens, then EOS; generate: forced_eos_token_id at
    max_new_tokens = max_len_b + 1). They differ in when beam search stops: generate's default
    early_stopping=False is a heuristic and True stops once 4 hypotheses have ended; "never" runs until no
    open hypothesis can win, which is our rule (an exact search to the cap)."""
    _, _, theirs, tokenizer, model, vocab, name = imported
    _, src = sources(tokenizer, vocab, PROBES)
    cap = 40
    mask = (src != vocab.pad_id).long()
    with torch.no_grad():
        greedy = greedy_search(model, src, max_len_a=0, max_len_b=cap)
        out = theirs.generate(input_ids=src, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=cap + 1,
                              bad_words_ids=[[vocab.pad_id]])
    expected = [[t for t in row[1:].tolist() if t not in (vocab.eos_id, vocab.pad_id)] for row in out]
    assert [h[0].tokens for h in greedy] == expected
    if VARIANTS[name].get("logits_bias", True):  # the EOS bias: some end before the cap, some at it
        assert any(len(h[0].tokens) < cap for h in greedy)
    with torch.no_grad():
        beams = beam_search(model, src, beam=4, lenpen=1.0, lenpen_style="power", max_len_a=0, max_len_b=cap)
        out = theirs.generate(input_ids=src, attention_mask=mask, num_beams=4, do_sample=False, max_new_tokens=cap + 1,
                              length_penalty=1.0, early_stopping="never", bad_words_ids=[[vocab.pad_id]])
    expected = [[t for t in row[1:].tolist() if t not in (vocab.eos_id, vocab.pad_id)] for row in out]
    assert [h[0].tokens for h in beams] == expected


def test_round_trip_import_export_import_reproduces_the_weights(imported, tmp_path):
    _, _, _, _, model, vocab, _ = imported
    marian_interop.export_marian(model, vocab, tmp_path / "exported")
    marian_interop.import_marian(tmp_path / "exported", tmp_path / "again")
    again, again_vocab, _ = marian_interop.load_model(tmp_path / "again")
    assert again.config == model.config
    assert again_vocab.model_proto == vocab.model_proto
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_ctranslate2_int8_export_leaves_the_models_weights_as_they_were(imported, tmp_path):
    """CTranslate2 quantises its spec's arrays in place: they must not be views of the model's tensors."""
    _, _, _, _, model, vocab, _ = imported
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    ct2_export.export_ctranslate2(model, vocab, tmp_path / "ct2-int8", quantization="int8")
    after = model.state_dict()
    assert [name for name in before if not torch.equal(before[name], after[name])] == []


# ---------------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def exported(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported")
    model, vocab, _ = marian_interop.load_model(tiny_run.run_dir)
    marian_interop.export_marian(model, vocab, out / "hf", src_lang="en", tgt_lang="de")
    ct2_export.export_ctranslate2(model, vocab, out / "ct2")
    ct2_export.export_ctranslate2(model, vocab, out / "ct2-int8", quantization="int8")
    source, reference = tiny_run.files("test")
    lines = source.read_text(encoding="utf-8").splitlines()
    refs = reference.read_text(encoding="utf-8").splitlines()
    return out, lines, refs, Translator.load(tiny_run.run_dir, "cpu")


CAP = 40  # tokens before EOS, in every engine: ours max_len_b; generate forces EOS after it; CT2 stops there


def ours(translator, lines, **decode):
    return translator.with_decode(max_len_a=0, max_len_b=CAP, **decode).translate(lines)


def hf_translate(directory: Path, lines, *, beam: int):
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(directory)
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = model.generate(**batch, num_beams=beam, do_sample=False, max_new_tokens=CAP + 1,
                                   forced_eos_token_id=model.config.eos_token_id, length_penalty=1.0,
                                   early_stopping="never")
    return tokenizer.batch_decode(generated, skip_special_tokens=True)


def ct2_translate(directory: Path, vocab, lines, *, beam: int, compute_type: str = "float32",
                  suppress: tuple[str, ...] = ("<pad>", "<s>")):
    translator = ctranslate2.Translator(str(directory), device="cpu", compute_type=compute_type, intra_threads=1)
    pieces = [vocab.pieces(row) for row in vocab.encode(lines)]
    results = translator.translate_batch(pieces, beam_size=beam, length_penalty=1.0, max_decoding_length=CAP,
                                         suppress_sequences=[[token] for token in suppress], patience=4)
    # patience: CTranslate2's default (1) stops once beam_size hypotheses have ended, as generate's
    # early_stopping=True; ours runs on while an open one can win (on a 500-update tiny model: 93 vs 100 of 100).
    sp = spm.SentencePieceProcessor(model_proto=(directory / "target.spm").read_bytes())
    return [sp.decode_pieces(r.hypotheses[0]) for r in results]


@pytest.mark.slow
def test_export_greedy_equals_ours_in_transformers_and_ctranslate2(exported, one_torch_thread):
    out, lines, _, translator = exported
    expected = ours(translator, lines, beam=1, lenpen=0.0)
    assert hf_translate(out / "hf", lines, beam=1) == expected
    assert ct2_translate(out / "ct2", translator.vocab, lines, beam=1) == expected


@pytest.mark.slow
def test_export_beam_with_power_penalty_agrees_on_99_percent(exported, one_torch_thread):
    out, lines, _, translator = exported
    expected = ours(translator, lines, beam=4, lenpen=1.0, lenpen_style="power")
    for got in (hf_translate(out / "hf", lines, beam=4),
                ct2_translate(out / "ct2", translator.vocab, lines, beam=4)):
        same = sum(a == b for a, b in zip(got, expected))
        assert same >= 0.99 * len(lines), f"{same} of {len(lines)} equal"


@pytest.mark.slow
def test_export_int8_ctranslate2_is_within_one_bleu(exported, one_torch_thread):
    import sacrebleu

    out, lines, refs, translator = exported
    ours_bleu = sacrebleu.corpus_bleu(ours(translator, lines, beam=4, lenpen=1.0, lenpen_style="power"), [refs]).score
    int8 = ct2_translate(out / "ct2-int8", translator.vocab, lines, beam=4, compute_type="int8")
    assert abs(sacrebleu.corpus_bleu(int8, [refs]).score - ours_bleu) <= 1.0


@pytest.mark.slow
def test_round_trip_of_a_trained_model_reproduces_its_weights(exported, tmp_path):
    out, _, _, translator = exported
    marian_interop.import_marian(out / "hf", tmp_path / "run")
    again, again_vocab, _ = marian_interop.load_model(tmp_path / "run")
    assert again.config == translator.model.config
    mine, theirs = translator.model.state_dict(), again.state_dict()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine) and mine.keys() == theirs.keys()
    assert again_vocab.model_proto == translator.vocab.model_proto


@pytest.mark.slow
def test_a_pre_norm_model_exports_to_ctranslate2_alone_and_scores_as_ours(tmp_path, spm_models, capsys,
                                                                          one_torch_thread):
    """The students of docs/DISTILLATION.md are pre-norm: MarianMTModel cannot hold them, CTranslate2 can.
    Every weight random (the LayerNorms' too), so a LayerNorm left out or put in the wrong place changes the
    scores; CTranslate2's log-probability of each target token is ours, and its greedy output is ours."""
    model_path = pre_norm_checkpoint(tmp_path, spm_models, randomise=True)
    assert hf.main(["export", str(model_path), "--ctranslate2", str(tmp_path / "ct2")]) == 0, capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
    model, vocab, _ = marian_interop.load_model(model_path)
    src_ids = [row + [vocab.eos_id] for row in vocab.encode(PROBES)]
    tgt_ids = [row + [vocab.eos_id] for row in vocab.encode_target(TARGET_TEXT[: len(PROBES)])]
    with torch.no_grad():
        logits = model(pad_rows(src_ids, vocab.pad_id, "cpu"),
                       pad_rows([[vocab.bos_id] + row[:-1] for row in tgt_ids], vocab.pad_id, "cpu"))
    ours_log_probs = [torch.log_softmax(logits[i, : len(row)].double(), -1)[range(len(row)), row].tolist()
                      for i, row in enumerate(tgt_ids)]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    scored = translator.score_batch([vocab.pieces(row[:-1]) for row in src_ids],
                                    [vocab.pieces(row[:-1]) for row in tgt_ids])
    for theirs, ours_row in zip(scored, ours_log_probs):
        torch.testing.assert_close(torch.tensor(theirs.log_probs, dtype=torch.float64),
                                   torch.tensor(ours_row, dtype=torch.float64), atol=1e-3, rtol=1e-4)
    expected = ours(Translator.load(model_path, "cpu"), PROBES, beam=1, lenpen=0.0)
    assert ct2_translate(tmp_path / "ct2", vocab, PROBES, beam=1, suppress=("<pad>",)) == expected  # Marian ids


def pre_norm_checkpoint(tmp_path: Path, spm_models, *, randomise: bool = False) -> Path:
    """A checkpoint of ours with a pre-norm model (from an imported random Marian model's state)."""
    from transformer import checkpoint as ckpt
    from transformer.model import Transformer, TransformerConfig

    good = write_marian(tmp_path / "good", spm_models, activation="relu", separate_spm=False)
    state = ckpt.load(marian_interop.import_marian(good, tmp_path / "run")[0])
    pre_norm = TransformerConfig(**{**state["model_config"], "norm_first": True})
    torch.manual_seed(0)
    model = Transformer(pre_norm)
    if randomise:
        with torch.no_grad():
            for name, tensor in model.named_parameters():
                is_norm_gain = "norm" in name and name.endswith("weight")
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor) if is_norm_gain else 0.5 * torch.randn_like(tensor))
    ckpt.save({**state, "model_config": dataclasses.asdict(pre_norm), "model": model.state_dict()},
              tmp_path / "pre.pt")
    return tmp_path / "pre.pt"


# ------------------------------------------------------------------------------------------ refusals


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transformer.hf", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


@pytest.mark.slow
def test_cli_refuses_what_it_cannot_represent_in_one_line(tmp_path, spm_models, capsys):
    """The first case through a real `python -m transformer.hf` process, the others through its `main` in this
    process (the same code and stderr, without another start of torch and transformers)."""
    marian = write_marian(tmp_path / "tanh", spm_models, activation="relu", separate_spm=False)
    config = json.loads((marian / "config.json").read_text())
    (marian / "config.json").write_text(json.dumps({**config, "activation_function": "tanh"}))
    bart = tmp_path / "bart"
    bart.mkdir()
    (bart / "config.json").write_text(json.dumps({"model_type": "bart"}))
    pre_norm = pre_norm_checkpoint(tmp_path, spm_models)
    cases = [(("import", str(marian), str(tmp_path / "a")), "activation 'tanh'"),
             (("import", str(bart), str(tmp_path / "b")), "model_type='bart'"),
             (("export", str(pre_norm), str(tmp_path / "c"), "--ctranslate2", str(tmp_path / "d")),
              "MarianMTModel is post-norm only: drop OUT_DIR"),
             (("export", str(pre_norm)), "export writes nothing"),
             (("export", str(pre_norm), str(tmp_path / "e"), "--ctranslate2", str(tmp_path / "e")),
              "each export writes its own config.json")]
    for number, (args, named) in enumerate(cases):
        if number == 0:
            result = cli(*args)
            status, stderr = result.returncode, result.stderr
        else:
            capsys.readouterr()
            status, stderr = hf.main(list(args)), capsys.readouterr().err
        assert status == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], stderr


# ------------------------------------------------------------------------------------------ fine-tuning


@pytest.mark.slow
def test_finetune_an_imported_model_then_translate_it(tmp_path, spm_models, one_torch_thread):
    """train.py init_from=<imported run> with the overrides the import prints, a few updates on the model's
    own kind of text; the run keeps the Marian vocabulary and options, and translate.py uses the result."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import train_main

    import translate
    from transformer import checkpoint as ckpt

    marian = write_marian(tmp_path / "marian", spm_models, activation="swish", separate_spm=True, share=False)
    imported_path, config = marian_interop.import_marian(marian, tmp_path / "imported", src_lang="en", tgt_lang="de")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "valid"):
        (corpus / f"{split}.en").write_text("".join(line + "\n" for line in SOURCE_TEXT * 3))
        (corpus / f"{split}.de").write_text("".join(line + "\n" for line in TARGET_TEXT * 3))
    run_dir = tmp_path / "finetuned"
    overrides = [
        f"run_dir={run_dir}", "device=cpu", "experiment=finetune", f"init_from={tmp_path / 'imported'}",
        "data.dataset=null", f"data.train_prefix={corpus / 'train'}", f"data.valid_prefix={corpus / 'valid'}",
        "data.src_lang=en", "data.tgt_lang=de", "data.num_workers=1", "data.max_len_ratio=null",
        *marian_interop.train_overrides(config).split(),
        "train.max_steps=3", "train.max_tokens=400", "train.tokens_per_update=400", "train.warmup_steps=2",
        "train.save_every_steps=3", "train.valid_every_steps=3", "train.valid_bleu_lines=0", "train.best_metric=loss",
        "train.keep_last=1", "train.average_last=1", "train.log_every_steps=1", "train.save_every_minutes=0",
    ]
    assert train_main(overrides) == 0
    before, after = ckpt.load(imported_path), ckpt.load(ckpt.last_path(run_dir))
    assert after["step"] == 3
    assert after["model_config"] == before["model_config"]  # options and Marian ids carried
    assert torch.equal(after["spm_model"], before["spm_model"])
    assert not torch.equal(after["model"]["target_embedding.weight"], before["model"]["target_embedding.weight"])
    assert torch.equal(after["model"]["logits_bias"], before["model"]["logits_bias"])  # a constant, as in Marian
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in PROBES[:3]))
    assert translate.main([f"checkpoint={run_dir}", f"input={source}", f"output={tmp_path / 'out.txt'}",
                           "device=cpu", "quiet=true", "decode.max_len_b=10"]) == 0
    assert len((tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")) == 4


def test_configs_saved_before_the_marian_options_read_as_the_paper_model():
    """Checkpoints and run configs written before the options existed lack their keys: they load as the
    paper's model, and resuming or init_from compares them without reporting a difference."""
    from transformer.config import ARCH_KEYS, ModelConfig, model_config_with_defaults
    from transformer.model import TransformerConfig
    from transformer.training.start import differences

    old_keys = ("d_model", "heads", "d_ff", "encoder_layers", "decoder_layers", "dropout", "norm_first")
    saved = {key: getattr(ModelConfig(), key) for key in old_keys}
    config = TransformerConfig(vocab_size=100, **saved)
    assert (config.activation, config.attention_bias, config.scale_embedding, config.logits_bias,
            config.shared_embeddings, config.target_vocab_size) == ("relu", False, True, False, True, None)
    current = dataclasses.asdict(ModelConfig())
    assert differences(model_config_with_defaults(saved), current, "model", ARCH_KEYS) == []
    assert differences(saved, current, "model", ARCH_KEYS) != []  # what the defaults fix
