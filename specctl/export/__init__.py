"""The export stage: `specctl export`, trained checkpoints written as speculators directories
vLLM loads, checked, and pushed to the hub.

directory.py writes an export directory (from a checkpoint, or an export re-cast to another
dtype) with its card, origin and tokenizer; card.py is the model card; hub.py the upload; units.py
the byte sizes both print. The format itself (config, validation, the two files) is
specctl.speculators, which bench reads too; the checkpoint an export comes from is
specctl.checkpoint, which training writes. The entry points are re-exported here, with
`load_drafter` at the path docs/serving.md first named.
"""

from specctl.export.directory import (
    ExportResult,
    convert_export,
    export_drafter,
    export_drafters,
    names_export,
    save_drafter,
)
from specctl.speculators.io import load_drafter

__all__ = [
    "ExportResult",
    "convert_export",
    "export_drafter",
    "export_drafters",
    "load_drafter",
    "names_export",
    "save_drafter",
]
