"""Every documented precision path of the CPU, run once: `python tests/precision_paths.py OUT.pt`.

tests/core/test_cpu_capability.py runs this in two subprocesses, one native and one with the CPU capped to AVX2
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`, where oneDNN refuses bf16), and compares what both
wrote: the same paths must work under both and give the same numbers up to each precision's rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from transformer import kernels  # noqa: E402
from transformer.config import DecodeConfig  # noqa: E402
from transformer.loss import label_smoothed_nll  # noqa: E402
from helpers import tiny_model  # noqa: E402
from transformer.decoding.translation import translate_ids  # noqa: E402


def train_update(precision: str) -> dict[str, float]:
    """One update of a tiny model as train.py makes it (autocast, GradScaler for fp16): loss, grad norm."""
    model = tiny_model(random_norms=False).train()
    src = torch.randint(4, 40, (4, 7), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(4, 40, (4, 6), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    # A small initial scale, so that the first fp16 update is not skipped for overflow as train.py's may be.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    kernels.warn_if_emulated(precision)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss, _ = label_smoothed_nll(model(src, tgt[:, :-1]), tgt[:, 1:], epsilon=0.1, ignore_index=0)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    scaler.step(optimizer)
    scaler.update()
    return {"loss": loss.item(), "grad_norm": norm.item()}


def decode(precision: str) -> list[list[int]]:
    """Beam search with the weights in `precision`, as translate.py's decode.precision."""
    model = tiny_model(random_norms=False)
    sources = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    hyps = translate_ids(model, sources, DecodeConfig(beam=2, max_len_a=0, max_len_b=5, precision=precision))
    return [best[0].tokens for best in hyps]


def frozen_linear(dtype: torch.dtype) -> torch.Tensor:
    """A linear map inside `frozen_weights()` (packed weights where oneDNN can pack them)."""
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype), torch.randn(7, 32).to(dtype)
    with torch.no_grad(), kernels.frozen_weights():
        return kernels.linear(x, weight, bias).float()


def main(out: str) -> None:
    torch.set_num_threads(1)
    results = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": kernels.native_bf16(),
        "emulated": {p: kernels.warn_if_emulated(p) for p in ("bf16", "fp16")},
        "train": {p: train_update(p) for p in ("fp32", "bf16", "fp16")},
        "decode": {p: decode(p) for p in ("fp32", "bf16")},
        "linear": {str(d): frozen_linear(d) for d in (torch.float32, torch.bfloat16)},
    }
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
