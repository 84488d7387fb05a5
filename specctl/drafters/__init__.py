"""Drafters, one file per algorithm, each exporting its `DrafterSpec` as a module-level `SPEC`.

Algorithms are discovered, not listed: every module of this package is imported and its `SPEC`
registered here by name (the shared ones -- api, layers, targets, vocab -- have none), then the
modules named by the `specctl.drafters` entry-point group and by the SPECCTL_DRAFTERS environment
variable (comma-separated module names or .py files): a team's own algorithm, or a test's, joins
without a change to specctl. An algorithm module imports `specctl.drafters.api`, never this
package: registration runs one way, from here, so there is no import loop to keep in order.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType
from typing import Any

from specctl.drafters.api import (
    ConfidenceDrafter,
    Drafter,
    DrafterConfig,
    DrafterSpec,
    VerifierSpec,
    VerifierWeights,
    greedy_propose,
)

DRAFTERS: dict[str, DrafterSpec] = {}
DEFAULT_ALGO = "dflash"  # the recipe's drafter.algo default: the published parallel drafter
ENV = "SPECCTL_DRAFTERS"


def register(spec: DrafterSpec) -> DrafterSpec:
    """Add an algorithm; its name and speculators_model_type must be new (a module imported twice
    under two names would otherwise shadow the first silently)."""
    for other in DRAFTERS.values():
        if other.name == spec.name or other.speculators_model_type == spec.speculators_model_type:
            if other.format_cls is spec.format_cls:  # the same module, imported again
                return other
            raise ValueError(
                f"drafter {spec.name!r} ({spec.speculators_model_type}) clashes with the registered "
                f"{other.name!r} ({other.speculators_model_type})"
            )
    DRAFTERS[spec.name] = spec
    return spec


def _collect(found: Any) -> None:
    """Register what a discovered module exports as `SPEC` (an entry point may name the spec
    itself); a module without one -- a shared helper -- adds nothing."""
    spec = found if isinstance(found, DrafterSpec) else getattr(found, "SPEC", None)
    if isinstance(spec, DrafterSpec):
        register(spec)


def _import_file(path: Path) -> ModuleType:
    name = f"specctl_drafter_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{ENV}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        _collect(importlib.import_module(f"{__name__}.{info.name}"))
    for entry in entry_points(group="specctl.drafters"):
        _collect(entry.load())
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        if item.endswith(".py"):
            _collect(_import_file(Path(item).expanduser().resolve()))
        else:
            _collect(importlib.import_module(item))


_discover()

__all__ = [
    "DEFAULT_ALGO",
    "DRAFTERS",
    "ConfidenceDrafter",
    "Drafter",
    "DrafterConfig",
    "DrafterSpec",
    "VerifierSpec",
    "VerifierWeights",
    "greedy_propose",
    "register",
]
