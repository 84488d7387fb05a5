"""The rich consoles every command prints through: as wide as the terminal on a terminal, and
without a width limit when the output is a file or a pipe.

Rich sizes a console that is not a terminal at $COLUMNS or 80 columns, so in a SLURM or CI log a
summary cut its paths (`runs/probe/drafters/dflash/checkpoi…`) and the bench table wrapped its
per-position values one per line. A log file has no width: tables there take the width their
cells need (`LOG_WIDTH` bounds it only so a runaway cell cannot make a megabyte line).
"""

from __future__ import annotations

from rich.console import Console, ConsoleDimensions

LOG_WIDTH = 4096


class FittedConsole(Console):
    """A rich Console whose width follows its stream at each print: the terminal's when it is one,
    else LOG_WIDTH. Decided per print, not at creation, because the streams can change under a
    module-level console (tests capture them; a command redirects them)."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        return size if self.is_terminal else ConsoleDimensions(LOG_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


def make_console(stderr: bool = False) -> Console:
    """The console for stdout (summaries, tables) or stderr (notes, progress, errors)."""
    return FittedConsole(stderr=stderr)
