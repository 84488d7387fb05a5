"""The speculators checkpoint format's config.json, typed: what vLLM and the speculators library read.

`SpeculatorsConfig` holds the fields every algorithm shares -- the draft decoder's HF config
(`transformer_layer_config`: geometry, rope, attention windows), the draft vocabulary, the proposal
(`speculative_tokens`, vLLM's `num_speculative_tokens`), the verifier -- and `to_json` / `from_json`.
Each algorithm's file subclasses it with its own fields only (EAGLE-3's norm flags, DFlash's block
size, ...), as torchtitan's state-dict adapters extend one base. The training loop, engine and bench
read typed fields (`config.speculative_tokens`, `layer.rope()`), never a dict path.

Defaults are what vLLM reads when a field is absent (its speculators `algos.py`), so a file from
another tool means the same here as in vLLM. A file parsed and written back keeps every field it
had, unknown ones included (`extra="allow"`, written with `exclude_unset`). Fields the speculators
library (0.9.0) fills in that vLLM ignores -- `speculators_version`, `dtype` -- are written too, so
its `SpeculatorModel.from_pretrained` reads our exports as its own.

Field facts checked against vLLM 0.32 (`transformers_utils/configs/speculators/`) and speculators
0.9.0: docs/architecture.md, "The format adapter".
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The speculators release whose config.json this writes (field names and defaults checked against it).
SPECULATORS_VERSION = "0.9.0"
SLIDING, FULL = "sliding_attention", "full_attention"


class FormatError(ValueError):
    """config.json does not parse: `field` is the dotted path, `reason` says what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"field {field!r} {reason}")
        self.field, self.reason = field, reason


class _Model(BaseModel):
    # unknown keys are kept and written back: HF configs and other tools carry many more
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class LayerConfig(_Model):
    """`transformer_layer_config`: the draft decoder's HF config (vocab = the verifier's)."""

    model_type: str = "llama"
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = Field(None, ge=1)
    attention_bias: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def rope(self) -> tuple[float, dict[str, Any] | None]:
        """(theta, scaling or None for plain rope) from rope_theta / rope_scaling / rope_parameters
        (transformers 5 keeps both in rope_parameters); `type` is read as `rope_type`."""
        params = dict(self.rope_parameters or {})
        theta = self.rope_theta if self.rope_theta is not None else params.get("rope_theta", 10000.0)
        for source in (self.rope_scaling, params):
            scaling = {k: v for k, v in (source or {}).items() if k != "rope_theta"}
            if "type" in scaling:
                scaling["rope_type"] = scaling.pop("type")
            if scaling.get("rope_type", "default") != "default":
                return float(theta), scaling
        return float(theta), None

    def windows(self) -> tuple[int | None, ...]:
        """Per draft layer: its sliding window, None for full attention -- as vLLM reads it (only an
        explicit `layer_types` makes a layer sliding; `sliding_window` is then its width)."""
        if self.layer_types is None:
            return (None,) * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise FormatError(
                "transformer_layer_config.layer_types",
                f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise FormatError("transformer_layer_config.layer_types", f"holds {unknown[0]!r}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise FormatError(
                "transformer_layer_config.sliding_window", "is missing (layer_types has sliding layers)"
            )
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)


def window_fields(windows: tuple[int | None, ...]) -> dict[str, Any]:
    """The transformer_layer_config fields that describe per-layer windows (the inverse of
    `LayerConfig.windows`), with the HF Qwen3 companions `use_sliding_window` / `max_window_layers`."""
    widths = {w for w in windows if w is not None}
    if len(widths) > 1:
        raise ValueError(f"one sliding window width per drafter, got {sorted(widths)}")
    sliding = [i for i, w in enumerate(windows) if w is not None]
    return {
        "layer_types": [SLIDING if w is not None else FULL for w in windows],
        "sliding_window": widths.pop() if widths else None,
        "use_sliding_window": bool(sliding),
        "max_window_layers": sliding[0] if sliding else len(windows),
    }


def rope_fields(theta: float, scaling: dict[str, Any] | None) -> dict[str, Any]:
    """rope_theta, rope_scaling and transformers 5's rope_parameters for a verifier's rope."""
    scaling = dict(scaling or {})
    scaling.pop("rope_theta", None)
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    return {
        "rope_theta": theta,
        "rope_scaling": scaling if kind != "default" else None,
        "rope_parameters": {"rope_theta": theta, "rope_type": kind, **scaling},
    }


class Proposal(_Model):
    proposal_type: str = "greedy"
    speculative_tokens: int = Field(ge=1)
    verifier_accept_k: int = 1
    accept_tolerance: float = 0.0


class VerifierRef(_Model):
    name_or_path: str | None  # required by vLLM's parser, may be null (then pass the verifier yourself)
    architectures: list[str] = Field(default_factory=list)


class SpeculatorsBlock(_Model):
    algorithm: str
    proposal_methods: list[Proposal] = Field(min_length=1)
    default_proposal_method: str = "greedy"
    verifier: VerifierRef


class SpecctlRecord(_Model):
    """The `specctl` block (vLLM and the speculators library ignore it): what rebuilds the module
    exactly -- the recipe's drafter section, the training loss, the verifier spec it was built for."""

    algo: str | None = None
    drafter: dict[str, Any] = Field(default_factory=dict)
    loss: str | None = None
    verifier: dict[str, Any] | None = None


class SpeculatorsConfig(_Model):
    """config.json of a speculators-format drafter; subclasses add one algorithm's fields."""

    # vLLM's fields read before anything else (validate_speculators_config), checked in this order
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "speculators_model_type",
        "transformer_layer_config",
        "transformer_layer_config.vocab_size",
        "transformer_layer_config.hidden_size",
        "speculators_config.proposal_methods.0.speculative_tokens",
        "speculators_config.verifier.name_or_path",
    )

    speculators_model_type: str
    architectures: list[str] = Field(default_factory=list)
    transformer_layer_config: LayerConfig
    draft_vocab_size: int | None = Field(None, ge=1)
    target_hidden_size: int | None = None
    speculators_config: SpeculatorsBlock
    speculators_version: str = SPECULATORS_VERSION
    dtype: str | None = None
    mask_token_id: int | None = None  # parallel drafters' mask token (required there)
    specctl: SpecctlRecord | None = None

    # ---- typed views every consumer reads

    @property
    def layer(self) -> LayerConfig:
        return self.transformer_layer_config

    @property
    def speculative_tokens(self) -> int:
        """Tokens drafted per step at serve time (vLLM's num_speculative_tokens)."""
        return self.speculators_config.proposal_methods[0].speculative_tokens

    @property
    def verifier_name(self) -> str | None:
        return self.speculators_config.verifier.name_or_path

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Verifier layers the drafter reads (HF output_hidden_states ids); each algorithm's subclass
        names the field, so a config parsed without knowing its algorithm cannot say."""
        raise FormatError(
            "speculators_model_type",
            f"{self.speculators_model_type!r}: no specctl drafter reads this format's aux layers",
        )

    # ---- JSON

    def to_json(self) -> dict[str, Any]:
        """The config.json object: fields set at construction or read from a file, none other."""
        return self.model_dump(mode="json", exclude_unset=True)

    @classmethod
    def from_json(cls, data: Any) -> SpeculatorsConfig:
        """Parse a config.json object; FormatError names the first field that is wrong."""
        if not isinstance(data, dict):
            raise FormatError("(top level)", f"must be a JSON object, got {type(data).__name__}")
        for dotted in cls.REQUIRED:
            if not _has(data, dotted):
                raise FormatError(dotted, "is missing")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "missing":
                raise FormatError(where, "is missing") from None
            raise FormatError(where, f"{err['msg'].lower()} (got {err.get('input')!r:.60})") from None


def _has(data: Any, dotted: str) -> bool:
    node = data
    for part in dotted.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return False
    return True


def base_fields(
    model_type: str,
    architectures: tuple[str, ...],
    layer: dict[str, Any],
    draft_vocab_size: int,
    speculative_tokens: int,
    verifier_name: str,
    verifier_architectures: tuple[str, ...],
) -> dict[str, Any]:
    """The shared fields of an export, in the order the speculators library writes them."""
    return {
        "speculators_model_type": model_type,
        "architectures": list(architectures),
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name, "architectures": list(verifier_architectures)},
        },
        "speculators_version": SPECULATORS_VERSION,
    }
