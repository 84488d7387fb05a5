"""Which fused SDPA kernel CUDA runs for an attention call, and the call form that keeps one.

`F.scaled_dot_product_attention` picks its CUDA kernel at run time and silently falls back to the
math kernel when no fused one accepts the call. The math kernel materialises the float32 scores
[B, heads, rows, keys] of every layer: ~+25 GB on an 8B DFlash training step, an out-of-memory on
a 70B collect batch. The CPU build's flash kernel accepts a mask with grouped-query heads, so
nothing shows on a CPU; this module encodes the CUDA rules so CPU tests can check every call.

The rules (`cuda_sdpa_kernels`) are read from torch's dispatch source, which the wheel does not
ship: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (`can_use_flash_attention`,
`can_use_mem_efficient_attention`, `can_use_cudnn_attention`, `select_sdp_backend`,
`check_cudnn_tensor_shapes`, `check_cudnn_d256_bprop_head_dim`; read at pytorch commit
001f694a) and sdp_utils_cpp.h (`check_for_attn_mask`, `check_attn_mask_shape`,
`check_batch_size_and_num_heads_dense`, `check_last_dim_stride_equals_1_dense`), the default
order in aten/src/ATen/Context.h (`sdp_priority_order`: flash, efficient, math, cudnn). Where a
rule depends on the GPU, it is the one for sm90 (H100/H200). One difference from that commit:
there the memory-efficient kernel takes grouped-query heads (pytorch PR #191085); torch 2.13's
does not -- the installed `F.scaled_dot_product_attention` docstring says GQA "works only for
Flash_attention and math kernel on CUDA", and the installed meta of
`_scaled_dot_product_efficient_attention_backward` gives K/V gradients the query's head count.
So `EFFICIENT_GQA` is False here.

Hence the form every stage uses on CUDA (`grouped_kv`): grouped-query heads with `enable_gqa`
where flash takes the call (no mask, square causal or none); where a mask is needed, K/V
expanded to the query's heads ([B, h, keys, d], far smaller than [B, h, rows, keys] float32
scores) and no `enable_gqa`, which the memory-efficient kernel takes with its additive mask.
On the CPU the call is unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
EFFICIENT_GQA = False  # torch 2.13: the memory-efficient kernel needs equal head counts
_HALF = (torch.float16, torch.bfloat16)
_CUDNN_MAX_DIM = 65535  # batch and heads (check_cudnn_tensor_shapes)


@dataclass(frozen=True)
class SdpaCall:
    """What CUDA's kernel choice reads of one SDPA call: q [B, h, L, E], k [B, kvh, S, E],
    v head dim, the mask's shape (None: no mask), the flags, and layout facts."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    dtype: torch.dtype
    v_head_dim: int | None = None  # None: k's
    mask_shape: tuple[int, ...] | None = None
    mask_requires_grad: bool = False
    enable_gqa: bool = False
    is_causal: bool = False
    dropout: float = 0.0
    requires_grad: bool = False  # inputs need grad and grad mode is on (a training step)
    last_dim_contiguous: bool = True  # q, k, v (and mask) have stride 1 in their last dim
    aligned: bool = True  # storage offsets * element size are multiples of 16 B

    @classmethod
    def of(
        cls,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> SdpaCall:
        """The call as `F.scaled_dot_product_attention` receives it (same arguments). Under autocast
        the kernel sees the autocast dtype: CUDA's autocast runs SDPA in lower precision."""
        qkv = (query, key, value)
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
        mask_stride_ok = attn_mask is None or attn_mask.stride(-1) == 1  # strictly, on a GPU
        return cls(
            tuple(query.shape),
            tuple(key.shape),
            dtype,
            value.shape[-1],
            None if attn_mask is None else tuple(attn_mask.shape),
            attn_mask is not None and attn_mask.requires_grad,
            enable_gqa,
            is_causal,
            dropout_p,
            torch.is_grad_enabled() and any(t.requires_grad for t in qkv),
            mask_stride_ok and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in qkv),
            all(t.storage_offset() * t.element_size() % 16 == 0 for t in qkv),
        )


def _dense_ok(c: SdpaCall, gqa: bool) -> bool:
    """check_tensor_shapes, check_nonzero_sequence_lengths_dense, the last-dim strides, and
    check_batch_size_and_num_heads_dense: equal heads, or grouped ones where `gqa` (the kernel
    supports them and, for flash, enable_gqa asks for them)."""
    if len(c.q_shape) != 4 or len(c.k_shape) != 4 or not c.last_dim_contiguous:
        return False
    (batch, h, rows, _), (k_batch, kvh, keys, _) = c.q_shape, c.k_shape
    if rows == 0 or keys == 0 or batch != k_batch:
        return False
    return h == kvh or (gqa and kvh > 0 and h % kvh == 0)


def _flash_ok(c: SdpaCall) -> bool:
    """can_use_flash_attention on sm90: no mask at all, fp16/bf16, one head dim <= 256 (padded to
    8 by the dispatcher), causal only when rows == keys, GQA when enable_gqa."""
    e, ev = c.q_shape[-1], c.v_head_dim or c.k_shape[-1]
    return (
        c.mask_shape is None
        and c.dtype in _HALF
        and e == c.k_shape[-1] == ev <= 256
        and not (c.is_causal and c.q_shape[-2] != c.k_shape[-2])
        and _dense_ok(c, c.enable_gqa)
    )


def _efficient_ok(c: SdpaCall) -> bool:
    """can_use_mem_efficient_attention on sm80+: fp16/bf16/fp32, q and k head dims equal and
    q, v head dims multiples of the gemm alignment (8 for half types, 4 for fp32), storage offsets
    aligned, any mask (additive or bool; broadcast and padded by the dispatcher), no GQA in 2.13."""
    e, ev = c.q_shape[-1], c.v_head_dim or c.k_shape[-1]
    align = 8 if c.dtype in _HALF else 4
    return (
        c.dtype in (*_HALF, torch.float32)
        and e == c.k_shape[-1]
        and e % align == 0
        and ev % align == 0
        and c.aligned
        and _dense_ok(c, EFFICIENT_GQA and c.enable_gqa)
    )


def _cudnn_mask_ok(c: SdpaCall) -> bool:
    """check_attn_mask_shape: 2-D, or 4-D with each dim 1 or the call's; never a mask with grad."""
    if c.mask_shape is None:
        return True
    (batch, h, rows, _), keys, m = c.q_shape, c.k_shape[-2], c.mask_shape
    if c.mask_requires_grad or m[-2] not in (1, rows) or m[-1] not in (1, keys):
        return False
    return len(m) == 2 or (len(m) == 4 and m[0] in (1, batch) and m[1] in (1, h))


def _cudnn_ok(c: SdpaCall, d256: bool) -> bool:
    """can_use_cudnn_attention on sm90: fp16/bf16, masks by `_cudnn_mask_ok`, GQA with
    enable_gqa, batch and heads <= 65535, head dims multiples of 8 and <= 128 (<= 256 with a
    cuDNN > 9.22 and a frontend >= 1.24: `d256`, whose backward then takes only d <= 128, 192/128
    or 256/256), key length != 1, dropout a multiple of 1/16."""
    (batch, h, rows, e), keys, ev = c.q_shape, c.k_shape[-2], c.v_head_dim or c.k_shape[-1]
    limit = 256 if d256 else 128
    backward_ok = not (d256 and c.requires_grad) or (
        (e <= 128 and ev <= 128) or (e, ev) in ((192, 128), (256, 256))
    )
    return (
        c.dtype in _HALF
        and _dense_ok(c, c.enable_gqa)
        and _cudnn_mask_ok(c)
        and batch <= _CUDNN_MAX_DIM
        and h <= _CUDNN_MAX_DIM
        and e <= limit
        and ev <= limit
        and e % 8 == 0
        and ev % 8 == 0
        and keys != 1
        and not (c.dropout and rows == 1)
        and c.dropout * 16 == int(c.dropout * 16)
        and backward_ok
    )


def cuda_sdpa_kernels(call: SdpaCall, *, cudnn_first: bool = False, cudnn_d256: bool = False) -> list[str]:
    """The fused kernels CUDA would accept for `call`, in the order it tries them.

    The default order is flash, efficient, (math), cudnn: cuDNN is listed last but runs only where
    `cudnn_first` -- torch moves it to the front on sm90/sm100 with a runtime cuDNN > 9.15
    (`check_prefer_cudnn_attention`), a fact of the installed cuDNN that only a GPU can tell.
    """
    accepted = {FLASH: _flash_ok(call), EFFICIENT: _efficient_ok(call), CUDNN: _cudnn_ok(call, cudnn_d256)}
    order = (CUDNN, FLASH, EFFICIENT) if cudnn_first else (FLASH, EFFICIENT, CUDNN)
    return [name for name in order if accepted[name]]


def cuda_sdpa_kernel(call: SdpaCall, *, cudnn_first: bool = False, cudnn_d256: bool = False) -> str:
    """The kernel CUDA runs for `call`: the first fused one ahead of math, else math."""
    for name in cuda_sdpa_kernels(call, cudnn_first=cudnn_first, cudnn_d256=cudnn_d256):
        if name != CUDNN or cudnn_first:
            return name
    return MATH


# ---------------------------------------------------------------- the call form

_CUDA_FORM = contextvars.ContextVar("specctl_cuda_attention_form", default=False)


@contextlib.contextmanager
def cuda_attention_form() -> Iterator[None]:
    """Call SDPA in its CUDA form whatever device the tensors are on: `specctl plan` traces on the
    CPU the step a GPU will run, and must count the K/V copies that form makes."""
    token = _CUDA_FORM.set(True)
    try:
        yield
    finally:
        _CUDA_FORM.reset(token)


def cuda_form(x: torch.Tensor) -> bool:
    """Whether an SDPA call on x takes the CUDA form: x is on a CUDA device, or a trace for one."""
    return x.device.type == "cuda" or _CUDA_FORM.get()


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x [B, kvh, S, d] -> [B, kvh * groups, S, d]: head j is kv head j // groups, the pairing
    `enable_gqa` computes (its math kernel repeat_interleaves the same way)."""
    return x.repeat_interleave(groups, dim=1)


def grouped_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k, v, enable_gqa) for an SDPA call of q [B, h, L, d] over k, v [B, kvh, S, d].

    Equal heads: as given. Grouped heads: `enable_gqa` (flash, or the CPU kernel), except in the
    CUDA form when flash cannot take the call (a mask, causal with L != S, or float32 -- flash
    runs only fp16/bf16, and train.precision float32 trains in float32): then K/V are repeated to
    h heads so the memory-efficient kernel takes it instead of math.
    """
    h, kvh = q.shape[1], k.shape[1]
    if h == kvh:
        return k, v, False
    half = q.dtype in (torch.float16, torch.bfloat16)
    flash_takes_it = half and mask is None and not (is_causal and q.shape[2] != k.shape[2])
    if flash_takes_it or not cuda_form(q):
        return k, v, True
    return repeat_kv(k, h // kvh), repeat_kv(v, h // kvh), False


# ---------------------------------------------------------------- the guard tests use


class MathFallback(RuntimeError):
    """An SDPA call that no fused CUDA kernel ahead of math accepts."""


class FusedAttentionGuard(TorchFunctionMode):
    """Checks every `F.scaled_dot_product_attention` call on CUDA tensors (or any, inside
    `cuda_attention_form`) against `cuda_sdpa_kernel` and raises `MathFallback` where CUDA would
    run the math kernel. `calls` records (SdpaCall, kernel) of each checked call.

    cuDNN counts only with `cudnn_first` (a runtime cuDNN > 9.15 on sm90): by default a call must
    be one flash or the memory-efficient kernel takes, whatever cuDNN the GPU has.
    """

    def __init__(self, cudnn_first: bool = False) -> None:
        super().__init__()
        self.cudnn_first = cudnn_first
        self.calls: list[tuple[SdpaCall, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and cuda_form(args[0]):
            call = SdpaCall.of(*args, **kwargs)
            kernel = cuda_sdpa_kernel(call, cudnn_first=self.cudnn_first)
            self.calls.append((call, kernel))
            if kernel == MATH:
                raise MathFallback(f"CUDA would run the math SDPA kernel for {call}")
        return func(*args, **kwargs)
