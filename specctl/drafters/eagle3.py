"""EAGLE-3: the autoregressive baseline drafter, in the layout vLLM's `llama_eagle3.py` loads.

The verifier's aux hidden states (n_aux of them, concatenated) go through `fc` to H; layer 0
attends over `[input_layernorm(embed(token)), hidden_norm(hidden)]` (2H in-features); later
layers are plain Llama layers; `norm` + `lm_head` give the draft logits. Drafting feeds the
drafter's own pre-norm output back as the next step's `hidden`, one forward pass per token.

Alignment (vLLM `set_inputs_first_pass`): drafter row t holds token x_{t+1}, the verifier's
feature at t and position t; it predicts x_{t+2}, whose verifier distribution is at t+1.
Training-time test (TTT) unrolls steps s = 0..S-1: step s at row t is teacher-forced with
x_{t+1+s}, takes step s-1's output at row t as its hidden, sits at position t+s, attends to
the step-0 rows 0..t plus its own steps 1..s (`ttt_attention`: causal attention over the
step-0 rows merged with the row's own s keys, no mask over all steps), and is scored against
the verifier's distribution at t+1+s. That is exactly the K/V cache vLLM holds when it drafts
token s+1 after anchor t, so what training sees is what serving computes.

The backbone (`Eagle3Backbone`) is shared with P-EAGLE, which drafts with the same layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from specctl.attention_kernels import grouped_kv
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
    attend_after_prefix,
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
from specctl.drafters.vocab import check_d2t, t2d_from_d2t
from specctl.speculators.config import SpeculatorsConfig, base_fields
from specctl.trees import DraftTree, select_top_nodes
from specctl.vllm.capabilities import Need

LayerStyle = Literal["llama", "qwen3"]


class Config(WindowedConfig):
    """Recipe section `drafter.eagle3`; defaults follow the speculators EAGLE-3 trainer."""

    num_layers: int = Field(1, ge=1, description="Decoder layers of the drafter (EAGLE-3 uses one).")
    ttt_steps: int = Field(
        3, ge=1, description="Training-time-test unroll: draft steps trained per position (speculators: 3)."
    )
    ttt_step_loss_decay: float = Field(
        1.0, gt=0, description="Weight of step s in the loss is decay**s (1.0 = all steps equal)."
    )
    num_speculative_tokens: int = Field(
        3, ge=1, description="Tokens drafted per verification at serve time (config `speculative_tokens`)."
    )
    norm_before_residual: bool = Field(
        False, description="Layer 0 keeps hidden_norm(hidden) as its residual instead of the raw hidden."
    )
    norm_before_fc: bool = Field(
        False, description="RMSNorm (`input_norm`) over the concatenated aux features before `fc`."
    )
    fc_norm: bool = Field(False, description="One RMSNorm (`fc_norm.i`) per aux feature before `fc`.")
    norm_output: bool = Field(
        False, description="Feed the normed (not the pre-norm) output back as the next step's hidden."
    )
    draft_layers: LayerStyle = Field(
        "llama",
        description="Decoder layer style: llama (as published EAGLE-3) or qwen3 (q_norm/k_norm on the "
        "heads, the speculators trainer's default); vLLM serves both.",
    )

    def trained_speculative_tokens(self) -> int:
        return self.ttt_steps

    def window_span(self) -> int:
        return max(self.ttt_steps, self.num_speculative_tokens)


# ---------------------------------------------------------------- pure helpers


def ttt_attention(
    q: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor],
    own: tuple[torch.Tensor, torch.Tensor] | None,
    causal: bool,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one TTT step's queries -> [B, h, n, hd].

    q [B, h, n, hd]; context (k, v) [B, kvh, R, hd]: the step-0 rows (what vLLM has cached);
    own (k, v) [B, kvh, n, s, hd]: the query row's own steps 1..s (the tokens it drafted
    itself, this step included), None at step 0. causal: query row t sees context rows 0..t
    (training: the n = R step-s rows sit on the context rows); else every context row
    (propose: the one query row comes after all of them). Never another row's drafts.

    Step s thus costs R x R / 2 (causal SDPA, no mask tensor) + R x s, not the R x (s+1)R of
    one softmax over every cached step behind a dense mask. `visible` [n, R] bool replaces the
    causal rule on a sliding layer (`Eagle3Backbone.context_visible`); the own keys are the newest
    positions, always inside the window.
    """
    k, v = context
    if own is None:
        if visible is not None:
            k, v, gqa = grouped_kv(q, k, v, visible)  # on CUDA: K/V at q's heads, for the mask
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)
        k, v, gqa = grouped_kv(q, k, v, None, causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    own_lse, own_out = own_key_attention(q[:, :, :, None], *own, None)  # [B, h, n, 1], [B, h, n, 1, hd]
    if visible is not None:
        bias = shared_key_bias(visible[None], attention_dtype(q))  # [1, 1, n, R + 1]
        return attend_with_own_keys(q, k, v, own_lse[..., 0], own_out[..., 0, :], bias)
    return attend_with_own_keys(q, k, v, own_lse[..., 0], own_out[..., 0, :], is_causal=causal)


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, i] -> x[:, i+n] along dim 1, filling the last n columns with `fill`."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


# ---------------------------------------------------------------- backbone


class DecoderLayer(nn.Module):
    """One Llama (or Qwen3: q_norm/k_norm) layer as vLLM's EAGLE-3 runs it; layer 0 takes
    [embeds, hidden] (2H)."""

    def __init__(
        self, verifier: VerifierSpec, layer_idx: int, norm_before_residual: bool, style: LayerStyle = "llama"
    ):
        super().__init__()
        H, eps = verifier.hidden_size, verifier.rms_norm_eps
        self.layer_idx = layer_idx
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        if layer_idx == 0:
            self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(
            H,
            verifier.num_attention_heads,
            verifier.num_key_value_heads,
            verifier.head_dim,
            in_features=2 * H if layer_idx == 0 else H,
            qk_norm=style == "qwen3",
            eps=eps,
        )
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, verifier.intermediate_size)

    def attn_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (attention input [.., 2H or H], residual [.., H]), vLLM's fused add-norm order."""
        if self.layer_idx == 0:
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual = hidden
                hidden = self.hidden_norm(hidden)
            return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual
        residual = hidden + residual
        return self.input_layernorm(residual), residual

    def mlp_output(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


# attend(layer_idx, attn, x [B, M, d_in], cos, sin) -> [B, M, H]: how one layer's queries meet keys
AttendFn = Callable[[int, Attention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Eagle3Backbone(nn.Module):
    """fc + decoder layers + norm + lm_head, named exactly as vLLM's Eagle3LlamaForCausalLM loads.

    The persistent state_dict IS the export: fc.weight, [input_norm.weight], [fc_norm.i.weight],
    layers.N.*, norm.weight, lm_head.weight, [d2t, t2d] (+ mask_hidden in P-EAGLE). The verifier's
    embeddings, final norm and LM head are non-persistent buffers: frozen, shared at serve time.
    """

    algo = "eagle3"
    architectures: tuple[str, ...] = ("Eagle3DraftModel",)
    export_reshapeable: tuple[str, ...] = ()  # tensors a file may hold in another shape of the same size

    def __init__(
        self,
        verifier: VerifierSpec,
        weights: VerifierWeights,
        d2t: torch.Tensor | None,
        loss: str,
        *,
        num_layers: int,
        norm_before_residual: bool,
        norm_before_fc: bool,
        fc_norm: bool = False,
        norm_output: bool = False,
        style: LayerStyle = "llama",
        windows: tuple[int | None, ...] | None = None,
    ):
        super().__init__()
        if loss is not None and loss not in LOSSES:
            raise ValueError(f"unknown loss kind {loss!r}; use 'kl' or 'ce'")
        H, V = verifier.hidden_size, verifier.vocab_size
        n_aux = len(verifier.aux_layer_ids)
        if tuple(weights.embed_tokens.shape) != (V, H) or tuple(weights.lm_head.shape) != (V, H):
            raise ValueError(f"verifier embed_tokens/lm_head must be [{V}, {H}]")
        self.verifier, self.loss_kind, self.norm_output = verifier, loss, norm_output
        self.style, self.own_embeddings = style, False
        self.windows = windows or (None,) * num_layers  # per layer: sliding window or None
        self.register_buffer("embed_tokens", weights.embed_tokens.detach(), persistent=False)
        self.register_buffer("verifier_norm", weights.norm.detach(), persistent=False)
        self.register_buffer("verifier_lm_head", weights.lm_head.detach(), persistent=False)
        self.register_buffer(
            "inv_freq",
            rope_inv_freq(verifier.head_dim, verifier.rope_theta, verifier.rope_scaling),
            persistent=False,
        )
        if norm_before_fc:
            self.input_norm = RMSNorm(n_aux * H, verifier.rms_norm_eps)
        if fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(H, verifier.rms_norm_eps) for _ in range(n_aux))
        self.fc = nn.Linear(n_aux * H, H, bias=False)
        self.layers = nn.ModuleList(
            DecoderLayer(verifier, i, norm_before_residual, style) for i in range(num_layers)
        )
        self.norm = RMSNorm(H, verifier.rms_norm_eps)
        d2t = check_d2t(d2t, V)
        kept = torch.arange(V) if d2t is None else torch.arange(d2t.numel()) + d2t
        self.lm_head = nn.Linear(H, kept.numel(), bias=False)
        with torch.no_grad():  # start from the verifier's head: draft == verifier's own readout
            self.norm.weight.copy_(weights.norm)
            self.lm_head.weight.copy_(weights.lm_head[kept.to(weights.lm_head.device)])
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", None if d2t is None else t2d_from_d2t(d2t, V))

    # -- pieces shared by training and proposing

    def combine(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., n_aux, H] verifier features -> [..., H] (vLLM `combine_hidden_states`)."""
        x = aux_hidden_states.flatten(-2).to(self.fc.weight.dtype)  # [..., n_aux*H]
        if hasattr(self, "input_norm"):
            x = self.input_norm(x)
        if hasattr(self, "fc_norm"):
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x)

    def run_layers(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, attend: AttendFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, M] (target ids), hidden [B, M, H], positions [B, M] -> (normed out, fed-back hidden)."""
        embeds = F.embedding(tokens, self.embed_tokens).to(hidden.dtype)  # [B, M, H]
        cos, sin = rope_cos_sin(positions, self.inv_freq)  # [B, M, hd]
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer.attn_input(embeds, hidden, residual)
            hidden, residual = layer.mlp_output(attend(i, layer.self_attn, x, cos, sin), residual)
        pre = hidden + residual  # vLLM's final fused add-norm
        out = self.norm(pre)
        return out, (out if self.norm_output else pre)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_to_target(draft_ids, self.d2t)

    def context_visible(
        self, query_pos: torch.Tensor, num_keys: int, causal: bool
    ) -> list[torch.Tensor | None] | None:
        """Per layer, the context rows [n, num_keys] bool the queries (at query_pos [n]) see on a
        sliding layer -- row j sits at position j; with `causal`, query row t sees rows 0..t --
        and None on a full layer; None when no layer slides (the mask-free path)."""
        if all(w is None for w in self.windows):
            return None
        keys = torch.arange(num_keys, device=query_pos.device)
        out: list[torch.Tensor | None] = []
        for window in self.windows:
            visible = window_mask(query_pos, keys, window)
            if visible is not None and causal:
                visible = visible & (keys <= torch.arange(query_pos.numel(), device=keys.device)[:, None])
            out.append(visible)
        return out

    def targets(self, batch: dict[str, torch.Tensor]) -> TargetTable:
        """The verifier's distribution at every scored position of the batch, computed once
        (each TTT step / depth scores a shifted view of the same positions)."""
        return batch_targets(
            batch,
            self.verifier_norm,
            self.verifier_lm_head,
            self.verifier.rms_norm_eps,
            self.t2d,
            full=full_stats_needed(self.training, self.loss_kind),
        )

    def score(self, out: torch.Tensor, target: Targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft rows [n, H] vs the verifier's distribution there [n] -> (loss, correct, valid) [n],
        the [n, V_draft] logits formed a chunk of rows at a time (`chunked_draft_loss`)."""
        return chunked_draft_loss(self.lm_head, out, target, self.t2d, self.loss_kind)

    # -- export

    def export_state(self) -> dict[str, torch.Tensor]:
        """Tensors under the names vLLM's Eagle3LlamaForCausalLM.load_weights accepts."""
        out = {k: v.detach().clone().contiguous() for k, v in self.state_dict().items()}
        if self.own_embeddings:
            out["embed_tokens.weight"] = self.embed_tokens.detach().clone().contiguous()
        return out

    def load_export_state(self, tensors: dict[str, torch.Tensor]) -> None:
        load_exact(self, tensors, self.export_reshapeable)

    def adopt_embeddings(self, weight: torch.Tensor) -> None:
        """Draft with token embeddings of its own (a file whose embed_tokens differ from the verifier's)."""
        self.embed_tokens = weight.detach().to(self.embed_tokens.device)
        self.own_embeddings = True

    def layer_config(self) -> dict[str, Any]:
        """`transformer_layer_config`: the draft decoder as an HF config (vocab = the verifier's)."""
        v = self.verifier
        return v.layer_config(self.style, len(self.layers), v.intermediate_size, self.windows)

    def base_export_config(self, model_type: str, tokens: int) -> dict[str, Any]:
        v = self.verifier
        fields = base_fields(
            model_type,
            self.architectures,
            self.layer_config(),
            self.lm_head.out_features,
            tokens,
            v.name_or_path,
            v.architectures,
        )
        return {**fields, "eagle_aux_hidden_state_layer_ids": list(v.aux_layer_ids)}


class Format(SpeculatorsConfig):
    """config.json of an EAGLE-3 drafter: the shared fields plus these (vLLM's defaults when absent)."""

    eagle_aux_hidden_state_layer_ids: list[int]
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.eagle_aux_hidden_state_layer_ids)


def layer_settings(config: SpeculatorsConfig) -> dict[str, Any]:
    """The recipe fields the draft decoder's config fixes: layer count, style, attention windows."""
    layer = config.layer
    if layer.model_type not in ("llama", "qwen3"):
        raise ValueError(
            f"transformer_layer_config.model_type {layer.model_type!r}: EAGLE-3 drafters here have llama or "
            "qwen3 layers"
        )
    if layer.attention_bias:
        raise ValueError("transformer_layer_config.attention_bias true: these draft layers have no biases")
    return {
        "num_layers": layer.num_hidden_layers,
        "draft_layers": layer.model_type,
        **WindowedConfig.window_settings(layer.windows()),
    }


# ---------------------------------------------------------------- EAGLE-3

# frontier width and children per node of EAGLE-3's tree (EAGLE-2: 10 and 10 for 60 nodes): at the
# <= 31 nodes and depth K <= 5 a CPU verifier pass affords, 8 candidates per depth cover the kept
# nodes, and the frontier rows cost one drafter forward per depth, as the chain's one row does
TREE_TOP_K = 8


class _CandidatePool:
    """The candidate tree EAGLE-3's top-k expansion grows, in creation order (parents first, a
    node's children together in rank order: a DraftTree) and its frontier, the best `top_k`
    nodes of the newest depth by cumulative log-prob."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.tokens: list[torch.Tensor] = []  # per depth [M_d] draft ids
        self.parents: list[torch.Tensor] = []  # per depth [M_d] pool indices (-1: the root)
        self.values: list[torch.Tensor] = []  # per depth [M_d] cumulative log-probs
        self.size = 0
        self.frontier = torch.empty(0, dtype=torch.long)  # [F] pool indices
        self.frontier_tokens = torch.empty(0, dtype=torch.long)  # [F] draft ids
        self.frontier_values = torch.zeros(1)  # [F]; the root's 0 before the first expansion

    def expand(self, logprobs: torch.Tensor) -> torch.Tensor:
        """logprobs [F, Vd]: each frontier node's (the root's, first) next-token log-probs ->
        [F'] the frontier row each new frontier node is a child of. Adds each row's top_k
        children to the pool; the best top_k of them (ties: the earlier) become the frontier."""
        F_, V = logprobs.shape
        lp, ids = logprobs.topk(min(self.top_k, V), dim=-1)  # [F, k] each, best first
        k = lp.shape[1]
        values = (self.frontier_values.to(lp.device)[:, None] + lp).flatten()  # [F*k], row-major
        parents = self.frontier.to(lp.device) if self.size else torch.full((1,), -1, device=lp.device)
        best = torch.sort(values, descending=True, stable=True).indices[: self.top_k].sort().values  # [F']
        self.tokens.append(ids.flatten())
        self.parents.append(parents.repeat_interleave(k))
        self.values.append(values)
        self.frontier = self.size + best
        self.frontier_tokens, self.frontier_values = ids.flatten()[best], values[best]
        self.size += F_ * k
        return best // k

    def tree(self) -> DraftTree:
        """Every candidate as a DraftTree (draft ids)."""
        depths = [torch.full_like(t, d + 1) for d, t in enumerate(self.tokens)]
        return DraftTree(
            tokens=torch.cat(self.tokens),
            parents=torch.cat(self.parents),
            depths=torch.cat(depths),
            log_values=torch.cat(self.values),
        )


class Eagle3Drafter(Eagle3Backbone):
    algo = "eagle3"

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
            fc_norm=config.fc_norm,
            norm_output=config.norm_output,
            style=config.draft_layers,
            windows=config.layer_windows(config.num_layers),
        )
        self.config = config

    @staticmethod
    def _attend(
        cache: list[list[tuple[torch.Tensor, torch.Tensor]]],
        causal: bool,
        visible: list[torch.Tensor | None] | None,
        i: int,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One draft step: append this step's K/V to layer i's cache, attend as `ttt_attention`.

        cache[i] holds (k, v) [B, kvh, n_k, hd] of steps 0..s-1: step 0 = the context rows,
        later steps the rows being drafted (all R rows in training, the newest row in propose).
        visible: `context_visible` of this step (None: no sliding layer).
        """
        q = attn.project_q(x, cos, sin)
        cache[i].append(attn.project_kv(x, cos, sin))
        steps = cache[i][1:]
        own = None
        if steps:  # [B, kvh, n, s, hd]: row t's own steps 1..s side by side
            own = torch.stack([k for k, _ in steps], 3), torch.stack([v for _, v in steps], 3)
        return attn.output(
            ttt_attention(q, cache[i][0], own, causal, None if visible is None else visible[i])
        )

    def ttt_outputs(self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """Normed outputs [B, T-1, H] of TTT steps 0..S-1 (row t of step s predicts x_{t+2+s})."""
        B, T = input_ids.shape
        R = T - 1
        hidden = self.combine(aux_hidden_states[:, :R])  # [B, R, H]
        positions = torch.arange(R, device=input_ids.device).expand(B, R)
        cache: list[list] = [[] for _ in self.layers]
        rows = torch.arange(R, device=input_ids.device)
        outs = []
        for s in range(self.config.ttt_steps):
            tokens = shift_left(input_ids, 1 + s)[:, :R]  # x_{t+1+s}; padding past the end
            attend = partial(self._attend, cache, True, self.context_visible(rows + s, R, causal=True))
            out, hidden = self.run_layers(tokens, hidden, positions + s, attend)
            outs.append(out)
        return outs

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        input_ids = batch["input_ids"]
        R = input_ids.shape[1] - 1
        # a row is scored where the token it predicts is a real assistant token
        target_ok = batch["loss_mask"].bool() & batch["attention_mask"].bool()  # [B, T]
        S = self.config.ttt_steps
        correct = torch.zeros(S, device=input_ids.device)
        count = torch.zeros(S, device=input_ids.device)
        step_loss = torch.zeros(S, device=input_ids.device)
        loss = torch.zeros((), device=input_ids.device)
        targets = self.targets(batch)
        for s, out in enumerate(self.ttt_outputs(input_ids, batch["aux_hidden_states"])):
            b, t = shift_left(target_ok, 2 + s, False)[:, :R].nonzero(as_tuple=True)
            rows_loss, ok, valid = self.score(out[b, t], targets.at(b, t + 1 + s))
            mean = rows_loss.sum() / valid.sum().clamp(min=1)
            loss = loss + self.config.ttt_step_loss_decay**s * mean
            step_loss[s], count[s] = mean.detach(), b.numel()
            if ok is not None:  # None: a KL training step formed no full-vocabulary argmax
                correct[s] = ok.sum()
        metrics = {"loss": loss.detach(), "count": count, "step_loss": step_loss}
        if targets.targets.argmax is not None:
            metrics["correct"] = correct
        return loss, metrics

    @staticmethod
    def _attend_new_context(
        cache: list[list[tuple[torch.Tensor, torch.Tensor]]],
        old: list[tuple[torch.Tensor, torch.Tensor]],
        windows: tuple[int | None, ...],
        i: int,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Step 0 over the context rows not seen before: x [1, n, H] are rows done..N-1, old[i]
        the K/V [1, kvh, done, hd] of rows 0..done-1 from earlier proposals. Row done+j sees
        rows 0..done+j; cache[i] gets the K/V of all N rows."""
        q = attn.project_q(x, cos, sin)
        k, v = attn.project_kv(x, cos, sin)
        k, v = torch.cat([old[i][0], k], 2), torch.cat([old[i][1], v], 2)  # [1, kvh, N, hd]
        cache[i].append((k, v))
        return attend_after_prefix(attn, q, k, v, windows[i])

    def _context_pass(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        depth: int,
        state: dict[str, Any] | None,
    ) -> tuple[list[list], torch.Tensor, torch.Tensor]:
        """Step 0 over the context rows (those `state` lacks): -> (per layer [context (k, v)
        [1, kvh, N, hd]], normed out [1, 1, H] and fed-back hidden [1, 1, H] of the newest row,
        whose out makes the first draft). `state` then holds the N rows' K/V."""
        N = aux_hidden_states.shape[0]
        if input_ids.shape[0] != N + 1:
            raise ValueError(f"propose needs N+1 input ids for N feature rows, got {input_ids.shape[0]}, {N}")
        windows = [w for w in self.windows if w is not None]
        if windows and depth >= min(windows):
            raise ValueError(f"{depth} drafts do not fit the sliding window of {min(windows)} positions")
        # the newest row is always run: its output makes the first draft
        done = min(cached_rows(state, N), N - 1)
        tokens = input_ids[1 + done :][None]  # [1, N - done]
        hidden = self.combine(aux_hidden_states[None, done:])  # [1, N - done, H]
        positions = torch.arange(done, N, device=input_ids.device)[None]
        cache: list[list] = [[] for _ in self.layers]
        if done:
            old = [(k[:, :, :done], v[:, :, :done]) for k, v in state["context_kv"]]
            attend = partial(self._attend_new_context, cache, old, self.windows)
        else:
            attend = partial(self._attend, cache, True, self.context_visible(positions[0], N, causal=True))
        out, hidden = self.run_layers(tokens, hidden, positions, attend)
        if state is not None:
            state.update(context_rows=N, context_kv=[layer_cache[0] for layer_cache in cache])
        return cache, out[:, -1:], hidden[:, -1:]

    @torch.no_grad()
    def propose_with_logits(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K greedy drafts [K] after input_ids[-1] and the draft logits [K, Vd] each was the argmax
        of (adaptive verification estimates acceptance from them, as vLLM does).

        With `state` (one dict per request, kept by the caller between proposals) the context
        rows' K/V are kept, as in vLLM's drafter KV cache, and only rows not seen before are
        run: a request's verified prefix only grows, so those K/V never change.
        """
        N, device = aux_hidden_states.shape[0], input_ids.device
        cache, out, hidden = self._context_pass(input_ids, aux_hidden_states, num_tokens, state)
        drafts, logits = [], []
        for s in range(num_tokens):
            if s:  # step s: the newest draft (at N-1+s), after all the context and its own steps
                later = self.context_visible(torch.tensor([N - 1 + s], device=device), N, causal=False)
                positions = torch.full((1, 1), N - 1 + s, device=device)
                attend = partial(self._attend, cache, False, later)
                out, hidden = self.run_layers(drafts[-1].view(1, 1), hidden, positions, attend)
            logits.append(self.lm_head(out)[0, 0])  # [Vd]
            drafts.append(self.to_target_ids(logits[-1].argmax()))
        return torch.stack(drafts), torch.stack(logits)

    @staticmethod
    def _attend_frontier(
        context: list[tuple[torch.Tensor, torch.Tensor]],
        own: list[tuple[torch.Tensor, torch.Tensor] | None],
        visible: list[torch.Tensor | None] | None,
        i: int,
        attn: Attention,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One tree depth d: x [1, F, d_in] the F frontier nodes side by side. Each row attends
        the context (k, v) [1, kvh, N, hd] and its own steps: own[i] (k, v) [1, kvh, F, d-1, hd]
        holds row f's ancestors' K/V (None at depth 1); this depth's K/V are appended to it --
        the chain's `_attend` for F chains at once, whose steps are each row's root path."""
        q = attn.project_q(x, cos, sin)  # [1, h, F, hd]
        k, v = attn.project_kv(x, cos, sin)  # [1, kvh, F, hd]
        k, v = k[:, :, :, None], v[:, :, :, None]
        if own[i] is not None:
            k, v = torch.cat([own[i][0], k], 3), torch.cat([own[i][1], v], 3)
        own[i] = k, v  # [1, kvh, F, d, hd]
        sliding = None if visible is None else visible[i]
        return attn.output(ttt_attention(q, context[i], own[i], False, sliding))

    @torch.no_grad()
    def propose_tree(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        depth: int,
        max_nodes: int,
        state: dict[str, Any] | None = None,
        top_k: int | None = None,
    ) -> DraftTree:
        """EAGLE-2's dynamic draft tree after input_ids[-1] (inputs as `propose_with_logits`): at
        most `max_nodes` nodes of depth <= `depth`, tokens in the verifier's vocabulary.

        Depth by depth, the frontier -- the `top_k` best nodes of that depth by cumulative
        log-prob -- runs through the drafter in ONE forward (`_attend_frontier`), each frontier
        node proposes its top_k children, and the best top_k children form the next frontier;
        finally the best `max_nodes` of all candidates are kept (`select_top_nodes`). top_k
        defaults to min(max_nodes, TREE_TOP_K): a kept node of sibling rank r needs r better
        siblings kept, so ranks >= max_nodes are never used. The context pass and its cache in
        `state` are the chain's: a top_k 1 tree of depth K is propose_with_logits's chain.
        """
        if max_nodes < 1 or depth < 1:
            raise ValueError(f"a draft tree needs depth >= 1 and max_nodes >= 1, got {depth}, {max_nodes}")
        top_k = top_k or min(max_nodes, TREE_TOP_K)
        N, device = aux_hidden_states.shape[0], input_ids.device
        cache, out, hidden = self._context_pass(input_ids, aux_hidden_states, depth, state)
        context = [layer_cache[0] for layer_cache in cache]
        own: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        pool = _CandidatePool(top_k)
        pool.expand(torch.log_softmax(self.lm_head(out)[0].float(), -1))  # the root's children: depth 1
        hidden = hidden.expand(1, pool.frontier.numel(), -1)  # [1, F, H]: all fed by the root's row
        for d in range(1, depth):
            positions = torch.full((1, pool.frontier.numel()), N - 1 + d, device=device)
            visible = self.context_visible(positions[0], N, causal=False)
            tokens = self.to_target_ids(pool.frontier_tokens)[None]  # [1, F]
            attend = partial(self._attend_frontier, context, own, visible)
            out, fed = self.run_layers(tokens, hidden, positions, attend)  # [1, F, H] each
            rows = pool.expand(torch.log_softmax(self.lm_head(out)[0].float(), -1))  # [F'] parents' rows
            hidden = fed[:, rows]  # [1, F', H]: the row that proposed each new frontier node
            own = [(k[:, :, rows], v[:, :, rows]) for k, v in own]  # their root paths' K/V
        tree = select_top_nodes(pool.tree(), max_nodes)
        return replace(tree, tokens=self.to_target_ids(tree.tokens))

    def export_config(self) -> Format:
        c = self.config
        return Format.model_validate(
            {
                **self.base_export_config("eagle3", c.num_speculative_tokens),
                "norm_before_residual": c.norm_before_residual,
                "norm_before_fc": c.norm_before_fc,
                "fc_norm": c.fc_norm,
                "norm_output": c.norm_output,
                "specctl": specctl_record(self.algo, c, self.verifier, self.loss_kind),
            }
        )


def build(
    config: Config,
    verifier: VerifierSpec,
    weights: VerifierWeights,
    d2t: torch.Tensor | None,
    loss: str | None,
) -> Eagle3Drafter:
    return Eagle3Drafter(config, verifier, weights, d2t, loss)


def config_from_format(config: Format) -> Config:
    """The recipe section a config.json describes (training-only settings from its `specctl` block)."""
    saved = config.specctl.drafter if config.specctl is not None else {}
    return Config(
        **{
            **saved,
            **layer_settings(config),
            "num_speculative_tokens": config.speculative_tokens,
            "norm_before_residual": config.norm_before_residual,
            "norm_before_fc": config.norm_before_fc,
            "fc_norm": config.fc_norm,
            "norm_output": config.norm_output,
        }
    )


SPEC = DrafterSpec(
    name="eagle3",
    config_cls=Config,
    format_cls=Format,
    build=build,
    config_from_format=config_from_format,
    speculators_model_type="eagle3",
    architectures=Eagle3Drafter.architectures,
    vllm_method={"method": "eagle3"},
    vllm_needs=(Need.EAGLE3,),
    tiny={"ttt_steps": 2, "num_speculative_tokens": 2},
    published=lambda c: c.num_layers == 1 and c.ttt_steps >= 3,
    parallel=False,
    tree="expand",
)
