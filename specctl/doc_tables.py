"""Tables the docs carry but the code owns (the vLLM capability table in serving.md, the bench
backend table in benchmarking.md): each lives between a BEGIN and an END comment line of its
page, and `make docs` rewrites it from the code, so the page cannot drift from what runs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from specctl.errors import UsageError


def splice(text: str, table: str, begin: str, end: str, what: str) -> str:
    """`text` (a markdown page) with the lines between its `begin` and `end` lines replaced by
    `table`; a page without the block is a one-line error naming it."""
    head, found_begin, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise UsageError(f"the page has no {begin} ... {end} block to put {what} in")
    return f"{head}{found_begin}{table}{found_end}{tail}"


def main(
    argv: Sequence[str], module: str, with_table: Callable[[str], str], markdown: Callable[[], str]
) -> int:
    """`python -m MODULE --markdown` prints the table; `--update PAGE` rewrites it in PAGE."""
    args = list(argv)
    if args == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if len(args) == 2 and args[0] == "--update":
        page = Path(args[1])
        page.write_text(with_table(page.read_text()))
        return 0
    print(f"usage: python -m {module} --markdown | --update PAGE", file=sys.stderr)
    return 2
