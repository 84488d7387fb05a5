"""The embedded engine's linear kernel: F.linear, or oneDNN with each weight reordered once.

A decode step multiplies one row (plain decoding) or K+1 rows (a verify) by every weight matrix,
so it reads the weights and does little else. F.linear hands that to MKL, which on a CPU without
native bf16 (an AVX2-only AMD EPYC, float32) reads a one-row product at about 15 GB/s and packs the
weight again on every call from two rows up: one verifier forward over 2 new tokens cost 1.6x one
token there. oneDNN with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
inductor's CPU path for frozen weights) did the same products 2.0x faster at one row and 2.8x at
two to four (docs/performance.md, `python -m benchmarks.perf --only verify`). Where bf16 is native
the picture differs: F.linear is already flat up to 16 rows there, and the reordered kernel, 1.2x
faster for plain decoding, made EAGLE-3's speedup smaller and rounded the bf16 verifier's near-ties
differently. Hence `auto` = reordered where the engine computes in float32 on a CPU, F.linear
elsewhere, and every forward of a run (plain decoding, verification, the drafters) uses the same
kernel, so a speedup compares like with like.

The ops are private (torch.ops.mkldnn, what torch.compile's CPU backend emits), so `auto` falls
back to F.linear where this torch build lacks them, and tests/test_kernels.py checks the products
against F.linear on every run.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from specctl.errors import UsageError
from specctl.recipe import LinearKernel

PREPACKED = "onednn-prepacked"
TORCH = "torch"


@functools.cache
def onednn_prepack_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can reorder a `dtype` weight here: the build has the private ops, and (bf16)
    the CPU has what their bf16 path needs (an AVX2-only one refuses: "bf16 path needs the cpu
    support avx_ne_convert or avx512bw, avx512vl and avx512dq"). Probed once with a 1x1 weight."""
    ops = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not hasattr(ops, "_reorder_linear_weight"):
        return False
    try:
        ops._linear_pointwise(
            torch.ones(1, 1, dtype=dtype),
            ops._reorder_linear_weight(torch.ones(1, 1, dtype=dtype), None),
            None,
            "none",
            [],
            "",
        )
    except RuntimeError:
        return False
    return True


def resolve_kernel(kernel: LinearKernel, device: torch.device, dtype: torch.dtype) -> str:
    """`torch` or `onednn-prepacked` for an engine on `device` computing in `dtype`.

    auto: prepacked for float32 on a CPU (2x faster at 1-4 rows on an AVX2-only EPYC; on a Xeon
    with AMX, timed alone, no faster), F.linear for every other case. An explicit `onednn-prepacked`
    that cannot run here is an error, not a silent fallback: the report would name a kernel that
    did not run.
    """
    if kernel == TORCH:
        return TORCH
    usable = (
        device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and onednn_prepack_available(dtype)
    )
    if kernel == PREPACKED:
        if not usable:
            raise UsageError(
                f"bench.linear_kernel {PREPACKED}: needs a CPU device, float32 (or bfloat16 where the CPU "
                f"has oneDNN's bf16 path) and a torch build with oneDNN; got {device.type}, "
                f"{str(dtype).removeprefix('torch.')}: use `auto` or `torch`"
            )
        return PREPACKED
    return PREPACKED if usable and dtype == torch.float32 else TORCH


class PrepackedLinear(nn.Module):
    """nn.Linear's product through oneDNN with the weight reordered once, at construction.

    `weight` and `bias` stay the original parameters (same state-dict names as nn.Linear; a tied
    embedding, or a drafter reading `lm_head.weight`, still sees them), so the reorder costs one
    extra copy of the weights, and it is taken once: change `weight` afterwards and the product
    does not follow (inference only).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            # a plain attribute, not a buffer: it is no part of the model's state
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear inside `model` by a PrepackedLinear, in place; how many it replaced."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in targets:
        setattr(parent, name, PrepackedLinear(child))
    return len(targets)


def apply_kernel(model: nn.Module, kernel: LinearKernel) -> str:
    """Put `model` (a verifier or a drafter, inference only) on the resolved kernel; returns it."""
    param = next(model.parameters())
    resolved = resolve_kernel(kernel, param.device, param.dtype)
    if resolved == PREPACKED:
        prepack_linears(model)
    return resolved
