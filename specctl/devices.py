"""The recipe's `device: auto` and `dtype: auto`, resolved in one place for every stage.

`auto` = CUDA when a GPU is visible (bf16 there), else CPU (fp32: CPU bf16 matmuls are slow and
lossy for the small models that run there). Training, the HF verifier and the vLLM verifier all
ask here, so the stages never disagree about where a recipe runs.
"""

from __future__ import annotations

import torch


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
