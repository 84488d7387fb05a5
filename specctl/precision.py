"""The dtype training computes in: bfloat16 autocast where the hardware multiplies bf16 natively.

Drafter training is matmul-bound. bf16 autocast runs the matmuls in bfloat16 with float32
accumulation and keeps the float32 master weights, the norms and the softmaxes in float32
(PyTorch's autocast op lists). Measured on this project's 2-core CPU machine (Intel Xeon with
AMX): a [1024, 576] x [576, 1536] product is 6-7x faster in bf16 than in float32; a DFlash
training step at the quickstart shapes 1.45x (docs/performance.md). A CPU without bf16
instructions would emulate them, so there `auto` stays in float32.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "float32", "bfloat16")


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles (what oneDNN's bf16 matmuls use), as PyTorch reports them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    except RuntimeError:  # a PyTorch built without the CPU capability probes
        return False


def compute_dtype(device: torch.device, precision: str) -> torch.dtype:
    """`train.precision` resolved for a device: auto = bfloat16 on CUDA and on CPUs with native
    bf16 matmuls, float32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16" or device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` (no-op for float32). Re-enterable: validate and every step
    enter the same object."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
