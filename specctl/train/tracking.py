"""Experiment trackers for `specctl train` (`train.report_to`): TensorBoard, Weights & Biases or
Trackio, through accelerate's tracker classes (the API SpecForge's and speculators' `--report-to`
use). metrics.jsonl stays the record every specctl tool reads; a tracker gets a copy of each line.

The tracker runs on the rank that writes metrics.jsonl (`main_process_only = False`: specctl
decides the rank). accelerate's tracker classes log through its logger, which needs accelerate's
process state: `PartialState()` is created then, after specctl has set up torch.distributed, so
it adopts that process group rather than starting one. The packages are optional
(`pip install specctl[tensorboard]`, `[wandb]`, `[trackio]`); a missing one fails before training
starts, with the install line.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from specctl.errors import SpecctlError, first_line
from specctl.redact import redact_tree

# report_to -> (modules that provide it, the pip extra / package to install)
TRACKERS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
NONE = "none"


def check_tracker(report_to: str) -> None:
    """Fail now, with what to install, when `report_to`'s package is missing."""
    if report_to == NONE:
        return
    modules, package = TRACKERS[report_to]
    if not any(importlib.util.find_spec(m) is not None for m in modules):
        raise SpecctlError(
            f"train.report_to: {report_to} needs the {package} package: pip install "
            f"'specctl[{package}]' (or pip install {package}), or set train.report_to none"
        )


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str | None]:
    """A nested recipe as `section.field` -> scalar (lists as text): what trackers take as
    hyperparameters."""
    out: dict[str, bool | int | float | str | None] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif value is None or isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics.jsonl record, per-position lists spread as `name/i` (1-based,
    the draft position): what a tracker plots. `step` is the x axis, not a series."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            out[key] = value
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            out.update({f"{key}/{i + 1}": v for i, v in enumerate(value)})
    return out


class Tracker:
    """One accelerate tracker, started: `log(record)` per metrics.jsonl line, `finish()` at the end."""

    def __init__(self, inner: Any):
        self.inner = inner

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self.inner.log(values, step=record.get("step"))

    def finish(self) -> None:
        self.inner.finish()


def open_tracker(
    report_to: str, out_dir: Path, project: str, run_name: str, config: dict[str, Any], first_step: int
) -> Tracker | None:
    """Start the tracker `report_to` names (None for `none`), with the recipe as its hyperparameters.

    TensorBoard writes to out_dir/tensorboard and drops events past `first_step` (a resumed run's
    interrupted tail, as metrics.jsonl does); wandb and trackio log to project `project` (the
    recipe's name), run `run_name` (the algorithm).
    """
    if report_to == NONE:
        return None
    check_tracker(report_to)
    from accelerate import PartialState, tracking

    PartialState()

    if report_to == "tensorboard":
        inner = tracking.TensorBoardTracker("tensorboard", str(out_dir), purge_step=first_step)
    elif report_to == "wandb":
        inner = tracking.WandBTracker(project, name=run_name, dir=str(out_dir))
    else:
        inner = tracking.TrackioTracker(project, name=run_name)
    inner.main_process_only = False  # specctl picks the rank
    try:
        inner.start()
        inner.store_init_configuration(flat_config(redact_tree(config)))  # no credential leaves
    except Exception as e:  # a login, a network, a dashboard that will not start
        raise SpecctlError(f"train.report_to: {report_to} could not start ({first_line(e)})") from None
    return Tracker(inner)
