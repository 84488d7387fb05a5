"""A fifth algorithm in one file, outside specctl: `blockwise`, a thin DFlash variant (shorter
blocks, two layers) under its own name and speculators_model_type.

`SPECCTL_DRAFTERS=tests/drafter_variant.py specctl train RECIPE --algo blockwise` trains it, and
export and bench take it like any other drafter; nothing in specctl names it. vLLM has no method
for it (`vllm_method=None`), so the vLLM backends refuse it with one line.
"""

from __future__ import annotations

from pydantic import Field

from specctl.drafters.api import DrafterSpec
from specctl.drafters.dflash import BlockConfig, DFlashDrafter, config_from_format
from specctl.drafters.dflash import Format as DFlashFormat


class Config(BlockConfig):
    """`drafter.blockwise`: DFlash with short blocks."""

    num_layers: int = Field(2, ge=1, description="Draft decoder layers.")
    block_size: int = Field(5, ge=2, description="Query block length: the anchor plus masked slots.")


class Format(DFlashFormat):
    """config.json of a blockwise drafter: DFlash's fields, nothing more."""


class BlockwiseDrafter(DFlashDrafter):
    algo = "blockwise"
    architectures = ("BlockwiseDraftModel",)
    format_cls = Format


def build(config, verifier, weights, d2t, loss):
    return BlockwiseDrafter(config, verifier, weights, d2t, loss)


SPEC = DrafterSpec(
    name="blockwise",
    config_cls=Config,
    format_cls=Format,
    build=build,
    config_from_format=lambda config: config_from_format(config, Config),
    speculators_model_type="blockwise",
    architectures=BlockwiseDrafter.architectures,
    vllm_method=None,
    tiny={"num_layers": 1, "block_size": 4, "max_anchors": 8},
)
