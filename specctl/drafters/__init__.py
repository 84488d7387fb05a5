"""Drafters, one file per algorithm, each registering its `DrafterSpec` here by name.

Algorithms are discovered, not listed: every module of this package is imported (the shared ones
-- api, layers, targets, vocab -- register nothing), then the modules named by the `specctl.drafters`
entry-point group and by the SPECCTL_DRAFTERS environment variable (comma-separated module names or
.py files): a team's own algorithm, or a test's, joins without a change to specctl.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from importlib.metadata import entry_points
from pathlib import Path

from specctl.drafters.api import DrafterConfig, DrafterSpec, VerifierSpec, VerifierWeights

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


def _import_file(path: Path) -> None:
    name = f"specctl_drafter_{path.stem}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{ENV}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _discover() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")
    for entry in entry_points(group="specctl.drafters"):
        entry.load()
    for item in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        if item.endswith(".py"):
            _import_file(Path(item).expanduser().resolve())
        else:
            importlib.import_module(item)


_discover()

__all__ = [
    "DEFAULT_ALGO",
    "DRAFTERS",
    "DrafterConfig",
    "DrafterSpec",
    "VerifierSpec",
    "VerifierWeights",
    "register",
]
