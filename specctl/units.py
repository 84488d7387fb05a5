"""Sizes for people: the byte counts the export and hub summaries print, in binary units.

A bottom module so that the stages which print a size (export, hub) need not import each other
for it. specctl.estimate keeps its own SI spelling (`12.4 kB`) for the disk estimates of collect
and the data stage, which compare against `df`-style free space.
"""

from __future__ import annotations


def human_bytes(n: int) -> str:
    """Binary units, one decimal past bytes: 950 B, 1.5 KiB, 16.0 MiB, 2,048.0 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"
