"""Drafters, one file per algorithm, registered here by name."""

from specctl.drafters.api import DrafterConfig, DrafterSpec, VerifierSpec, VerifierWeights

DRAFTERS: dict[str, DrafterSpec] = {}


def register(spec: DrafterSpec) -> DrafterSpec:
    DRAFTERS[spec.name] = spec
    return spec


def _load_builtin() -> None:
    # Each module calls register() at import; importing them here fills DRAFTERS.
    import importlib

    for name in ("eagle3", "peagle", "dflash", "dspark"):
        try:
            importlib.import_module(f"specctl.drafters.{name}")
        except ModuleNotFoundError as e:  # a drafter not written yet in this checkout
            if e.name != f"specctl.drafters.{name}":
                raise


_load_builtin()

__all__ = ["DRAFTERS", "DrafterConfig", "DrafterSpec", "VerifierSpec", "VerifierWeights", "register"]
