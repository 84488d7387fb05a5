"""Learning curves: held-out tau_hat against the training tokens a drafter has seen.

`specctl train` validates every `train.eval_every` steps and writes each validation to
metrics.jsonl with `tokens_seen`; these functions read those records back and plot them, one line
per drafter, so a user sees whether more steps (the curve still rising) or more data (the curve
flat while the training loss falls: the held-out set stopped improving) would pay. The training
stage writes drafters/<algo>/learning-curve.png; `make results` one figure for all algorithms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curve:
    """One drafter's validations in step order: tokens seen, tau_hat, per-position accuracy."""

    tokens: list[int] = field(default_factory=list)
    tau_hat: list[float] = field(default_factory=list)
    accuracy: list[list[float]] = field(default_factory=list)  # [validation][draft position]


def read_curve(metrics_path: Path) -> Curve:
    """The validation records of a metrics.jsonl (those without `tokens_seen`, from a run resumed
    from an older checkpoint, are left out); a torn last line is skipped."""
    curve = Curve()
    for line in Path(metrics_path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "tau_hat" in record and "tokens_seen" in record:
            curve.tokens.append(int(record["tokens_seen"]))
            curve.tau_hat.append(float(record["tau_hat"]))
            curve.accuracy.append([float(a) for a in record.get("val_acc_per_position", [])])
    return curve


def plot_curves(curves: dict[str, Curve], path: Path, title: str = "held-out tau_hat") -> Path:
    """One line per drafter (name -> Curve): tau_hat against training tokens, written to `path` (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, curve in curves.items():
        if curve.tokens:
            ax.plot([t / 1e6 for t in curve.tokens], curve.tau_hat, marker="o", markersize=3, label=name)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("tau_hat (accepted tokens per step, bonus included)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(c.tokens for c in curves.values()):
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
