"""The reliability matrix: the faults and bad inputs specctl is tested against, and what happens.

A test that tries a fault says so in one decorator line:

    @fault(stage="train", fault="a flipped byte in a checkpoint", result="resume names the file")

`docs/reliability.md` is rendered from those lines, read from the test sources (nothing is
imported or run), so the page lists exactly what the tests try:

    python tests/reliability_matrix.py > docs/reliability.md

`tests/test_reliability.py` fails when the page and the tests disagree.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "reliability.md"

# stage -> section title, in pipeline order
STAGES = {
    "recipe": "Recipe and command line",
    "data": "Conversation data",
    "collect": "collect-hidden-states and the feature store",
    "train": "train and its checkpoints",
    "export": "export",
    "bench": "bench and the vLLM server",
    "hygiene": "Secrets and unsafe calls",
}

Test = TypeVar("Test", bound=Callable)


def fault(*, stage: str, fault: str, result: str) -> Callable[[Test], Test]:
    """Declare the fault a test injects and the result it asserts (one row of the matrix).

    Checked when the test module is imported, so a typo in `stage` fails collection instead of
    silently dropping the row.
    """
    if stage not in STAGES:
        raise ValueError(f"@fault stage {stage!r}: use one of {', '.join(STAGES)}")
    for name, text in (("fault", fault), ("result", result)):
        if not text.strip() or "\n" in text:
            raise ValueError(f"@fault {name} must be one non-empty line")

    def mark(test: Test) -> Test:
        test.reliability = (stage, fault, result)  # type: ignore[attr-defined]
        return test

    return mark


@dataclass(frozen=True)
class Row:
    stage: str
    fault: str
    result: str
    test: str  # tests/test_x.py::test_name


def _decorator_row(decorator: ast.expr, where: str) -> tuple[str, str, str] | None:
    if not (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "fault"):
        return None
    values = {}
    for kw in decorator.keywords:
        if not (isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str)):
            raise ValueError(f"{where}: @fault({kw.arg}=...) must be a string literal")
        values[kw.arg] = kw.value.value
    if decorator.args or set(values) != {"stage", "fault", "result"}:
        raise ValueError(f"{where}: write @fault(stage=..., fault=..., result=...)")
    return values["stage"], values["fault"], values["result"]


def collect_rows(tests_dir: Path = TESTS) -> list[Row]:
    """Every @fault line of tests/test_*.py, in stage order, then file, then source order."""
    rows = []
    for path in sorted(tests_dir.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            name = f"tests/{path.name}::{node.name}"
            for decorator in node.decorator_list:
                row = _decorator_row(decorator, name)
                if row is not None:
                    rows.append(Row(*row, test=name))
    order = list(STAGES)
    return sorted(rows, key=lambda r: order.index(r.stage))  # stable: file and source order stay


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(rows: list[Row]) -> str:
    """docs/reliability.md: one table per stage."""
    lines = [
        "# Reliability matrix",
        "",
        "The faults and bad inputs specctl is tested against, and the result each test asserts.",
        "Generated from the `@fault(stage=..., fault=..., result=...)` lines of the tests by",
        "`python tests/reliability_matrix.py > docs/reliability.md`; `tests/test_reliability.py`",
        "fails when this page and the tests disagree. Every row runs in `make test` on CPU, with",
        "no network: a row is a fact as long as CI is green.",
        "",
        "Common to all rows: a known failure ends the command with a non-zero exit code and one",
        "line on stderr that names the file, line or recipe field at fault (`SPECCTL_DEBUG=1`",
        "shows the traceback).",
    ]
    for stage, title in STAGES.items():
        mine = [r for r in rows if r.stage == stage]
        if not mine:
            continue
        lines += ["", f"## {title}", "", "| fault or bad input | result | test |", "|---|---|---|"]
        lines += [f"| {_cell(r.fault)} | {_cell(r.result)} | `{r.test}` |" for r in mine]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(collect_rows()))
