"""Our models as CTranslate2 models, built with CTranslate2's own `ctranslate2.specs` (a TransformerSpec with
our start token, our sinusoid table and our vocabulary) and saved by the spec's writer; not through
ct2-transformers-converter, whose Marian loader starts the decoder from a zero embedding and drops the last
vocabulary row. The command line is `python -m transformer.hf export ... --ctranslate2 DIR` (transformer/hf.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.vocab import MarianVocab, Vocab
from transformer.interop.marian import MAX_POSITIONS, refuse_table3_variants
from transformer.model import Transformer, sinusoids

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def vocabulary_tokens(vocab: Vocab | MarianVocab) -> tuple[list[str], list[str]]:
    """The token strings of the source and target ids, as CTranslate2 names tokens."""
    if isinstance(vocab, MarianVocab):
        return list(vocab.source_pieces), list(vocab.target_pieces)
    pieces = vocab.pieces(range(vocab.size))
    return pieces, list(pieces)



def ctranslate2_spec(model: Transformer, source: list[str], target: list[str], *,
                     max_positions: int = MAX_POSITIONS):
    """A CTranslate2 `TransformerSpec` of `model` with these token strings for the source and target ids:
    its layers post-norm or pre-norm (with the stacks' final LayerNorms) as the model's, our sinusoid table, our
    start token (bos_id), sources ended by EOS automatically."""
    config = model.config
    refuse_table3_variants(config, "CTranslate2")
    from ctranslate2.specs import common_spec, transformer_spec

    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
                  "swish": common_spec.Activation.SWISH}[config.activation]
    encoder = transformer_spec.TransformerEncoderSpec(config.encoder_layers, config.heads,
                                                      pre_norm=config.norm_first, activation=activation)
    decoder = transformer_spec.TransformerDecoderSpec(config.decoder_layers, config.heads,
                                                      pre_norm=config.norm_first, activation=activation)

    def array(tensor: torch.Tensor):  # a copy: CTranslate2 quantises the spec's arrays in place
        return tensor.detach().to("cpu", torch.float32, memory_format=torch.contiguous_format, copy=True).numpy()

    def linear(spec, layer) -> None:
        spec.weight = array(layer.weight)
        if layer.bias is not None:
            spec.bias = array(layer.bias)

    def norm(spec, layer) -> None:
        spec.gamma, spec.beta = array(layer.weight), array(layer.bias)

    def ffn(spec, layer) -> None:
        linear(spec.linear_0, layer.ffn.w1)
        linear(spec.linear_1, layer.ffn.w2)
        norm(spec.layer_norm, layer.ffn_norm)

    if config.norm_first:  # pre-norm: each stack ends with a LayerNorm (transformer/model.py)
        norm(encoder.layer_norm, model.encoder.final_norm)
        norm(decoder.layer_norm, model.decoder.final_norm)
    table = array(sinusoids(max_positions, config.d_model))
    for stack_spec, embedding in ((encoder, model.embedding), (decoder, model.output_embedding)):
        stack_spec.scale_embeddings = config.scale_embedding
        stack_spec.position_encodings.encodings = table
    encoder.embeddings[0].weight = array(model.embedding.weight)
    for spec, layer in zip(encoder.layer, model.encoder.layers):
        linear(spec.self_attention.linear[0], layer.self_attn.in_proj)
        linear(spec.self_attention.linear[1], layer.self_attn.out_proj)
        norm(spec.self_attention.layer_norm, layer.self_attn_norm)
        ffn(spec.ffn, layer)
    decoder.embeddings.weight = array(model.output_embedding.weight)
    decoder.projection.weight = decoder.embeddings.weight
    if model.logits_bias is not None:
        decoder.projection.bias = array(model.logits_bias)
    decoder.start_from_zero_embedding = False
    for spec, layer in zip(decoder.layer, model.decoder.layers):
        linear(spec.self_attention.linear[0], layer.self_attn.in_proj)
        linear(spec.self_attention.linear[1], layer.self_attn.out_proj)
        norm(spec.self_attention.layer_norm, layer.self_attn_norm)
        linear(spec.attention.linear[0], layer.cross_attn.q_proj)
        linear(spec.attention.linear[1], layer.cross_attn.kv_proj)
        linear(spec.attention.linear[2], layer.cross_attn.out_proj)
        norm(spec.attention.layer_norm, layer.cross_attn_norm)
        ffn(spec.ffn, layer)

    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.register_source_vocabulary(list(source))
    spec.register_target_vocabulary(list(target))
    spec.config.unk_token, spec.config.eos_token = target[config.unk_id], target[config.eos_id]
    spec.config.bos_token = spec.config.decoder_start_token = target[config.bos_id]
    spec.config.add_source_eos = True  # sources are given as pieces; EOS ends them, as ours do
    spec.config.layer_norm_epsilon = model.encoder.layers[0].self_attn_norm.eps
    return spec



def save_ctranslate2(spec, out_dir: str | Path, *, quantization: str | None = None) -> Path:
    """Validate, quantize (None: float32) and write a CTranslate2 spec with CTranslate2's own writer."""
    out_dir = Path(out_dir)
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    return out_dir



def export_ctranslate2(model: Transformer, vocab: Vocab | MarianVocab, out_dir: str | Path, *,
                       quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory (its own writer), with the SentencePiece models beside it."""
    out_dir = save_ctranslate2(ctranslate2_spec(model, *vocabulary_tokens(vocab)), out_dir,
                               quantization=quantization)
    source, target = ((vocab.source_spm, vocab.target_spm) if isinstance(vocab, MarianVocab)
                      else (vocab.model_proto, vocab.model_proto))
    (out_dir / "source.spm").write_bytes(source)
    (out_dir / "target.spm").write_bytes(target)
    return out_dir
