"""Decoder pieces shared by the drafters, named like the HF/vLLM weights they export to.

Llama-style (EAGLE-3, P-EAGLE) and Qwen3-style (DFlash, DSpark: q_norm/k_norm) layers use
the same blocks; the drafters compose them, because how queries meet keys (context K/V,
block masks, depth masks) is exactly what distinguishes the algorithms.

All three parallel training layouts have the same shape: every query sees a prefix of keys
shared by many queries (the context) plus a few keys of its own (its draft block, its
earlier TTT steps). `own_key_attention` + `attend_with_own_keys` compute that as one softmax
without a mask over every pair of rows and without copying the shared keys per query group,
so the cost grows with (queries x shared keys) + (queries x own keys).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specctl.attention_kernels import grouped_kv


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with the verifier's rope scaling (default, linear, llama3).

    Computed in float32 as transformers and vLLM compute it, so the drafter trains with the
    same rotation table vLLM serves it with (a float64 table differs in the last bits).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(is_mid, mid, scaled)
    elif kind not in ("default", None):
        raise ValueError(f"rope scaling type {kind!r} is not supported by specctl drafters")
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [..., T] -> cos, sin [..., T, head_dim] (HF's rotate_half layout)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; cos/sin [B, T, hd] or [T, hd]."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


class Attention(nn.Module):
    """Grouped-query attention projections; `in_features` = 2H for EAGLE-3's first layer."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        in_features: int | None = None,
        qk_norm: bool = False,
        eps: float = 1e-6,
    ):
        super().__init__()
        d_in = in_features or hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(d_in, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_in] -> q [B, heads, T, hd] (normed, rotated)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, d_in] -> k, v [B, kv_heads, S, hd] (k normed and rotated)."""
        B, S, _ = x.shape
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q [B, h, T, hd], k/v [B, kvh, S, hd], mask [B|1, 1, T, S] bool (True = attend) or
        is_causal (query i sees keys 0..i, no mask tensor) -> [B, T, H]."""
        k, v, gqa = grouped_kv(q, k, v, mask, is_causal)  # on CUDA: a form a fused kernel takes
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
        return self.output(out)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Per-head attention output [B, h, T, hd] -> o_proj of the concatenated heads [B, T, H]."""
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


def cached_rows(state: dict[str, Any] | None, rows: int) -> int:
    """How many of a request's `rows` prefix rows the drafter's `state` already holds K/V for.

    A request's verified prefix only grows, so a state that saw more rows than there are now
    belongs to another request: refuse it rather than draft from the wrong context.
    """
    done = 0 if state is None else state.get("context_rows", 0)
    if done > rows:
        raise ValueError(
            f"the verified prefix shrank from {done} to {rows} rows: use a new state per request"
        )
    return done


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Sliding-window visibility: [..., Q, K] bool, True where key k is less than `window` positions
    behind query q (k_pos > q_pos - window); None for full attention (window None).

    vLLM's sliding layers (FlashAttention window (W-1, 0), symmetrised for non-causal drafters)
    see exactly these keys among the ones their causal or block structure allows; q_pos [..., Q],
    k_pos [..., K] are positions (broadcast against each other).
    """
    if window is None:
        return None
    return k_pos[..., None, :] > q_pos[..., :, None] - window


def attend_after_prefix(
    attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal attention of the last n of S rows: q [B, h, n, hd], k/v [B, kvh, S, hd] of all S
    rows (a cached prefix + the new ones) -> [B, n, H]. Row S-n+j sees rows 0..S-n+j, the last
    `window` of them on a sliding layer (a row's position is its index).

    A proposal with a cached prefix runs only the rows the cache lacks, so its queries are the
    tail of the key sequence: SDPA's own `is_causal` would align them with its head instead.
    """
    n, S = q.shape[2], k.shape[2]
    rows, keys = torch.arange(S - n, S, device=q.device), torch.arange(S, device=q.device)
    visible = keys <= rows[:, None]  # [n, S]
    if window is not None:
        visible = visible & window_mask(rows, keys, window)
    return attn.attend(q, k, v, visible)


# ---------------------------------------------------------------- shared keys + own keys

# The own-key summary key's score is floored here (natural-log units): a query with no own
# key gets weight exp(floor - max score) = 0, and floor / scale stays finite in fp16/bf16.
SUMMARY_SCORE_FLOOR = -1000.0


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype SDPA runs in for activations like x: autocast's when it is on, else x's.

    Masks built once per forward must already have it: autocast would cast a float mask to it
    again in every layer, and SDPA turns a bool mask into a float copy in every call.
    """
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def own_key_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of query groups over a few keys of their own, with its logsumexp.

    q [B, h, G, P, hd]: G groups of P queries; k, v [B, kvh, G, J, hd]: the J keys of each
    group (grouped-query heads share a kv head, never repeated); mask [B, G, P, J] bool
    (True = attend) or None (all). Returns lse [B, h, G, P] (~finfo.min where a query sees no
    key) and out [B, h, G, P, hd], both float32 or wider: the pieces `attend_with_own_keys`
    merges. Scores are explicit here: J is a block or a few TTT steps, never a sequence.
    """
    B, h, G, P, hd = q.shape
    kvh = k.shape[1]
    # float32 (or wider), like SDPA's accumulators: bf16 scores would put the lse off by ~0.1
    dtype = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        qg = q.view(B, kvh, h // kvh, G, P, hd).to(dtype)
        k, v = k[:, :, None].to(dtype), v[:, :, None].to(dtype)  # [B, kvh, 1, G, J, hd]
        # one query per group (P == 1): multiply-add, as thousands of 1 x J matmuls are slow on CPU
        one = P == 1
        scores = (qg * k).sum(-1)[..., None, :] if one else qg @ k.transpose(-1, -2)  # [B, kvh, rep, G, P, J]
        scores = scores * hd**-0.5
        if mask is not None:
            # finfo.min, not -inf: a query with no visible key keeps finite values and gradients
            scores = scores.masked_fill(~mask[:, None, None], torch.finfo(dtype).min)
        lse = scores.logsumexp(-1)  # [B, kvh, rep, G, P]
        probs = torch.exp(scores - lse[..., None])
        out = (probs.transpose(-1, -2) * v).sum(-2, keepdim=True) if one else probs @ v  # [.., G, P, hd]
    return lse.view(B, h, G, P), out.view(B, h, G, P, hd)


def shared_key_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """visible [B, N, S] bool (query n sees shared key s) -> additive mask [B, 1, N, S + 1]
    for `attend_with_own_keys`: 0 or -inf, and 0 in the last column, the own-key summary
    key, which every query sees (so no softmax row is ever empty). Build it once per forward
    in `attention_dtype` and pass it to every layer."""
    B, N, S = visible.shape
    bias = torch.zeros(B, 1, N, S + 1, dtype=dtype, device=visible.device)
    bias[:, 0, :, :S].masked_fill_(~visible, float("-inf"))
    return bias


def attend_with_own_keys(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    own_lse: torch.Tensor,
    own_out: torch.Tensor,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """One softmax over keys shared by all queries and each query's own keys -> [B, h, N, hd].

    q [B, h, N, hd]; k, v [B, kvh, S, hd] the shared keys; own_lse [B, h, N] and own_out
    [B, h, N, hd] the query's own keys summarised by `own_key_attention`; bias [B|1, 1, N,
    S + 1] from `shared_key_bias` (None: every shared key visible) or, instead, is_causal
    (query i sees shared keys 0..i; N == S).

    The own keys enter SDPA as ONE extra "summary" key per query whose score is own_lse, so
    the softmax weighs the own keys exactly as if they were all present. Its score comes
    from extra head channels (q carries own_lse / scale, split in two so bf16 keeps it
    exact enough; the summary key carries 1s there, the shared keys 0s), its value is a unit
    vector in an extra channel, so SDPA's output there is the own keys' total weight w and
    the result is shared_part + w * own_out. Exact and differentiable; the shared part stays
    one SDPA call (a fused kernel keeps no [N, S] score matrix where the device has one: the
    CPU flash kernel takes the mask and GQA; CUDA's memory-efficient kernel takes the bias with
    K/V repeated to q's heads, `grouped_kv`), with no per-query copy of the shared keys and no
    mask over own keys.
    """
    B, h, N, hd = q.shape
    S = k.shape[2]
    if is_causal and N != S:
        raise ValueError(f"is_causal needs as many queries as shared keys, got {N} and {S}")
    scale = hd**-0.5
    extra = 2 + (-(hd + 2)) % 8  # two channels for the score, padded to a multiple of 8 (fused kernels)
    target = own_lse.to(torch.promote_types(q.dtype, torch.float32))
    target = target.clamp_min(SUMMARY_SCORE_FLOOR) / scale  # [B, h, N]
    hi = target.to(q.dtype)
    lo = (target - hi.to(target.dtype)).to(q.dtype)
    q_ext = torch.cat([q, hi[..., None], lo[..., None], q.new_zeros(B, h, N, extra - 2)], -1)
    # SDPA's causal mask is top-left aligned (query i sees keys 0..i): with the summary key
    # first and one dummy query in front, query i+1 sees the summary and shared keys 0..i.
    # Otherwise the summary key is last, where `shared_key_bias` leaves its column at 0.
    summary = 0 if is_causal else S
    rows = (1, 0) if is_causal else (0, 1)
    k_ext = F.pad(k, (0, extra, *rows))  # [B, kvh, S + 1, hd + extra]: zeros in new row/channels
    v_ext = F.pad(v, (0, extra, *rows))
    k_ext[:, :, summary, hd : hd + 2] = 1  # summary score = scale * (hi + lo) = own_lse
    v_ext[:, :, summary, hd] = 1  # output channel hd = the summary key's weight
    if is_causal:
        q_ext = F.pad(q_ext, (0, 0, 1, 0))
    k_ext, v_ext, gqa = grouped_kv(
        q_ext, k_ext, v_ext, bias, is_causal
    )  # on CUDA: [B, h, S + 1, ..] with a bias
    out = F.scaled_dot_product_attention(
        q_ext, k_ext, v_ext, attn_mask=bias, is_causal=is_causal, scale=scale, enable_gqa=gqa
    )
    if is_causal:
        out = out[:, :, 1:]
    merged = out[..., :hd].to(own_out.dtype) + out[..., hd : hd + 1].to(own_out.dtype) * own_out
    return merged.to(q.dtype)
