"""DFlash: a block drafter that fills a block of masked slots in one forward pass.

The verifier's aux hidden states pass through `fc` and `hidden_norm` and become extra
keys/values in every draft layer: the drafter never runs over context tokens, only over a
query block `[anchor, MASK x (L-1)]` at positions anchor..anchor+L-1. The block attends to
itself bidirectionally and to context strictly before the anchor: at serve time the anchor
is the token the verifier just produced, so its own hidden state does not exist yet
(vLLM `_prepare_dflash_inputs_kernel`: context = verified tokens, query positions start at
last context position + 1). Training runs many anchors of a sequence side by side, each
block seeing only its own context (arXiv 2602.06036): the blocks of a row form one query
sequence over the row's context keys, shared by every anchor, plus a per-block part for
the bidirectional block (`block_attention`), so cost grows linearly with the anchors.

Where a block's predictions sit, as vLLM samples them (the training layout must match, or
acceptance collapses with no error):
  sample_from_anchor=False (DFlash): block `[anchor, MASK x K]`; prediction k = 1..K is
      the output at block offset k and stands for token anchor+k.
  sample_from_anchor=True (DSpark's default): block `[anchor, MASK x (K-1)]`; prediction k
      is the output at offset k-1 (next-token style) and stands for token anchor+k.
The target of the token at position j is the verifier's distribution at j-1.

dspark.py reuses this backbone and adds its Markov and confidence heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from specctl.drafters.api import (
    LOSSES,
    DrafterSpec,
    VerifierSpec,
    VerifierWeights,
    WindowedConfig,
    load_exact,
    specctl_record,
)
from specctl.drafters.layers import (
    MLP,
    Attention,
    RMSNorm,
    attend_with_own_keys,
    attention_dtype,
    cached_rows,
    own_key_attention,
    rope_cos_sin,
    rope_inv_freq,
    shared_key_bias,
    window_mask,
)
from specctl.drafters.targets import (
    Targets,
    TargetTable,
    batch_targets,
    chunked_draft_loss,
    draft_to_target,
    full_stats_needed,
)
from specctl.drafters.vocab import kept_ids, t2d_from_d2t
from specctl.speculators.config import SpeculatorsConfig, base_fields
from specctl.vllm.capabilities import Need

# ---------------------------------------------------------------- configuration


class BlockConfig(WindowedConfig):
    """Hyper-parameters every block drafter (DFlash, DSpark) has."""

    num_layers: int = Field(5, ge=1, description="Draft decoder layers (Qwen3-style, with q_norm/k_norm).")
    block_size: int = Field(
        16, ge=2, description="Query block length: the anchor token plus masked slots (training and serving)."
    )
    max_anchors: int = Field(
        512, ge=1, description="Most blocks (anchors) sampled per sequence per training step."
    )
    gamma: float = Field(
        4.0,
        gt=0,
        description="position_weights exp: draft position k weighs exp(-(k-1)/gamma), early positions most.",
    )
    position_weights: Literal["exp", "dpace"] = Field(
        "dpace",
        description="Loss weight per draft position: exp = fixed decay (gamma); dpace = D-PACE, the "
        "expected number of accepted tokens position k still affects, from the drafter's own "
        "confidence (the peers' DFlash default; +0.06 held-out tau_hat at 600 SmolLM2 steps, "
        "docs/training.md).",
    )
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE smoothing: confidence (1 - alpha) * exp(-loss) + alpha."
    )
    sample_from_anchor: bool = Field(
        False,
        description="True: the anchor's output predicts the next token (block of K slots drafts K tokens). "
        "False: the anchor is the bonus token and only the K masked slots predict (block of K+1).",
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens vLLM drafts per step (`speculative_tokens` of the exported config); "
        "None = every prediction of a full block.",
    )
    intermediate_size: int | None = Field(None, ge=1, description="Draft MLP width; None = the verifier's.")
    train_lm_head: bool = Field(
        False,
        description="Train the draft-vocabulary LM head (a copy of the verifier's rows for the kept ids). "
        "False keeps it frozen like the shared full-vocabulary head, as published: fewer parameters "
        "to fit, less overfitting on small data.",
    )

    block_causal: bool = Field(
        False,
        description="True: a block slot attends only to the slots before it (files with "
        "sliding_window_non_causal false, the speculators trainer's default; vLLM then runs the block "
        "causal); False: the block attends to itself both ways (DFlash as published).",
    )

    @property
    def predictions_per_block(self) -> int:
        """Draft tokens one full block proposes."""
        return self.block_size - 1 + int(self.sample_from_anchor)

    def max_speculative_tokens(self) -> int:
        """A block drafter fills one block per pass: a larger K needs a larger trained block."""
        return self.predictions_per_block

    def window_span(self) -> int:
        return self.block_size

    @model_validator(mode="after")
    def _check_speculative_tokens(self) -> BlockConfig:
        if (
            self.num_speculative_tokens is not None
            and self.num_speculative_tokens > self.predictions_per_block
        ):
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} exceeds the "
                f"{self.predictions_per_block} predictions of a block of {self.block_size}"
            )
        return self


class Config(BlockConfig):
    """`drafter.dflash`: published DFlash recipe (5 layers, block 16, 512 anchors, gamma 4)."""

    @model_validator(mode="after")
    def _check_layout(self) -> Config:
        if self.sample_from_anchor:
            raise ValueError(
                "sample_from_anchor=true is not served by vLLM's DFlash (the anchor is the bonus "
                "token there); use the dspark drafter for anchor-as-first-prediction"
            )
        return self


# ---------------------------------------------------------------- pure block functions


def position_weights(num_predictions: int, gamma: float) -> torch.Tensor:
    """[K] loss weight of draft positions k = 1..K: exp(-(k-1)/gamma)."""
    return torch.exp(-torch.arange(num_predictions, dtype=torch.float32) / gamma)


def dpace_weights(
    loss_rows: torch.Tensor,
    block: torch.Tensor,
    position: torch.Tensor,
    num_blocks: int,
    K: int,
    alpha: float,
) -> torch.Tensor:
    """D-PACE loss weights [N] of N counted predictions (no gradient flows through them).

    loss_rows [N] token losses, block [N] in 0..num_blocks-1, position [N] in 0..K-1 (each
    (block, position) at most once). With confidence c_i = (1 - alpha) * exp(-loss_i) + alpha
    (1 at positions that do not count), position k of a block weighs sum_{j >= k, counted}
    prod_{i <= j} c_i: the expected accepted tokens from k on if every draft were accepted with
    its confidence, so a position matters as much as the acceptance it can still unlock.
    """
    with torch.no_grad():
        conf = (1 - alpha) * torch.exp(-loss_rows.detach().float()) + alpha  # [N]
        smooth = torch.ones(num_blocks, K, device=loss_rows.device)  # [G, K]
        counted = torch.zeros(num_blocks, K, device=loss_rows.device)
        smooth[block, position] = conf
        counted[block, position] = 1.0
        prefix = torch.cumprod(smooth, 1) * counted
        suffix = prefix.flip(1).cumsum(1).flip(1) * counted  # [G, K]
        return suffix[block, position]


def anchor_candidates(loss_mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions that may anchor a block.

    Anchor a needs context before it (a >= 1, as at serve time where the prompt precedes the
    first anchor), must be a real token, and the block's first prediction, token a+1, must be
    a real loss-masked (assistant) token; later block tokens that are not simply don't count.
    """
    loss_mask, attention_mask = loss_mask.bool(), attention_mask.bool()
    next_counted = torch.zeros_like(loss_mask)
    next_counted[:, :-1] = loss_mask[:, 1:] & attention_mask[:, 1:]
    ok = attention_mask & next_counted
    ok[:, 0] = False
    return ok


def sample_anchors(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_anchors` distinct random anchors per row among `anchor_candidates`.

    Returns anchors [B, A] int64 (valid ones first, ascending; unused slots hold 0) and
    anchor_valid [B, A] bool, with A = min(max_anchors, most candidates of any row), at
    least 1 so shapes never vanish. `generator` None = the global RNG of the masks' device.
    """
    cand = anchor_candidates(loss_mask, attention_mask)  # [B, T]
    B, T = cand.shape
    A = max(1, min(max_anchors, int(cand.sum(1).max())))
    device = generator.device if generator is not None else cand.device
    keys = torch.rand(B, T, generator=generator, device=device).to(cand.device)
    keys = keys.masked_fill(~cand, 2.0)  # non-candidates sort last
    picked = keys.topk(A, dim=1, largest=False)
    anchors = torch.where(picked.values < 1.5, picked.indices, T).sort(dim=1).values  # [B, A]
    valid = anchors < T
    return anchors.masked_fill(~valid, 0), valid


def block_queries(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_len: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query tokens [B, A, L] = [anchor token, MASK x (L-1)] and their positions anchor + 0..L-1."""
    B, A = anchors.shape
    ids = torch.full((B, A, block_len), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    positions = anchors[..., None] + torch.arange(block_len, device=anchors.device)
    return ids, positions


def block_context_mask(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, seq_len: int, block_len: int
) -> torch.Tensor:
    """[B, A*L, T] bool (True = attend): which context positions each block slot sees, slots
    anchor-major (slot o of block i is row i*L + o). A block sees the context strictly before
    its anchor; an invalid anchor sees none (its own block still keeps its softmax finite).

    The block's own slots are not in this mask: they attend to each other through
    `block_attention`'s per-block part, so no [A*L, A*L] mask over all blocks exists.
    """
    visible = torch.arange(seq_len, device=anchors.device) < anchors[..., None]  # [B, A, T]
    visible = visible & anchor_valid[..., None]
    return visible.repeat_interleave(block_len, dim=1)  # [B, A*L, T]


def block_attention(
    q: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    context_bias: torch.Tensor | None,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    block_len: int,
    block_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every block's slots attend, in one softmax, to the context keys `context_bias` shows
    them and to the slots of their own block: all L (bidirectional), or with `block_mask` [L, L]
    bool (True = attend; `causal_block_mask`) the ones it shows -> [B, h, A*L, hd].

    q [B, h, A*L, hd] and block_k/v [B, kvh, A*L, hd]: the A blocks of a row side by side;
    context_k/v [B, kvh, T, hd] shared by all of them (never copied per anchor);
    context_bias [B, 1, A*L, T + 1] = shared_key_bias(block_context_mask(...)), None = the
    whole context. Cost: A*L x T for the context, A x L x L for the blocks.
    """
    B, h, N, hd = q.shape
    A, kvh = N // block_len, block_k.shape[1]
    own_lse, own_out = own_key_attention(
        q.view(B, h, A, block_len, hd),
        block_k.view(B, kvh, A, block_len, hd),
        block_v.view(B, kvh, A, block_len, hd),
        None if block_mask is None else block_mask[None, None],
    )  # [B, h, A, L], [B, h, A, L, hd]
    return attend_with_own_keys(
        q, context_k, context_v, own_lse.view(B, h, N), own_out.view(B, h, N, hd), context_bias
    )


def causal_block_mask(block_len: int, device: torch.device | None = None) -> torch.Tensor:
    """[L, L] bool: slot o of a block sees slots 0..o (vLLM runs the block causal when a file says
    sliding_window_non_causal false, the speculators trainer's default)."""
    return torch.ones(block_len, block_len, dtype=torch.bool, device=device).tril()


def context_window(
    visible: torch.Tensor | None, query_pos: torch.Tensor, context_len: int, window: int | None
) -> torch.Tensor | None:
    """Which context keys the block slots see on a layer: `visible` [B, A*L, T] (None = all) limited
    to the keys less than `window` positions behind each slot (query_pos [B, A*L]); context key j
    sits at position j. None = the whole context (full attention, no mask)."""
    if window is None:
        return visible
    inside = window_mask(query_pos, torch.arange(context_len, device=query_pos.device), window)  # [B, A*L, T]
    return inside if visible is None else visible & inside


def block_targets(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    num_predictions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, A, K] of the tokens predictions k = 1..K stand for (anchor + k), and
    whether each counts: inside the sequence, a real loss-masked token, from a valid anchor."""
    T = loss_mask.shape[1]
    positions = anchors[..., None] + torch.arange(1, num_predictions + 1, device=anchors.device)
    counted_tokens = loss_mask.bool() & attention_mask.bool()  # [B, T]
    safe = positions.clamp(max=T - 1).flatten(1)
    counted = counted_tokens.gather(1, safe).view_as(positions)
    return positions, counted & (positions < T) & anchor_valid[..., None]


def per_position(values: torch.Tensor, position: torch.Tensor, num_predictions: int) -> torch.Tensor:
    """Sum `values` [N] into [K] bins by draft position (0-based)."""
    out = torch.zeros(num_predictions, dtype=torch.float32, device=values.device)
    return out.index_add_(0, position, values.float())


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * x) / sum(w); 0 (still attached to the graph) when nothing counts."""
    return (values * weights).sum() / weights.sum().clamp_min(1e-6)


# ---------------------------------------------------------------- the module


class DecoderLayer(nn.Module):
    """Qwen3 decoder layer whose attention also reads the context keys/values (vLLM's names)."""

    def __init__(self, verifier: VerifierSpec, intermediate_size: int):
        super().__init__()
        H, eps = verifier.hidden_size, verifier.rms_norm_eps
        self.self_attn = Attention(
            H,
            verifier.num_attention_heads,
            verifier.num_key_value_heads,
            verifier.head_dim,
            qk_norm=True,
            eps=eps,
        )
        self.mlp = MLP(H, intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        context_bias: torch.Tensor | None,
        block_len: int,
        block_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, A*L, H] the hidden of A blocks of L slots; context_k/v [B, kvh, T, hd];
        context_bias [B, 1, A*L, T + 1] or None (whole context), block_mask [L, L] or None (the
        block both ways), see `block_attention`."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        q = attn.project_q(h, cos, sin)  # [B, heads, A*L, hd]
        k, v = attn.project_kv(h, cos, sin)  # [B, kvh, A*L, hd]
        out = block_attention(q, context_k, context_v, context_bias, k, v, block_len, block_mask)
        x = x + attn.output(out)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class BlockRows:
    """The counted predictions of a batch, one row each (N rows), ready for a loss."""

    hidden: torch.Tensor  # [N, H] draft hidden state after the final norm
    target: Targets  # [N] the verifier's distribution for the same token
    prev_ids: torch.Tensor  # [N] the token before the predicted one (data, teacher forced)
    position: torch.Tensor  # [N] draft position k - 1 (0-based)
    num_predictions: int  # K
    block: torch.Tensor | None = None  # [N] which block (b * A + a) the row belongs to
    num_blocks: int = 0  # B * A


class DFlashDrafter(nn.Module):
    """fc + hidden_norm -> context K/V of every layer; Qwen3 layers over the query block; norm;
    LM head (the verifier's, or its own over a reduced draft vocabulary)."""

    algo: ClassVar[str] = "dflash"
    architectures: ClassVar[tuple[str, ...]] = ("DFlashDraftModel",)
    format_cls: ClassVar[type[Format]]

    def __init__(
        self,
        config: BlockConfig,
        verifier: VerifierSpec,
        weights: VerifierWeights,
        d2t: torch.Tensor | None = None,
        loss: str | None = None,
    ):
        super().__init__()
        if loss is not None and loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; use 'kl' or 'ce'")
        if not 0 <= verifier.mask_token_id < verifier.vocab_size:
            raise ValueError(
                f"mask_token_id {verifier.mask_token_id} is outside the verifier's vocabulary "
                f"(0..{verifier.vocab_size - 1}); the drafter embeds it with the verifier's embeddings"
            )
        self.config, self.verifier, self.loss_kind = config, verifier, loss
        self.own_embeddings = False
        self.windows = config.layer_windows(config.num_layers)  # per layer: sliding window or None
        H, eps = verifier.hidden_size, verifier.rms_norm_eps
        self.fc = nn.Linear(len(verifier.aux_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, eps)
        inter = config.intermediate_size or verifier.intermediate_size
        self.layers = nn.ModuleList(DecoderLayer(verifier, inter) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, eps)
        # The verifier's frozen tensors: buffers outside the state dict, never exported (vLLM
        # shares embed_tokens and, with the full vocabulary, lm_head from the verifier).
        self.register_buffer("embed_tokens", weights.embed_tokens.detach(), persistent=False)
        self.register_buffer("verifier_norm", weights.norm.detach(), persistent=False)
        self.register_buffer("verifier_lm_head", weights.lm_head.detach(), persistent=False)
        # float32 on purpose and not a buffer: module.to(bfloat16) must not coarsen rotations.
        self.inv_freq = rope_inv_freq(verifier.head_dim, verifier.rope_theta, verifier.rope_scaling)
        if d2t is None:
            self.lm_head = None
            self.register_buffer("d2t", None)
            self.register_buffer("t2d", None)
        else:
            d2t = d2t.detach().long().cpu()
            kept = kept_ids(d2t)  # target ids of the draft vocabulary
            t2d = t2d_from_d2t(d2t, verifier.vocab_size)
            self.lm_head = nn.Linear(H, d2t.numel(), bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(weights.lm_head.detach()[kept.to(weights.lm_head.device)])
            self.lm_head.weight.requires_grad_(config.train_lm_head)
            self.register_buffer("d2t", d2t)
            self.register_buffer("t2d", t2d)

    # ---- shape of a block

    @property
    def num_predictions(self) -> int:
        """Draft tokens one full block proposes (K)."""
        return self.config.predictions_per_block

    @property
    def first_prediction(self) -> int:
        """Block offset of prediction k=1: 0 when the anchor predicts, else 1."""
        return 0 if self.config.sample_from_anchor else 1

    @property
    def draft_vocab_size(self) -> int:
        return self.verifier.vocab_size if self.d2t is None else self.d2t.numel()

    # ---- pieces

    def rope_freq(self, device: torch.device) -> torch.Tensor:
        """inv_freq on `device`, moved there once: a host tensor read by every forward would be
        copied to the GPU twice a forward (it is not a buffer, see __init__)."""
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def context_kv(
        self, aux_hidden_states: torch.Tensor, start: int = 0
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux_hidden_states [B, T, n_aux, H] at positions start..start+T-1 -> per layer (k, v)
        [B, kvh, T, hd]. Each position's K/V depends on that position alone (fc, norm, rope)."""
        B, T = aux_hidden_states.shape[:2]
        context = self.hidden_norm(
            self.fc(aux_hidden_states.flatten(2).to(self.fc.weight.dtype))
        )  # [B, T, H]
        positions = torch.arange(start, start + T, device=context.device).expand(B, T)
        cos, sin = rope_cos_sin(positions, self.rope_freq(positions.device))
        return [layer.self_attn.project_kv(context, cos, sin) for layer in self.layers]

    def run_blocks(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        context: list[tuple[torch.Tensor, torch.Tensor]],
        context_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """ids/positions [B, A, L], context from `context_kv`, context_mask [B, A*L, T] from
        `block_context_mask` (None = every block sees the whole context) -> hidden [B, A, L, H]
        after the final norm. Each block also sees all of itself."""
        B, A, L = ids.shape
        x = F.embedding(ids.flatten(1), self.embed_tokens).to(self.fc.weight.dtype)  # [B, A*L, H]
        cos, sin = rope_cos_sin(positions.flatten(1), self.rope_freq(positions.device))  # [B, A*L, hd]
        block_mask = causal_block_mask(L, x.device) if self.config.block_causal else None
        # one additive mask per attention window for all layers (a bool one would become a float
        # copy per layer); full attention without sliding layers: one, as before
        biases: dict[int | None, torch.Tensor | None] = {}
        for window, (layer, (k, v)) in zip(self.windows, zip(self.layers, context, strict=True), strict=True):
            if window not in biases:
                visible = context_window(context_mask, positions.flatten(1), k.shape[2], window)
                biases[window] = None if visible is None else shared_key_bias(visible, attention_dtype(x))
            x = layer(x, cos, sin, k, v, biases[window], L, block_mask)
        return self.norm(x).view(B, A, L, -1)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_draft] base draft logits."""
        if self.lm_head is None:
            return F.linear(hidden.to(self.verifier_lm_head.dtype), self.verifier_lm_head)
        # through the module, so the engine's kernel (specctl.kernels) reaches the draft head too
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def full_stats(self) -> bool:
        """Whether this step needs the verifier's full-vocabulary argmax / logsumexp."""
        return full_stats_needed(self.training, self.loss_kind)

    def targets(self, batch: dict[str, torch.Tensor], rows: torch.Tensor | None = None) -> TargetTable:
        """The verifier's distribution at `rows` [B, T] (None = every scored position), computed once."""
        return batch_targets(
            batch,
            self.verifier_norm,
            self.verifier_lm_head,
            self.verifier.rms_norm_eps,
            self.t2d,
            rows=rows,
            full=self.full_stats(),
        )

    # ---- training

    def gather_rows(self, batch: dict[str, torch.Tensor]) -> BlockRows:
        """Sample anchors, run their blocks, and keep the predictions that count."""
        input_ids = batch["input_ids"]
        loss_mask, attention_mask = batch["loss_mask"].bool(), batch["attention_mask"].bool()
        T = input_ids.shape[1]
        # validation draws the same anchors every time and leaves the training RNG alone
        generator = None if self.training else torch.Generator(device=input_ids.device).manual_seed(0)
        anchors, anchor_valid = sample_anchors(loss_mask, attention_mask, self.config.max_anchors, generator)
        L, K, first = self.config.block_size, self.num_predictions, self.first_prediction
        ids, positions = block_queries(input_ids, anchors, L, self.verifier.mask_token_id)
        mask = block_context_mask(anchors, anchor_valid, T, L)  # [B, A*L, T]
        hidden = self.run_blocks(ids, positions, self.context_kv(batch["aux_hidden_states"]), mask)
        hidden = hidden[:, :, first : first + K]  # [B, A, K, H]
        target_pos, counted = block_targets(anchors, anchor_valid, loss_mask, attention_mask, K)
        b, a, k = counted.nonzero(as_tuple=True)
        before = target_pos[b, a, k] - 1  # the verifier predicts token j at position j-1
        needed = torch.zeros_like(loss_mask)  # [B, T]: only the positions the blocks reach
        needed[b, before] = True
        return BlockRows(
            hidden=hidden[b, a, k],
            target=self.targets(batch, needed).at(b, before),
            prev_ids=input_ids[b, before],
            position=k,
            num_predictions=K,
            block=b * anchors.shape[1] + a,
            num_blocks=anchors.numel(),
        )

    def rows_loss(self, rows: BlockRows) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Position-weighted draft loss and per-position accuracy of the gathered rows."""
        # a chunk of rows at a time: [N, V_draft] logits for a whole step would not fit a GPU
        loss_rows, correct, usable = chunked_draft_loss(
            self.draft_logits, rows.hidden, rows.target, self.t2d, self.loss_kind
        )
        loss = weighted_mean(loss_rows, self.row_weights(rows, loss_rows) * usable)
        return loss, self.position_metrics(rows, correct, loss)

    def row_weights(self, rows: BlockRows, loss_rows: torch.Tensor) -> torch.Tensor:
        """[N] loss weight of each row's draft position (`position_weights` of the config)."""
        c = self.config
        if c.position_weights == "dpace":
            if rows.block is None:
                raise ValueError("D-PACE weights need the rows' blocks (BlockRows.block)")
            return dpace_weights(
                loss_rows, rows.block, rows.position, rows.num_blocks, rows.num_predictions, c.dpace_alpha
            )
        return position_weights(rows.num_predictions, c.gamma).to(loss_rows.device)[rows.position]

    def position_metrics(
        self, rows: BlockRows, correct: torch.Tensor, loss: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Per-position counts, and accuracy when the verifier's argmax was formed (`correct` None:
        a KL training step, which never reads it)."""
        K = rows.num_predictions
        metrics = {
            "loss": loss.detach(),
            "count": per_position(torch.ones_like(rows.position), rows.position, K),
        }
        if correct is not None:
            metrics["correct"] = per_position(correct, rows.position, K)
        return metrics

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.rows_loss(self.gather_rows(batch))

    # ---- proposing (what vLLM computes at serve time, recomputed from the full context)

    def cached_context_kv(
        self, aux_hidden_states: torch.Tensor, state: dict[str, Any] | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Context K/V [1, kvh, N, hd] per layer of the N verified positions [N, n_aux, H].

        With `state` (one dict per request, kept by the caller between proposals) only the
        positions not seen before are projected: a request's verified prefix only grows, so
        the K/V of earlier positions never change -- vLLM keeps them in the drafter's KV cache.
        """
        if state is None:
            return self.context_kv(aux_hidden_states[None])
        N = aux_hidden_states.shape[0]
        done = cached_rows(state, N)
        if done < N:
            new = self.context_kv(aux_hidden_states[None, done:], start=done)
            old = state.get("context_kv")
            if old is not None:
                new = [
                    (torch.cat([k0, k], 2), torch.cat([v0, v], 2))
                    for (k0, v0), (k, v) in zip(old, new, strict=True)
                ]
            state.update(context_rows=N, context_kv=new)
        return state["context_kv"]

    def propose_hidden(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Hidden states [K, H] of the K predictions after input_ids[-1] (the anchor)."""
        N = aux_hidden_states.shape[0]
        if input_ids.shape[0] != N + 1:
            raise ValueError(f"propose needs N+1 = {N + 1} input ids for N = {N} feature rows")
        if not 1 <= num_tokens <= self.num_predictions:
            raise ValueError(f"num_tokens must be in 1..{self.num_predictions}, got {num_tokens}")
        first = self.first_prediction
        L = num_tokens + first  # vLLM's query block: 1 + K slots, or K when the anchor predicts
        ids, positions = block_queries(
            input_ids[None], torch.tensor([[N]], device=input_ids.device), L, self.verifier.mask_token_id
        )
        context = self.cached_context_kv(aux_hidden_states, state)
        hidden = self.run_blocks(ids, positions, context, None)[0, 0]
        return hidden[first : first + num_tokens]

    @torch.no_grad()
    def propose_with_logits(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy draft [K] and the draft logits [K, Vd] it is the argmax of (adaptive
        verification estimates each draft's acceptance from them, as vLLM does)."""
        hidden = self.propose_hidden(input_ids, aux_hidden_states, num_tokens, state)
        logits = self.draft_logits(hidden)  # [K, Vd]
        return draft_to_target(logits.argmax(-1), self.d2t), logits

    # ---- export (speculators format, as vLLM's qwen3_dflash.py loads it)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Tensors named as vLLM loads them; the module's state dict is exactly that set."""
        out = {name: t.detach().clone().contiguous() for name, t in self.state_dict().items()}
        if self.own_embeddings:
            out["embed_tokens.weight"] = self.embed_tokens.detach().clone().contiguous()
        return out

    def load_export_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_exact(self, tensors)

    def adopt_embeddings(self, weight: torch.Tensor) -> None:
        """Draft with token embeddings of its own (a file whose embed_tokens differ from the verifier's)."""
        self.embed_tokens = weight.detach().to(self.embed_tokens.device)
        self.own_embeddings = True

    def export_fields(self) -> dict[str, Any]:
        """config.json as a dict: the shared fields, then the block drafter's."""
        v, c = self.verifier, self.config
        layer = v.layer_config("qwen3", c.num_layers, self.layers[0].mlp.gate_proj.out_features, self.windows)
        tokens = c.num_speculative_tokens or self.num_predictions
        fields = base_fields(
            self.algo,
            self.architectures,
            layer,
            self.draft_vocab_size,
            tokens,
            v.name_or_path,
            v.architectures,
        )
        return {
            **fields,
            "aux_hidden_state_layer_ids": list(v.aux_layer_ids),
            "mask_token_id": v.mask_token_id,
            "block_size": c.block_size,
            "sample_from_anchor": c.sample_from_anchor,
            # vLLM: dflash_config.causal = not this, for every layer
            "sliding_window_non_causal": not c.block_causal,
            "specctl": specctl_record(self.algo, c, v, self.loss_kind),
        }

    def export_config(self) -> Format:
        return self.format_cls.model_validate(self.export_fields())


class Format(SpeculatorsConfig):
    """config.json of a DFlash drafter: the shared fields plus these (vLLM's defaults when absent)."""

    aux_hidden_state_layer_ids: list[int]
    mask_token_id: int
    block_size: int | None = None
    sample_from_anchor: bool = False
    sliding_window_non_causal: bool = True

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.aux_hidden_state_layer_ids)


DFlashDrafter.format_cls = Format


# ---------------------------------------------------------------- build / reload


def config_from_format(config: Format, config_cls: type[BlockConfig]) -> BlockConfig:
    """The drafter's config: specctl's record when present, else what the speculators fields say."""
    if config.layer.model_type != "qwen3" or config.layer.attention_bias:
        raise ValueError(
            f"transformer_layer_config: model_type {config.layer.model_type!r}, attention_bias "
            f"{config.layer.attention_bias}; block drafters here have qwen3 layers without biases"
        )
    if config.specctl is not None and config.specctl.drafter:
        return config_cls(**config.specctl.drafter)
    # the format's fields as vLLM reads them (its defaults where the file is silent)
    fields = {k: getattr(config, k) for k in type(config).model_fields if k in config_cls.model_fields}
    fields = {k: v for k, v in fields.items() if v is not None}
    fields["num_layers"] = config.layer.num_hidden_layers
    fields["intermediate_size"] = config.layer.intermediate_size
    fields.setdefault(
        "block_size", config.speculative_tokens + 1 - int(fields.get("sample_from_anchor", False))
    )
    fields["num_speculative_tokens"] = config.speculative_tokens
    fields["block_causal"] = not config.sliding_window_non_causal
    fields.update(WindowedConfig.window_settings(config.layer.windows()))
    return config_cls(**fields)


def build(
    config: Config,
    verifier: VerifierSpec,
    weights: VerifierWeights,
    d2t: torch.Tensor | None,
    loss: str | None,
) -> DFlashDrafter:
    return DFlashDrafter(config, verifier, weights, d2t, loss)


SPEC = DrafterSpec(
    name="dflash",
    config_cls=Config,
    format_cls=Format,
    build=build,
    config_from_format=lambda config: config_from_format(config, Config),
    speculators_model_type="dflash",
    architectures=DFlashDrafter.architectures,
    vllm_method={"method": "dflash"},
    vllm_needs=(Need.DFLASH,),
    vllm_stacks_k_norm=True,  # qwen3_dflash.py _normalize_context_k
    tiny={"num_layers": 1, "block_size": 4, "max_anchors": 8},
    published=lambda c: c.num_layers == 5 and c.block_size == 16,
)
