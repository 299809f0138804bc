"""transformer/kernels.py: each faster CPU kernel against torch's own operation, outputs and gradients."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from transformer import kernels

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def onednn_float32_path(monkeypatch):
    """oneDNN's float32 path on whatever CPU runs the tests (on most CPUs `linear` would not take it)."""
    monkeypatch.setattr(kernels, "ONEDNN_FLOAT32", kernels._ONEDNN_LINEAR is not None)
    monkeypatch.setattr(kernels, "ONEDNN_FLOAT32_INFERENCE", kernels._ONEDNN_LINEAR is not None)


def reference_linear(x, weight, bias):
    """x W^T + b in float64."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_forward_and_backward_match_float64(with_bias):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(24, 16, requires_grad=True)
    bias = torch.randn(24, requires_grad=True) if with_bias else None
    grad = torch.randn(3, 5, 24)
    out = kernels.linear(x, weight, bias)
    inputs = (x, weight) + ((bias,) if with_bias else ())
    grads = torch.autograd.grad(out, inputs, grad)
    x64 = [t.detach().double().requires_grad_() for t in inputs]
    ref = reference_linear(*x64, *([None] if not with_bias else []))
    ref_grads = torch.autograd.grad(ref, x64, grad.double())
    assert (out.double() - ref).abs().max() <= TOL
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_linear_in_a_frozen_weights_block_uses_packed_weights_with_the_same_result(dtype, rows):
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype)
    x = torch.randn(rows, 32).to(dtype)
    with torch.no_grad(), kernels.frozen_weights():
        out = kernels.linear(x, weight, bias)
        if kernels._ONEDNN_PACK is not None and (dtype == torch.float32 or kernels.native_bf16()):
            assert weight in kernels._PACKED.get()  # packed once, reused by the next call in the block
        else:  # no oneDNN, or bf16 on a CPU without native bf16 (AVX2): plain F.linear, nothing packed
            assert weight not in kernels._PACKED.get()
        again = kernels.linear(x, weight, bias)
    assert kernels._PACKED.get() is None  # dropped with the block
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert out.dtype == dtype and (out.double() - reference_linear(x, weight, bias)).abs().max() <= tol
    assert torch.equal(out, again)


@pytest.mark.parametrize("rows", [1, 40])
def test_int8_linear_maps_quantise_each_output_channel_on_its_own(rows):
    """Inside int8_weights, float32 linear maps are int8: close to float64 (error of 8-bit rounding, not
    zero), and one output row a thousand times larger does not coarsen the others (per-channel scales; one
    scale for the whole weight would round the small rows to almost nothing)."""
    if kernels.why_no_int8():
        pytest.skip(kernels.why_no_int8())
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32) * 0.05, torch.randn(48) * 0.1, torch.randn(rows, 3, 32)
    weight[7] *= 1000
    with torch.inference_mode(), kernels.int8_weights():
        out = kernels.linear(x, weight, bias)
        assert len(kernels._INT8.get()) == 1  # quantised once, kept for the block
    assert kernels._INT8.get() is None
    ref = reference_linear(x, weight, bias)
    for keep in (slice(0, 7), slice(8, 48)):  # the ordinary rows
        error = (out[..., keep].double() - ref[..., keep]).norm() / ref[..., keep].norm()
        assert 1e-4 < error < 0.03
    assert out.dtype == torch.float32 and out.shape == (rows, 3, 48)


def test_a_weight_cache_keeps_packed_and_int8_weights_across_blocks_until_a_weight_changes():
    """kernels.WeightCache (a Translator's): the second block reuses what the first packed and quantised; a
    weight changed in place (its version bumped) is packed and quantised again."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32), torch.randn(48), torch.randn(7, 32)
    cache = kernels.WeightCache()
    runs = []
    if kernels.onednn_for_float32(inference=True) and kernels._ONEDNN_PACK is not None:  # else nothing is packed
        runs.append((torch.no_grad, kernels.frozen_weights, cache.packed))
    if not kernels.why_no_int8():
        runs.append((torch.no_grad, kernels.int8_weights, cache.int8))
    if not runs:
        pytest.skip("this CPU packs no float32 weight and has no int8 kernel")
    for no_grad, block, store in runs:
        with no_grad(), block(cache):
            first = kernels.linear(x, weight, bias)
        kept = {key: value[1] for key, value in store.items()}
        assert len(kept) == 1  # kept in the cache when the block ends
        with no_grad(), block(cache):
            again = kernels.linear(x, weight, bias)
        assert torch.equal(first, again) and len(store) == len(kept)
        assert all(store[key][1] is entry for key, entry in kept.items())  # the same objects: not made again
        with torch.no_grad():
            weight.mul_(2.0)
        with no_grad(), block(cache):
            changed = kernels.linear(x, weight, bias)
        assert all(store[key][1] is not entry for key, entry in kept.items())
        assert (changed.double() - reference_linear(x, weight, bias)).abs().max() <= 0.1 * weight.abs().max()


def test_int8_leaves_linear_maps_that_need_gradients_in_float32_and_refuses_without_a_kernel(monkeypatch):
    torch.manual_seed(0)
    weight, x = torch.randn(8, 4, requires_grad=True), torch.randn(2, 4)
    if not kernels.why_no_int8():
        with kernels.int8_weights():  # int8 has no gradient: a map that needs one stays float32
            out = kernels.linear(x, weight)
        assert out.requires_grad and (out.double() - reference_linear(x, weight.detach(), None)).abs().max() <= TOL
    monkeypatch.setattr(kernels, "_INT8_ENGINES", ("armv9",))
    assert "no int8 kernel for this CPU" in kernels.why_no_int8()
    with pytest.raises(RuntimeError, match="no int8 kernel"):
        with kernels.int8_weights():
            pass


def test_weights_changed_by_fused_adam_are_used_after_a_frozen_block():
    """torch's fused Adam updates parameters without bumping their version: packed copies must not outlive
    the block in which weights are frozen (as a validation search between training steps)."""
    torch.manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(8, 4)), torch.randn(2, 4)
    optimizer = torch.optim.Adam([weight], lr=0.5, fused=True)
    with torch.no_grad(), kernels.frozen_weights():
        kernels.linear(x, weight)
    weight.grad = torch.ones(8, 4)
    optimizer.step()
    with torch.no_grad(), kernels.frozen_weights():
        out = kernels.linear(x, weight)
    assert (out.double() - reference_linear(x, weight.detach(), None)).abs().max() <= TOL


@torch.no_grad()
def test_packed_weights_follow_in_place_updates_and_inference_tensors_work():
    torch.manual_seed(0)
    weight, x = torch.randn(8, 4), torch.randn(2, 4)
    with kernels.frozen_weights():
        kernels.linear(x, weight)
        weight.mul_(-2.0)  # an in-place change that bumps the version is caught even inside the block
        assert (kernels.linear(x, weight).double() - reference_linear(x, weight, None)).abs().max() <= TOL
        with torch.inference_mode():
            frozen = torch.randn(8, 4)
            assert (kernels.linear(x, frozen).double() - reference_linear(x, frozen, None)).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal", "keys"])
def test_cpu_attention_kernel_matches_torch_sdpa_forward_and_backward(dtype, mask):
    """transformer.kernels' CPU matmul attention against torch's own fused kernel, outputs and gradients."""
    torch.manual_seed(0)
    b, h, t, dh = 3, 2, 6, 8
    q, k, v = (torch.randn(b, h, t, dh, dtype=dtype, requires_grad=True) for _ in range(3))
    key_mask = (torch.arange(t)[None, :] < torch.tensor([6, 4, 1])[:, None])[:, None, None, :]  # [B, 1, 1, T]
    options = {"none": {}, "causal": {"is_causal": True}, "keys": {"attn_mask": key_mask}}[mask]
    grad = torch.randn(b, h, t, dh, dtype=dtype)
    results = []
    for kernel in (kernels.scaled_dot_product_attention, F.scaled_dot_product_attention):
        out = kernel(q, k, v, **options)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    tol = TOL if dtype == torch.float32 else 0.05
    for ours, torchs in zip(*results):
        assert ours.dtype == dtype and (ours.float() - torchs.float()).abs().max() <= tol


def test_cpu_attention_kernel_scores_bf16_in_float32_and_follows_torchs_causal_rule():
    torch.manual_seed(0)
    q, k, v = (3 * torch.randn(8, 8, 32, 64).bfloat16() for _ in range(3))  # large scores: rounding them shows
    exact = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 8, dim=-1) @ v.double()
    ours, torchs = (kernel(q, k, v) for kernel in (kernels.scaled_dot_product_attention,
                                                   F.scaled_dot_product_attention))
    ours_error, torch_error = ((x.double() - exact).abs().max().item() for x in (ours, torchs))
    assert ours_error <= 2 * torch_error, (ours_error, torch_error)  # bf16 scores: 9x torch's error
    q = torch.randn(2, 2, 3, 8)  # Tq < Tk: torch's causal mask is top-left aligned (query i sees keys <= i)
    k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (kernels.scaled_dot_product_attention(q, k, v, is_causal=True) - expected).abs().max() <= TOL
    with pytest.raises(ValueError, match="either attn_mask or is_causal"):
        kernels.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 6, dtype=torch.bool), is_causal=True)


def test_packed_weights_are_not_seen_by_another_thread():
    import threading

    seen = []
    with kernels.frozen_weights():
        thread = threading.Thread(target=lambda: seen.append(kernels._PACKED.get()))
        thread.start()
        thread.join()
        assert kernels._PACKED.get() is not None
    assert seen == [None]


def test_keep_freed_memory_applies_its_malloc_settings_on_glibc():
    import platform

    applied = kernels.keep_freed_memory()
    assert applied == (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert kernels.keep_freed_memory() == applied  # calling it again (a second entry point) is harmless


@pytest.mark.parametrize(("vendor", "capability", "override", "training", "inference"), [
    ("AuthenticAMD", "AVX512", "auto", True, True),    # MKL would run its AVX2 code: oneDNN, 2.2x faster
    ("AuthenticAMD", "AVX2", "auto", False, True),     # an AVX2-only EPYC: level in training, oneDNN decodes faster
    ("GenuineIntel", "AVX512", "auto", False, False),  # MKL's own AVX-512/AMX code: MKL faster
    ("GenuineIntel", "AVX2", "auto", False, False),
    ("", "DEFAULT", "auto", False, False),             # unknown CPU (e.g. ARM): plain PyTorch
    ("GenuineIntel", "AVX512", "onednn", True, True),  # the override wins either way
    ("AuthenticAMD", "AVX2", "plain", False, False),
])
def test_float32_kernel_is_chosen_by_vendor_isa_and_use(vendor, capability, override, training, inference):
    assert kernels.choose_float32_kernel(vendor, capability, override) is training
    assert kernels.choose_float32_kernel(vendor, capability, override, inference=True) is inference


def test_decoding_and_training_each_take_their_own_kernel(monkeypatch):
    """linear() asks for the inference choice without autograd and the training choice with it."""
    if kernels._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear kernel")
    calls = []
    monkeypatch.setattr(kernels, "_onednn", lambda x, w, b: calls.append("oneDNN") or F.linear(x, w, b))
    monkeypatch.setattr(kernels, "ONEDNN_FLOAT32", False)
    monkeypatch.setattr(kernels, "ONEDNN_FLOAT32_INFERENCE", True)
    x, weight = torch.randn(2, 3), torch.randn(4, 3, requires_grad=True)
    kernels.linear(x, weight).sum().backward()
    assert calls == []
    with torch.no_grad():
        kernels.linear(x, weight)
    assert calls == ["oneDNN"]


def test_a_wrong_kernel_override_is_one_line_naming_the_choices():
    from transformer.config import ConfigError

    with pytest.raises(ConfigError, match=r"TRANSFORMER_CPU_LINEAR='mkl' .*auto, onednn or plain"):
        kernels.choose_float32_kernel("GenuineIntel", "AVX512", "mkl")


@pytest.mark.parametrize(("cap", "override"), [
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "auto"), ({"ATEN_CPU_CAPABILITY": "avx2"}, "onednn"), ({}, "plain"), ({}, "auto"),
])
def test_the_process_reads_its_cpu_and_override_once(cap, override):
    """A fresh process decides from this CPU (capped to AVX2 or not) and TRANSFORMER_CPU_LINEAR, for training
    (a linear map under autograd) and for inference."""
    import subprocess
    import sys

    if kernels._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear kernel")
    code = ("import torch; from transformer import kernels\n"
            "kernels.linear(torch.ones(2, 3), torch.ones(4, 3, requires_grad=True))\n"
            "kernels.linear(torch.ones(2, 3), torch.ones(4, 3))\n"
            "print(kernels.ONEDNN_FLOAT32, kernels.ONEDNN_FLOAT32_INFERENCE, kernels.cpu_vendor(),"
            " torch.backends.cpu.get_cpu_capability())")
    env = {"PATH": "/usr/bin:/bin", "TRANSFORMER_CPU_LINEAR": override, **cap}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True, cwd=Path(__file__).resolve().parents[2]).stdout.split()
    if override == "auto":  # this machine's own rule (capped: its vendor with AVX2)
        expected = [kernels.choose_float32_kernel(out[2], out[3], inference=use) for use in (False, True)]
    else:
        expected = [override == "onednn"] * 2
    assert out[:2] == [str(choice) for choice in expected]
    if cap:
        assert out[3] == "AVX2"
