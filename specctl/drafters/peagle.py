"""P-EAGLE: EAGLE-3 layers that draft K tokens in ONE forward pass (arXiv 2602.01469).

Serving (vLLM `parallel_drafting`, `copy_and_expand_eagle_inputs_kernel`): after the usual
EAGLE rows (row t: token x_{t+1}, verifier feature at t, position t), the anchor row N-1
carries the newest token, and K-1 extra slots follow it: slot d = `mask_token_id` + the
learned `mask_hidden` (in fc-input space, so it goes through `fc` like real features), at
position N-1+d. Attention is plain causal over that sequence, so slot d sees the real
context up to the anchor and slots 1..d. Slot d predicts the token d+1 after the newest.

Training builds the same thing for every anchor at once: all real rows (depth 0) plus, per
depth d >= 1, a sampled subset of anchors whose depth-d row is kept (draft-block
sparsification, "COD": nested, count floor(n * max(r^d, r_min))). Depth rows attend to the
real rows up to their anchor and to their own block's rows 1..d; the attention gathers those
few block keys per row (`block_layout`) instead of materialising a mask over every pair of
rows, and runs SDPA over the real rows shared by all depth rows (the real rows themselves are
plain causal: no mask), so its cost is (real rows + kept rows) x real rows, linear in the
rows kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn

from specctl.drafters.api import DrafterSpec, VerifierSpec, VerifierWeights, WindowedConfig, specctl_record
from specctl.drafters.eagle3 import Eagle3Backbone, LayerStyle, layer_settings, shift_left
from specctl.drafters.eagle3 import Format as Eagle3Format
from specctl.drafters.layers import (
    Attention,
    attend_after_prefix,
    attend_with_own_keys,
    attention_dtype,
    cached_rows,
    own_key_attention,
    shared_key_bias,
    window_mask,
)
from specctl.vllm.capabilities import Need


class Config(WindowedConfig):
    """Recipe section `drafter.peagle`; defaults follow the published P-EAGLE recipe/checkpoints."""

    num_layers: int = Field(4, ge=1, description="Decoder layers of the drafter (P-EAGLE uses four).")
    num_depths: int = Field(
        8, ge=1, description="Parallel depths trained per anchor (speculators `para_depths`: 8)."
    )
    num_speculative_tokens: int = Field(
        5, ge=1, description="Tokens drafted per forward pass at serve time; at most `num_depths`."
    )
    down_sample_ratio: float = Field(
        0.7, gt=0, le=1, description="r: depth d keeps a fraction max(r**d, r_min) of the anchors."
    )
    down_sample_ratio_min: float = Field(
        0.2, ge=0, le=1, description="r_min: floor of the kept fraction at deep depths."
    )
    max_anchors: int | None = Field(
        None, ge=1, description="Cap on anchors per sequence that get depth rows (None = no cap)."
    )
    norm_before_residual: bool = Field(
        False, description="Layer 0 keeps hidden_norm(hidden) as its residual instead of the raw hidden."
    )
    norm_before_fc: bool = Field(
        False, description="RMSNorm (`input_norm`) over the concatenated aux features before `fc`."
    )
    draft_layers: LayerStyle = Field(
        "llama",
        description="Decoder layer style: llama or qwen3 (q_norm/k_norm on the heads, the speculators "
        "trainer's default); vLLM serves both.",
    )

    def max_speculative_tokens(self) -> int:
        return self.num_depths

    def window_span(self) -> int:
        return self.num_depths

    @model_validator(mode="after")
    def _tokens_within_depths(self) -> Config:
        if self.num_speculative_tokens > self.num_depths:
            raise ValueError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) cannot exceed "
                f"num_depths ({self.num_depths}): deeper slots were never trained"
            )
        return self


# ---------------------------------------------------------------- pure helpers


def kept_fraction(depth: int, ratio: float, ratio_min: float) -> float:
    return 1.0 if depth == 0 else max(ratio**depth, ratio_min)


def sample_draft_blocks(
    valid: torch.Tensor,
    ratio: float,
    ratio_min: float,
    max_anchors: int | None = None,
    keep_all: bool = False,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Which anchors get a depth-d row, d = 1..K-1 (draft-block sparsification).

    valid [K, R] bool: row t's depth-d target exists and is loss-masked. Returns K-1 sorted
    anchor tensors. Depth d is drawn from the anchors kept at d-1 whose depth-d target is
    valid (nested, so every kept row's block rows 1..d-1 exist, as at serve time), and keeps
    floor(n * max(r^d, r_min)) of them (n = valid depth-0 targets, capped by max_anchors),
    or all of them, uncapped, with keep_all (validation: exact, not sampled, metrics).
    """
    K = valid.shape[0]
    n = int(valid[0].sum())
    if K < 2:
        return []
    pool = valid[1].nonzero()[:, 0]
    if max_anchors is not None and not keep_all:
        n = min(n, max_anchors)
        if pool.numel() > max_anchors:
            pick = torch.randperm(pool.numel(), generator=generator)[:max_anchors].to(pool.device)
            pool = pool[pick].sort().values
    kept = []
    for d in range(1, K):
        if d > 1:
            pool = kept[-1][valid[d, kept[-1]]]
        size = pool.numel()
        if not keep_all:
            size = min(size, math.floor(n * kept_fraction(d, ratio, ratio_min) + 1e-9))
        pick = torch.randperm(pool.numel(), generator=generator)[:size].to(pool.device)
        kept.append(pool[pick].sort().values)
    return kept


def block_layout(
    anchor: torch.Tensor, depth: torch.Tensor, present: torch.Tensor, num_rows: int, num_depths: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention layout of the depth rows (the compact form of the P-EAGLE mask).

    anchor, depth, present [B, M] describe the depth rows (d >= 1) after the R real rows.
    Returns ctx_mask [B, M, R] (real row j visible iff j <= anchor), blk_index [B, M, K-1]
    (index among the M depth rows of the same anchor's depth j+1 row, -1 if absent) and
    blk_mask [B, M, K-1] (that row is visible: present and j+1 <= own depth). Padding rows
    (present False) see real row 0 only, so their softmax stays finite.
    """
    B, M = anchor.shape
    device = anchor.device
    ctx_mask = torch.arange(num_rows, device=device)[None, None, :] <= anchor[:, :, None]  # [B, M, R]
    table = torch.full((B, num_depths, num_rows), -1, dtype=torch.long, device=device)  # [B, K, R]
    b, m = present.nonzero(as_tuple=True)
    table[b, depth[b, m], anchor[b, m]] = m
    J = num_depths - 1
    members = torch.arange(1, num_depths, device=device)  # depths 1..K-1
    bidx = torch.arange(B, device=device)[:, None, None]
    blk_index = table[bidx, members[None, None, :], anchor[:, :, None].expand(B, M, J)]  # [B, M, K-1]
    blk_mask = (blk_index >= 0) & (members[None, None, :] <= depth[:, :, None]) & present[:, :, None]
    return ctx_mask, blk_index, blk_mask


def block_attention(
    attn: Attention,
    q: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_bias: torch.Tensor,
    blk_k: torch.Tensor,
    blk_v: torch.Tensor,
    blk_mask: torch.Tensor,
) -> torch.Tensor:
    """Attention of M depth rows over the shared real rows plus J gathered keys of their own.

    q [B, h, M, hd]; ctx_k/v [B, kvh, R, hd] the real rows, ctx_bias [B, 1, M, R + 1] =
    shared_key_bias(ctx_mask) built once per forward; blk_k/v [B, kvh, M, J, hd], blk_mask
    [B, M, J] the row's own block. One softmax over both key sets -> [B, M, H] (after o_proj).
    SDPA runs over the real rows (no score matrix kept), the J block keys are explicit.
    """
    B, h, M, hd = q.shape
    own_lse, own_out = own_key_attention(q.view(B, h, M, 1, hd), blk_k, blk_v, blk_mask[:, :, None, :])
    out = attend_with_own_keys(q, ctx_k, ctx_v, own_lse.view(B, h, M), own_out.view(B, h, M, hd), ctx_bias)
    return attn.output(out)


# ---------------------------------------------------------------- module


class PEagleDrafter(Eagle3Backbone):
    algo = "peagle"
    architectures = ("PEagleDraftModel",)
    export_reshapeable = ("mask_hidden",)  # [1, n_aux*H] here and in older exports, [1, 1, n_aux*H] in files

    def __init__(
        self,
        config: Config,
        verifier: VerifierSpec,
        weights: VerifierWeights,
        d2t: torch.Tensor | None,
        loss: str,
    ):
        super().__init__(
            verifier,
            weights,
            d2t,
            loss,
            num_layers=config.num_layers,
            norm_before_residual=config.norm_before_residual,
            norm_before_fc=config.norm_before_fc,
            style=config.draft_layers,
            windows=config.layer_windows(config.num_layers),
        )
        if not 0 <= verifier.mask_token_id < verifier.vocab_size:
            raise ValueError(
                f"mask_token_id {verifier.mask_token_id} is outside the verifier vocabulary "
                f"(size {verifier.vocab_size}); P-EAGLE embeds it with the verifier's embeddings"
            )
        self.config = config
        n_aux = len(verifier.aux_layer_ids)
        # the hidden of every mask slot, in fc-input space (vLLM passes it through combine)
        self.mask_hidden = nn.Parameter(torch.randn(1, n_aux * verifier.hidden_size) * 0.02)

    def mask_feature(self) -> torch.Tensor:
        """The hidden of every mask slot, through the same fc as real features -> [1, H]."""
        return self.combine(self.mask_hidden.view(1, len(self.verifier.aux_layer_ids), -1))

    def rows_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        anchor: torch.Tensor,
        depth: torch.Tensor,
        present: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over real rows + depth rows -> normed outputs ([B, R, H], [B, M, H]).

        input_ids [B, R+1], aux_hidden_states [B, R, n_aux, H] (real row t: token x_{t+1},
        feature t, position t); anchor/depth/present [B, M]: depth rows (mask token,
        mask_hidden, position anchor+depth).
        """
        B, R = aux_hidden_states.shape[:2]
        M = anchor.shape[1]
        device = input_ids.device
        ctx_mask, blk_index, blk_mask = block_layout(anchor, depth, present, R, self.config.num_depths)
        tokens = torch.cat([input_ids[:, 1 : R + 1], torch.full_like(anchor, self.verifier.mask_token_id)], 1)
        features = torch.cat([self.combine(aux_hidden_states), self.mask_feature().expand(B, M, -1)], 1)
        positions = torch.cat([torch.arange(R, device=device).expand(B, R), anchor + depth], 1)
        # [B, 1, M, R + 1] per attention window (one, mask-free for the real rows, without sliding layers)
        ctx_bias, real_mask = self.window_masks(ctx_mask, anchor + depth, R, attention_dtype(features))
        bidx = torch.arange(B, device=device)[:, None, None]
        gather = blk_index.clamp(min=0)  # [B, M, J]

        def attend(i: int, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            q = attn.project_q(x, cos, sin)  # [B, h, R+M, hd]
            k, v = attn.project_kv(x, cos, sin)
            window = self.windows[i]
            real = attn.attend(
                q[:, :, :R], k[:, :, :R], v[:, :, :R], real_mask[window], is_causal=window is None
            )
            if M == 0:
                return real
            # block keys of each depth row: [B, kvh, M, J, hd], gathered from the depth rows
            bk = k[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
            bv = v[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
            drafts = block_attention(
                attn, q[:, :, R:], k[:, :, :R], v[:, :, :R], ctx_bias[window], bk, bv, blk_mask
            )
            return torch.cat([real, drafts], 1)

        out, _ = self.run_layers(tokens, features, positions, attend)
        return out[:, :R], out[:, R:]

    def window_masks(
        self, ctx_mask: torch.Tensor, depth_pos: torch.Tensor, num_rows: int, dtype: torch.dtype
    ) -> tuple[dict[int | None, torch.Tensor], dict[int | None, torch.Tensor | None]]:
        """Per attention window of the layers: the depth rows' context bias (ctx_mask [B, M, R],
        rows at depth_pos [B, M], limited to the window) and the real rows' mask ([R, R] causal
        band; None = plain causal, no mask tensor). Real row j sits at position j."""
        rows = torch.arange(num_rows, device=ctx_mask.device)
        ctx_bias, real_mask = {}, {}
        for window in dict.fromkeys(self.windows):
            inside = window_mask(depth_pos, rows, window)
            ctx_bias[window] = shared_key_bias(ctx_mask if inside is None else ctx_mask & inside, dtype)
            band = window_mask(rows, rows, window)
            real_mask[window] = None if band is None else band & (rows <= rows[:, None])
        return ctx_bias, real_mask

    def sample_rows(
        self, valid: torch.Tensor, keep_all: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """valid [K, B, R] -> depth rows anchor, depth, present [B, M] (M = most rows of any sample)."""
        c = self.config
        per_sample = []
        host = valid.cpu()  # one wait for the GPU a forward, not one a sample
        for b in range(valid.shape[1]):
            kept = sample_draft_blocks(
                host[:, b], c.down_sample_ratio, c.down_sample_ratio_min, c.max_anchors, keep_all
            )
            empty = [torch.zeros(0, dtype=torch.long)]
            depth = torch.cat([torch.full_like(a, d + 1) for d, a in enumerate(kept)] + empty)
            anchor = torch.cat(kept + empty)
            per_sample.append((anchor, depth))
        M = max(a.numel() for a, _ in per_sample)
        B = valid.shape[1]
        anchor = torch.zeros(B, M, dtype=torch.long)
        depth = torch.ones(B, M, dtype=torch.long)
        present = torch.zeros(B, M, dtype=torch.bool)
        for b, (a, d) in enumerate(per_sample):
            anchor[b, : a.numel()], depth[b, : a.numel()], present[b, : a.numel()] = a, d, True
        rows = torch.stack([anchor, depth, present.long()]).to(valid.device)  # [3, B, M]: one copy
        return rows[0], rows[1], rows[2].bool()

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids = batch["input_ids"]
        R = input_ids.shape[1] - 1
        K = self.config.num_depths
        target_ok = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, T]
        valid = torch.stack([shift_left(target_ok, 2 + d, False)[:, :R] for d in range(K)])  # [K, B, R]
        anchor, depth, present = self.sample_rows(valid, keep_all=not self.training)
        aux = batch["aux_hidden_states"][:, :R]
        out_real, out_depth = self.rows_forward(input_ids, aux, anchor, depth, present)

        device = input_ids.device
        correct, count, depth_loss = (torch.zeros(K, device=device) for _ in range(3))
        loss = torch.zeros((), device=device)
        b, t = valid[0].nonzero(as_tuple=True)
        targets = self.targets(batch)
        rows = [(out_real[b, t], targets.at(b, t + 1))]
        for d in range(1, K):
            b, m = (present & (depth == d)).nonzero(as_tuple=True)
            rows.append((out_depth[b, m], targets.at(b, anchor[b, m] + 1 + d)))
        for d, (out, target) in enumerate(rows):
            rows_loss, ok, ok_rows = self.score(out, target)
            mean = rows_loss.sum() / ok_rows.sum().clamp(min=1)
            loss = loss + mean / K
            depth_loss[d], count[d] = mean.detach(), out.shape[0]
            if ok is not None:  # None: a KL training step formed no full-vocabulary argmax
                correct[d] = ok.sum()
        metrics = {"loss": loss.detach(), "count": count, "depth_loss": depth_loss}
        if targets.targets.argmax is not None:
            metrics["correct"] = correct
        return loss, metrics

    @torch.no_grad()
    def propose_with_logits(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K greedy drafts [K] and their draft logits [K, Vd], in one pass: anchor row N-1 plus
        mask slots 1..K-1 (vLLM parallel drafting).

        At the anchor N-1 the P-EAGLE layout is plain causal attention over [real rows 0..N-1,
        depth rows 1..K-1]: every real row is visible, depth row d sees depth rows 1..d. So with
        `state` (one dict per request) the real rows' K/V are kept, as vLLM keeps a drafter KV
        cache, and each proposal runs only the real rows not seen before plus the K-1 depth rows.
        """
        N = aux_hidden_states.shape[0]
        if input_ids.shape[0] != N + 1:
            raise ValueError(f"propose needs N+1 input ids for N feature rows, got {input_ids.shape[0]}, {N}")
        if num_tokens > self.config.num_depths:
            raise ValueError(f"this drafter was trained for at most {self.config.num_depths} tokens")
        # the newest real row is always run: its output makes the first draft
        done = min(cached_rows(state, N), N - 1)
        device = input_ids.device
        n, M = N - done, num_tokens - 1  # new real rows, depth rows
        tokens = torch.cat([input_ids[1 + done :], input_ids.new_full((M,), self.verifier.mask_token_id)])
        features = torch.cat([self.combine(aux_hidden_states[done:]), self.mask_feature().expand(M, -1)])
        positions = torch.arange(done, N + M, device=device)  # depth row d sits at anchor + d = N - 1 + d
        old = state["context_kv"] if done else None
        real_kv: list[tuple[torch.Tensor, torch.Tensor]] = []

        def attend(i: int, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
            q = attn.project_q(x, cos, sin)  # [1, h, n+M, hd]
            k, v = attn.project_kv(x, cos, sin)  # [1, kvh, n+M, hd]
            if old is not None:
                k = torch.cat([old[i][0][:, :, :done], k], 2)  # [1, kvh, N+M, hd]
                v = torch.cat([old[i][1][:, :, :done], v], 2)
            real_kv.append((k[:, :, :N], v[:, :, :N]))
            return attend_after_prefix(attn, q, k, v, self.windows[i])

        out, _ = self.run_layers(tokens[None], features[None], positions[None], attend)  # [1, n+M, H]
        if state is not None:
            state.update(context_rows=N, context_kv=real_kv)
        logits = self.lm_head(out[0, n - 1 :])  # [K, Vd]: the anchor row, then depth rows 1..K-1
        return self.to_target_ids(logits.argmax(-1)), logits

    def export_state(self) -> dict[str, torch.Tensor]:
        """As EAGLE-3, with mask_hidden as the speculators library writes it: [1, 1, n_aux*H]
        (vLLM views it as [1, -1])."""
        out = super().export_state()
        out["mask_hidden"] = out["mask_hidden"].reshape(1, 1, -1)
        return out

    def export_config(self) -> Format:
        c = self.config
        return Format.model_validate(
            {
                **self.base_export_config("peagle", c.num_speculative_tokens),
                "mask_token_id": self.verifier.mask_token_id,
                "norm_before_residual": c.norm_before_residual,
                "norm_before_fc": c.norm_before_fc,
                "fc_norm": False,
                "norm_output": False,
                "specctl": specctl_record(self.algo, c, self.verifier, self.loss_kind),
            }
        )


class Format(Eagle3Format):
    """config.json of a P-EAGLE drafter: EAGLE-3's fields plus the mask token (vLLM's defaults)."""

    mask_token_id: int
    norm_before_residual: bool = False


def build(
    config: Config,
    verifier: VerifierSpec,
    weights: VerifierWeights,
    d2t: torch.Tensor | None,
    loss: str | None,
) -> PEagleDrafter:
    return PEagleDrafter(config, verifier, weights, d2t, loss)


def config_from_format(config: Format) -> Config:
    """The recipe section a config.json describes; a file without specctl's record trained as many
    depths as it drafts, or the recipe default when that is more."""
    saved = dict(config.specctl.drafter) if config.specctl is not None else {}
    saved.setdefault("num_depths", max(config.speculative_tokens, Config.model_fields["num_depths"].default))
    return Config(
        **{
            **saved,
            **layer_settings(config),
            "num_speculative_tokens": config.speculative_tokens,
            "norm_before_residual": config.norm_before_residual,
            "norm_before_fc": config.norm_before_fc,
        }
    )


SPEC = DrafterSpec(
    name="peagle",
    config_cls=Config,
    format_cls=Format,
    build=build,
    config_from_format=config_from_format,
    speculators_model_type="peagle",
    architectures=PEagleDrafter.architectures,
    vllm_method={"method": "eagle3", "parallel_drafting": True},
    vllm_needs=(Need.PEAGLE, Need.PARALLEL_DRAFTING),
    tiny={"num_layers": 1, "num_depths": 3, "num_speculative_tokens": 3},
    published=lambda c: c.num_layers == 4 and c.num_depths == 4,
)
