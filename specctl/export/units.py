"""Sizes for people: the byte counts the export and hub summaries print, in binary units.

Its own module so that the export directory's summary and the hub's push plan, two jobs of the
export stage, print sizes alike without one importing the other. The unit is in the name:
specctl.estimate.si_bytes is the SI spelling (`12.4 kB`) for the disk estimates of collect and
the data stage, which compare against `df`-style free space.
"""

from __future__ import annotations


def binary_bytes(n: int) -> str:
    """Binary units (powers of 1024), one decimal past bytes: 950 B, 1.5 KiB, 16.0 MiB, 2,048.0 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"
