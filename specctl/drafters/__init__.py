"""Drafters, one file per algorithm, registered here by name."""

from specctl.drafters.api import DrafterConfig, DrafterSpec, VerifierSpec, VerifierWeights

DRAFTERS: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    DRAFTERS[spec.name] = spec
    return spec


# Each algorithm's module calls register() when imported; a fifth algorithm adds one name here.
from specctl.drafters import dflash, dspark, eagle3, peagle  # noqa: E402, F401

__all__ = ["DRAFTERS", "DrafterConfig", "DrafterSpec", "VerifierSpec", "VerifierWeights", "register"]
