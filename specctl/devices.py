"""Where a stage runs and in what dtype: the recipe's `auto` values, resolved in one place.

`device: auto` = CUDA when a GPU is visible, else CPU. The verifier's `dtype: auto` = bf16 on
CUDA, float32 on the CPU: the embedded engine's greedy output must equal plain decoding token for
token, and a bf16 forward over K+1 tokens rounds differently from K+1 one-token forwards.

Training's `precision: auto` is another matter (`compute_dtype`): bf16 autocast keeps float32
master weights, norms and softmaxes and only runs the matmuls in bf16, which on a CPU with native
bf16 (AVX512-BF16, AMX) is several times faster. Measured on this project's 2-core CPU machine
(an Intel Xeon with AMX): a bf16 [1024, 576] x [576, 1536] product 6-7x faster than float32, a
DFlash training step at the quickstart shapes 1.5x (docs/performance.md). A CPU without bf16
instructions would emulate them, so there `auto` stays in float32. Training, the HF verifier and
the vLLM verifier all ask here, so the stages never disagree about where a recipe runs.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("auto", "float32", "bfloat16")


def resolve_device(device: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; anything else is a torch device name."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on CUDA, float32 elsewhere; anything else is a torch dtype name."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


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
