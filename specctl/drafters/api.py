"""The contract between drafters and the rest of specctl.

The trainer, exporter and engine only ever see these types and the four methods of a
drafter module; everything algorithm-specific stays in that algorithm's file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict


class DrafterConfig(BaseModel):
    """Base of each algorithm's recipe section (`drafter.<algo>`): strict, documented fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


@dataclass(frozen=True)
class VerifierSpec:
    """What a drafter needs to know about its verifier: read from the verifier's HF config.

    `aux_layer_ids` uses the HF `output_hidden_states` convention (0 = embeddings,
    k = residual stream after k decoder layers); see formats.md "Layer indexing".
    """

    name_or_path: str
    architectures: tuple[str, ...]
    hidden_size: int
    vocab_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    model_type: str = "llama"


@dataclass
class VerifierWeights:
    """Frozen verifier tensors a drafter borrows: token embeddings, final norm, LM head.

    The final norm + LM head turn the stored last hidden state into the verifier's
    next-token distribution (the training target); vLLM shares embed/lm_head at serve time.
    """

    embed_tokens: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


class Drafter(Protocol):
    """What every drafter module offers (an `nn.Module` in practice).

    forward(batch) -> (loss, metrics). batch (right-padded, one row per sample):
        input_ids          [B, T]        int64
        loss_mask          [B, T]        bool   (assistant tokens)
        attention_mask     [B, T]        bool   (real tokens, False on padding)
        aux_hidden_states  [B, T, n_aux, H]
        last_hidden_state  [B, T, H]     verifier's final hidden state (targets)
    metrics holds at least `correct` [K] and `count` [K] (per draft position, summed over
    the batch, computed against the verifier's argmax) so validation can form tau_hat.

    propose(input_ids [N+1], aux_hidden_states [N, n_aux, H], num_tokens K, state=None) -> [K]
    int64 drafts the K tokens that follow input_ids[-1] given the verifier's features of the
    first N tokens. `state` is a dict the caller keeps per request (the verified prefix only
    grows between calls); a drafter may cache its work on that prefix there, and must give
    the same drafts with or without it. Optional: propose_with_confidence(same) -> ([K] drafts,
    [K] per-position acceptance confidences or None); the engine then cuts the block where the
    product of confidences drops below its threshold (DSpark's dynamic draft length).
    """

    algo: str
    verifier: VerifierSpec  # the engine reads aux_layer_ids from it

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def propose(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> torch.Tensor: ...

    def export_state(self) -> dict[str, torch.Tensor]: ...

    def export_config(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DrafterSpec:
    """One algorithm, as registered in `specctl.drafters.DRAFTERS`.

    build(config, verifier, weights, d2t, loss) -> module
        `d2t` is the draft->target offset table (None = full vocabulary), `loss` "kl"|"ce".
    from_export(config_json, tensors, weights) -> module
        rebuilds the module from a speculators-format directory's contents.
    """

    name: str
    config_cls: type[DrafterConfig]
    build: Callable[..., Any]
    from_export: Callable[..., Any]
    speculators_model_type: str
    architectures: tuple[str, ...]
