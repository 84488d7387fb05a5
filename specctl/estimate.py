"""Estimates printed before long work, and the one refusal they make: a feature store that will not fit.

The data stage prints its generation plan (conversations, a bound on new tokens, then a wall-time
estimate from the first finished conversations); collect prints the feature store's size from
its layout (`features.layout_bytes_per_token`) against the free space where it is written, and
refuses to start when it does not fit, unless forced (`collect-hidden-states --force`): a store
that fills the disk hours in stops there, with nothing usable.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from specctl.errors import SpecctlError
from specctl.features import FP8, Layout


class DiskSpaceError(SpecctlError):
    """The estimate says the output will not fit on the disk (pass --force to start anyway)."""


def si_bytes(n: float) -> str:
    """SI units (powers of 1000, as `df -H`), three significant figures: 950 B, 12.4 kB, 5.08 TB."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    """1,234 / 12.3k / 4.5M / 1.2B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:,.0f}"


def free_bytes(path: Path) -> int:
    """Free space (for this user) on the file system `path` is, or will be, on."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def describe_layout(layout: Layout) -> str:
    target = f"top-{layout.topk} targets" if layout.target == "topk" else f"{layout.dtype} final state"
    aux = "fp8 aux" if layout.aux_dtype == FP8 else f"{layout.aux_dtype} aux"
    return f"{aux} + {target}"


@dataclass(frozen=True)
class StoreEstimate:
    """The disk a feature store needs: `tokens` x `bytes_per_token`, less what is already written."""

    path: Path
    samples: int
    tokens: int
    bytes_per_token: int
    layout: Layout
    written: int = 0  # bytes of finished shards already in the store
    exact: bool = True  # False: tokens are an estimate (before the data exists)

    @property
    def need(self) -> int:
        return max(0, self.tokens * self.bytes_per_token - self.written)

    def line(self, free: int) -> str:
        about = "" if self.exact else "~"
        left = f", {si_bytes(self.written)} already written" if self.written else ""
        return (
            f"collect: {about}{self.samples:,} samples, {about}{human_count(self.tokens)} tokens x "
            f"{self.bytes_per_token:,} B/token ({describe_layout(self.layout)}) = {about}"
            f"{si_bytes(self.tokens * self.bytes_per_token)} of features{left}; "
            f"{si_bytes(free)} free at {self.path}"
        )


def check_store_fits(estimate: StoreEstimate, force: bool, say=None) -> None:
    """Print the estimate; DiskSpaceError (one line, the numbers) if it does not fit and not `force`."""
    free = free_bytes(estimate.path)
    if say is not None:
        say(estimate.line(free))
    if estimate.need <= free:
        return
    message = (
        f"the feature store needs {'~' if not estimate.exact else ''}{si_bytes(estimate.need)} more "
        f"({human_count(estimate.tokens)} tokens x {estimate.bytes_per_token:,} B/token, "
        f"{describe_layout(estimate.layout)}) but {estimate.path} has {si_bytes(free)} free; free space, "
        "collect fewer or shorter samples (data.max_samples, data.max_length), store compact features "
        "(features.aux_dtype=fp8, features.target=topk) or train online (train.mode=online), "
        "or pass --force"
    )
    if not force:
        raise DiskSpaceError(message)
    if say is not None:
        say(f"warning (--force): {message}")
