"""The shape DESIGN.md asks for, checked on the source: no import circle inside specctl/, no
function over 100 lines, shared code that names no algorithm but the baseline (it asks the
drafter's spec instead), and vLLM imported only inside specctl/vllm/."""

from __future__ import annotations

import ast
from pathlib import Path

from specctl.drafters import DRAFTERS

ROOT = Path(__file__).resolve().parents[1] / "specctl"
BASELINE = "eagle3"  # the one algorithm shared code may name: the reference a user can override
MAX_LINES = 100


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The specctl modules a file imports, wherever the import sits (top level or in a function).
    `from package import submodule` depends on the submodule, not on the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            out |= subs or {node.module}
            if len(subs) < len(node.names):  # names that are not submodules come from the package
                out.add(node.module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_inside_specctl():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []
    # the cycle finder itself finds one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_over_100_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                where = f"{path.relative_to(ROOT.parent)}:{node.name}"
                if node.end_lineno - node.lineno + 1 > MAX_LINES:
                    long.append(f"{where} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_shared_code_names_no_algorithm_but_the_baseline():
    """Outside specctl/drafters/, no string constant is an algorithm's name (or its
    speculators_model_type) except the baseline's: shared code asks the spec."""
    names = {n for s in DRAFTERS.values() for n in (s.name, s.speculators_model_type)} - {BASELINE}
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if "drafters" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}")
    assert found == []


IMPORTERS = {"find_spec", "import_module", "__import__"}  # calls that import (or look up) by name


def _is_vllm(name: str | None) -> bool:
    return name is not None and (name == "vllm" or name.startswith("vllm."))


def vllm_imports(source: str) -> list[str]:
    """Each place a module's source imports vLLM or asks whether it is there: `import vllm[.x]`,
    `from vllm[.x] import ...`, and find_spec / import_module / __import__ of "vllm[.x]", at top
    level or in a function (a lazy import still ties the module to vLLM's API)."""
    found: list[tuple[int, int, str]] = []  # (line, column, what): in source order
    for node in ast.walk(ast.parse(source)):
        where = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
        if isinstance(node, ast.Import):
            found += [(*where, f"import {a.name}") for a in node.names if _is_vllm(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_vllm(node.module):
            found.append((*where, f"from {node.module} import"))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func, name = node.func, node.args[0].value
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in IMPORTERS and isinstance(name, str) and _is_vllm(name):
                found.append((*where, f"{called}({name!r})"))
    return [f"{line}: {what}" for line, _, what in sorted(found)]


def test_nothing_outside_specctl_vllm_imports_vllm():
    """One package knows vLLM (specctl/vllm/): a vLLM change is found there, and nowhere else asks
    for it, not even `find_spec("vllm")` (that is `specctl.vllm.available()`)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] == "vllm":
            continue
        found += [f"{path.relative_to(ROOT.parent)}:{hit}" for hit in vllm_imports(path.read_text())]
    assert found == []
    # the check itself finds every form, and leaves specctl's own vllm package alone
    synthetic = (
        "import os, vllm\n"
        "import vllm.config as c\n"
        "from vllm import LLM\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "def f():\n"
        "    import importlib.util\n"
        "    return importlib.util.find_spec('vllm') or find_spec('vllm.platforms')\n"
        "importlib.import_module('vllm')\n"
        "from specctl.vllm import available\n"
        "from specctl import vllm\n"
        "import specctl.vllm.args\n"
        "from .vllm import VllmSetup\n"
        "find_spec('vllmx'); find_spec('torch')\n"
    )
    assert vllm_imports(synthetic) == [
        "1: import vllm",
        "2: import vllm.config",
        "3: from vllm import",
        "4: from vllm.engine.arg_utils import",
        "7: find_spec('vllm')",
        "7: find_spec('vllm.platforms')",
        "8: import_module('vllm')",
    ]
