"""Faster CPU kernels for the two operations of the model that dominate its time on CPU.

- `linear` / `Linear`: linear maps, y = x W^T + b as `nn.Linear`; float32 ones computed by oneDNN on AMD
  CPUs with AVX-512 and by MKL (F.linear) elsewhere (`choose_float32_kernel`: whichever was faster on each
  kind of CPU); without autograd also bf16 ones, from weights packed for oneDNN inside `frozen_weights()`
  (per block, or once for a model whose weights do not change, with a `WeightCache`: a Translator's).
- `scaled_dot_product_attention`: `F.scaled_dot_product_attention`, computed on CPU as matmul, softmax,
  matmul instead of by torch's CPU flash-attention kernel.
- `int8_weights` / `why_no_int8`: int8 linear maps for decoding on CPU (`decode.precision=int8`): weights
  quantised per output channel once per block, activations per call, by PyTorch's own quantized kernels.
- `keep_freed_memory`: glibc malloc settings that reuse freed memory instead of returning it to the OS.
- `native_bf16` / `warn_if_emulated`: whether this CPU computes bf16 (and fp16) in hardware; where it does
  not (AVX2-only CPUs), reduced precision runs on plain PyTorch ops, emulated, with one warning.

Kept apart from model.py so that the model reads as the paper; model.py uses `Linear` where it would use
`nn.Linear` (same parameters, same state_dict keys).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import os
import platform
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger(__name__)


def _onednn_linear_op():
    """oneDNN's dense linear kernel, or None where this torch build has none."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


_ONEDNN_LINEAR = _onednn_linear_op()
_ONEDNN_PACK = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)


def choose_float32_kernel(vendor: str, capability: str, override: str = "auto", *, inference: bool = False) -> bool:
    """Whether float32 linear maps go to oneDNN (True) or to F.linear, i.e. MKL's sgemm (False), on a CPU of
    this vendor (/proc/cpuinfo's vendor_id) and torch CPU capability ("AVX512", "AVX2", ...).

    oneDNN on AMD CPUs with AVX-512: MKL runs its AVX-512 code on Intel CPUs only, so on an AMD CPU with
    AVX-512 its sgemm leaves half the vector width unused, and oneDNN was about twice as fast there. On an
    AVX2-only AMD EPYC the two were level in training, and oneDNN with packed weights faster in decoding
    (`inference`: no autograd), as CTranslate2 also picks oneDNN on AMD CPUs; on an Intel Xeon with AVX-512 and
    AMX MKL was faster at the model's shapes (docs/BENCHMARKS.md, 'Kernel choice', has the measurements). A
    rule, not a timing at start, so every rank and every run on a machine computes with the same kernels.
    `override` (TRANSFORMER_CPU_LINEAR) is auto | onednn | plain, for training and inference alike.
    """
    if override not in ("auto", "onednn", "plain"):
        from transformer.config import ConfigError  # here: only a wrong override needs it

        raise ConfigError(f"TRANSFORMER_CPU_LINEAR={override!r} is not a kernel choice: "
                          "set it to auto, onednn or plain, or unset it")
    if override != "auto":
        return override == "onednn"
    return "AMD" in vendor.upper() and (capability.startswith("AVX512") or inference)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (Linux: /proc/cpuinfo's vendor_id, e.g. AuthenticAMD, GenuineIntel; elsewhere
    what `platform.processor()` says, which names the vendor on Windows); "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# Decided by `onednn_for_float32` at first use, for training and for inference; a test or benchmark may set them.
ONEDNN_FLOAT32: bool | None = None
ONEDNN_FLOAT32_INFERENCE: bool | None = None


def onednn_for_float32(inference: bool = False) -> bool:
    """This machine's float32 kernel choice (`choose_float32_kernel`) for training or inference, decided once a
    process."""
    global ONEDNN_FLOAT32, ONEDNN_FLOAT32_INFERENCE

    def choice(inference: bool) -> bool:
        return _ONEDNN_LINEAR is not None and choose_float32_kernel(
            cpu_vendor(), torch.backends.cpu.get_cpu_capability(), os.environ.get("TRANSFORMER_CPU_LINEAR", "auto"),
            inference=inference)

    if ONEDNN_FLOAT32 is None:
        ONEDNN_FLOAT32 = choice(inference=False)
    if ONEDNN_FLOAT32_INFERENCE is None:
        ONEDNN_FLOAT32_INFERENCE = choice(inference=True)
    return ONEDNN_FLOAT32_INFERENCE if inference else ONEDNN_FLOAT32


@functools.cache
def native_bf16() -> bool:
    """Whether oneDNN computes bfloat16 on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX).

    On AVX2-only CPUs oneDNN refuses bf16 primitives (packing a weight, a linear map), so there bf16 goes
    to F.linear and friends, which emulate it with float32 arithmetic. torch's check follows oneDNN's ISA
    cap (`ONEDNN_MAX_CPU_ISA=AVX2`), so a capped process takes the AVX2 path on any CPU; the tests use that.
    """
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


@functools.cache
def native_fp16() -> bool:
    """Whether oneDNN computes float16 on this CPU (AVX-512 FP16 or AMX-FP16); elsewhere it is emulated."""
    check = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_fp16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def warn_if_emulated(precision: str, device_type: str = "cpu") -> bool:
    """Log one warning (once a process), and return True, where `precision` ("bf16" | "fp16") on
    `device_type` is emulated: on a CPU without native kernels, or bf16 on a GPU before Ampere.

    Emulated reduced precision gives the same results as native, only several times slower (issue #19;
    docs/BENCHMARKS.md, 'Emulated bf16 and fp16').
    """
    if device_type == "cuda" and precision == "bf16" and not _cuda_native_bf16():
        _warn_emulated_on_gpu(torch.cuda.get_device_name())
        return True
    if device_type != "cpu" or precision not in ("bf16", "fp16"):
        return False
    if native_bf16() if precision == "bf16" else native_fp16():
        return False
    _warn_emulated(precision)
    return True


def _cuda_native_bf16() -> bool:
    """Whether the current GPU computes bf16 in hardware (Ampere and later); before it, torch emulates it."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # a torch without the keyword
        return torch.cuda.get_device_capability() >= (8, 0)


@functools.cache  # once a process and GPU
def _warn_emulated_on_gpu(name: str) -> None:
    log.warning("bf16 on this GPU (%s, before Ampere: no bf16 tensor cores) is emulated and slow; "
                "train.precision=fp16 (with its loss scaling) or fp32 is the fast choice here", name)


@functools.cache  # once a process and precision
def _warn_emulated(precision: str) -> None:
    log.warning("%s on this CPU (%s, no native %s kernels) is emulated with float32 arithmetic: expect it "
                "to be about 15× slower than fp32 (a bf16 training update took ~75 s against ~5 s in fp32 on an "
                "AVX2-only AMD EPYC; docs/BENCHMARKS.md, 'Emulated bf16 and fp16'); precision=fp32 is the fast "
                "choice here",
                precision, torch.backends.cpu.get_cpu_capability(), precision)

# Inside `frozen_weights()`: weight -> ((version, data pointer) it was packed from, the packed weight). A
# context variable, so that another thread (or asyncio task) outside the block never sees packed weights.
_PACKED: contextvars.ContextVar[WeakIdKeyDictionary | None] = contextvars.ContextVar("packed", default=None)


@dataclass
class WeightCache:
    """The packed (and int8) weights of a model whose weights do not change between blocks, such as a
    Translator's: given to `frozen_weights` / `int8_weights`, each weight is packed or quantised once, not
    once per block (interactive translation opens a block per line). A weight changed in place with its version
    counter bumped is packed again; one changed without (torch's fused Adam) needs a new cache."""

    packed: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    int8: dict = field(default_factory=dict)


@contextlib.contextmanager
def frozen_weights(cache: WeightCache | None = None):
    """A block in which weights do not change (search, translation): CPU linear maps without autograd use
    each weight packed into oneDNN's blocked layout, made on first use and dropped when the block ends (kept
    in `cache` instead, where one is given).

    Unpacked, oneDNN reorders the weight on every call; packed, it does not, and decoding is a few per
    cent faster (docs/BENCHMARKS.md, 'Packed weights'). The block is needed because a weight can change
    without any sign on the tensor: torch's fused Adam updates parameters in place without bumping their
    version counter. Nested blocks share the outer one's packed weights.
    """
    if _PACKED.get() is not None:
        yield
        return
    token = _PACKED.set(WeakIdKeyDictionary() if cache is None else cache.packed)
    try:
        yield
    finally:
        _PACKED.reset(token)


# Inside `int8_weights()`: (weight, bias) -> (what they were quantised from, the packed int8 parameters).
_INT8: contextvars.ContextVar[dict | None] = contextvars.ContextVar("int8", default=None)
_INT8_ENGINES = ("x86", "fbgemm", "onednn")  # quantized CPU engines with int8 GEMM for x86 (not qnnpack's ARM one)


def why_no_int8() -> str:
    """Why int8 decoding cannot run on this CPU ("" where it can): torch's quantized linear kernels need one
    of its x86 engines (fbgemm / x86 / onednn)."""
    engines = torch.backends.quantized.supported_engines
    if not any(engine in engines for engine in _INT8_ENGINES):
        return (f"this torch build has no int8 kernel for this CPU (quantized engines: {', '.join(engines) or 'none'}; "
                f"needs one of {', '.join(_INT8_ENGINES)})")
    return ""


@functools.cache
def _int8_reduce_range() -> bool:
    """Quantise activations to 7 bits where the CPU lacks VNNI: fbgemm's AVX2/AVX-512 path without it adds
    pairs of u8×s8 products in 16 bits, which 8-bit activations can overflow (torch's quantize_dynamic does
    the same on x86)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


@contextlib.contextmanager
def int8_weights(cache: WeightCache | None = None):
    """A block in which CPU linear maps without autograd are int8: each weight is quantised once a block (or
    once a `cache`), per output channel (symmetric, scale = max |w| / 127 of its row), into torch's packed int8
    layout; each call quantises its input per tensor and multiplies in int8
    (`torch.ops.quantized.linear_dynamic`), as CTranslate2's int8 does. Outputs are float32. Like
    `frozen_weights`, the weights must not change inside the block."""
    reason = why_no_int8()
    if reason:
        raise RuntimeError(reason)
    if _INT8.get() is not None:
        yield
        return
    token = _INT8.set({} if cache is None else cache.int8)
    try:
        with frozen_weights(cache):
            yield
    finally:
        _INT8.reset(token)


def _int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: dict) -> Tensor:
    """x @ weight^T + bias in int8, the weight quantised on first use in the block or the cache (`int8_weights`)."""
    key = (id(weight), id(bias))  # the entry holds both tensors, so neither id is reused while it lives
    made_from = (weight._version, weight.data_ptr()) + ((bias._version, bias.data_ptr()) if bias is not None else ())
    entry = packed.get(key)
    if entry is None or entry[0] != made_from:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # [O]: each output row its own scale
        with warnings.catch_warnings():  # torch 2.13 calls quantized tensors deprecated; its int8 GEMM needs one
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        params = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())
        entry = packed[key] = (made_from, params, weight, bias)
    return torch.ops.quantized.linear_dynamic(x, entry[1], _int8_reduce_range())


def _packed(weight: Tensor) -> Tensor:
    """Inside `frozen_weights()`, the weight packed once and reused; elsewhere the weight itself."""
    packed = _PACKED.get()
    if packed is None or _ONEDNN_PACK is None or weight.is_inference():  # inference tensors: no version
        return weight
    if weight.dtype == torch.bfloat16 and not native_bf16():
        return weight
    made_from = (weight._version, weight.data_ptr())  # a guard against in-place changes that do count
    entry = packed.get(weight)
    if entry is None or entry[0] != made_from:
        entry = (made_from, _ONEDNN_PACK(weight, None))
        packed[weight] = entry
    return entry[1]


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., I] @ weight[O, I]^T (+ bias [O]) -> [..., O]; strided (transposed) operands are read in place."""
    return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with all three matmuls of training in oneDNN: dX = dY W, dW = dY^T X, db = Σ dY."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)  # [..., O] @ [O, I] -> [..., I]
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [N, O]
        if ctx.needs_input_grad[1]:
            grad_w = _onednn(grad_2d.t(), x.reshape(-1, x.shape[-1]).t(), None)  # [O, N] @ [N, I] -> [O, I]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_2d.sum(dim=0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), with float32 on CPU computed by oneDNN instead of the BLAS behind F.linear.

    Why: torch's CPU builds send float32 F.linear to MKL, whose sgemm runs its AVX2 code on AMD CPUs;
    on an AMD CPU with AVX-512, oneDNN uses AVX-512 and is faster in all three matmuls of a training step
    (docs/BENCHMARKS.md, 'Where our speed comes from'); on an AVX2-only AMD CPU it is in decoding (without
    autograd) only; elsewhere it is not, and float32 stays with F.linear (`onednn_for_float32`). Same maths;
    only the rounding of the sums may differ (~1e-6 relative), as between thread counts. Without autograd,
    float32 (where oneDNN is the choice) and bfloat16 go to oneDNN, with packed weights inside
    `frozen_weights()`; inside `int8_weights()`, float32 ones are int8. Everything else (GPU, autocast, fp16,
    bf16 with autograd, torch.compile, a torch without the kernel, bf16 on a CPU without native bf16) goes to
    F.linear.
    """
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        # before the context variable below: dynamo cannot trace ContextVar.get, and would cut the compiled
        # graph at every linear map (tests/training/test_compile.py counts one graph)
        return F.linear(x, weight, bias)
    int8 = _INT8.get()
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    if int8 is not None and x.dtype == torch.float32 and not needs_grad:
        return _int8_linear(x, weight, bias, int8)
    if (_ONEDNN_LINEAR is None or x.dtype != weight.dtype
            or x.dtype not in (torch.float32, torch.bfloat16) or torch.is_autocast_enabled("cpu")
            or (x.dtype == torch.bfloat16 and not native_bf16())
            or (x.dtype == torch.float32 and not onednn_for_float32(inference=not needs_grad))):
        return F.linear(x, weight, bias)
    if needs_grad:
        if x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        return _OneDNNLinear.apply(x, weight, bias)
    return _onednn(x, _packed(weight), bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state_dict keys) computed by `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 is_causal: bool = False, dropout_p: float = 0.0) -> Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal), scale 1/sqrt(Dk).

    q: [.., Tq, Dk], k: [.., Tk, Dk], v: [.., Tk, Dv] -> [.., Tq, Dv]; Dv may differ from Dk (Table 3 row
    (B)), and the scale is read from q, as torch's kernels read it. On CPU it is computed as
    softmax(Q K^T / sqrt(Dk)) V with two batched matmuls; the scores and the softmax are float32 (float64
    for float64 inputs), as in torch's fused kernels, and only the weights are cast back for the product
    with V. Why: for the short sequences of translation, torch's CPU
    flash-attention kernel is slower, most of all in bf16 training (float32 about level) and for the one or
    few queries of a decoding step (docs/BENCHMARKS.md, 'Where our speed comes from'). The scores
    [.., Tq, Tk] are materialised, which is fine at sentence lengths. GPUs keep the fused kernels (flash /
    memory-efficient attention).
    Unlike torch's kernels, a query row with no key allowed gives NaN (`attention` never builds one).
    """
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
    if is_causal and attn_mask is not None:
        raise ValueError("pass either attn_mask or is_causal=True, as F.scaled_dot_product_attention wants")
    score_dtype = torch.promote_types(q.dtype, torch.float32)
    # Reduced-precision K is read as float32: exact scores, and a contiguous copy (bf16 batched matmuls
    # are several times slower on a strided K such as the time-major decoder cache; float32 ones read it
    # in place: docs/BENCHMARKS.md, 'Strided keys in bf16').
    scores = torch.matmul(q.to(score_dtype), k.to(score_dtype).transpose(-2, -1)) * q.shape[-1] ** -0.5
    if is_causal:  # query i sees keys 0..i (top-left aligned, as torch's)
        tq, tk = scores.shape[-2:]
        attn_mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = scores.softmax(dim=-1)
    if dropout_p:  # as torch's kernels: weights dropped and the rest scaled by 1 / (1 - p)
        weights = F.dropout(weights, p=dropout_p)
    return torch.matmul(weights.to(v.dtype), v)  # [.., Tq, Dv]


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse; True where that was done (Linux with glibc).

    Decoding and training allocate and free tensors of several MB many times a second (activations, the
    decoder cache, [rows, vocabulary] logits). By default glibc serves large requests with fresh mmap'd
    pages and trims freed heap memory back to the OS, so the OS must supply, and zero, those pages again
    and again. Here: requests up to 32 MB come from the heap, and up to 1 GB of freed heap is kept, which
    makes beam-4 decoding faster (docs/BENCHMARKS.md, 'Where our speed comes from'). The process's memory
    then stays near its peak instead of shrinking between steps. Process-wide: the entry points (train.py,
    translate.py, evaluate.py, benchmarks/) call it once at start; LD_PRELOAD'ing jemalloc or tcmalloc is
    the usual alternative, which this leaves alone.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # <malloc.h>
    settings = ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 30), (m_top_pad, 256 << 20))
    return all(libc.mallopt(option, value) == 1 for option, value in settings)
