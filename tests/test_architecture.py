"""The layering docs/architecture.md states, checked on the source: no import circle inside
specctl/, no stage (collect, train, export, bench) reaching another and no shared bottom module
reaching a stage (cli alone, on top, imports stages), no function over 80 lines, shared code that
names no algorithm but the baseline (it asks the drafter's spec instead), vLLM imported only inside
specctl/vllm/, the drafter typed where the engine, train and bench take it, drafter registration
that runs one way (the package collects each module's SPEC; no module imports it back), and the
map itself: every package and root module on it, every code path and doc page it cites there."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from specctl.drafters import DRAFTERS

ROOT = Path(__file__).resolve().parents[1] / "specctl"
BASELINE = "eagle3"  # the one algorithm shared code may name: the reference a user can override
MAX_LINES = 80  # a function reads in one sitting; no exemptions


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


def test_no_function_over_80_lines():
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


# The pipeline's stages, each its own package. collect's vLLM half (the KV-connector capture) sits
# with the rest of the vLLM code in specctl/vllm/ and still counts as collect. cli (with its option
# schema and `python -m specctl`) is the top: the one place that may import every stage. Every other
# module is the shared bottom: any stage may use it, it uses no stage, and what two stages share
# moves down into it (the speculators format, the checkpoint, the resource plan are the cases).
STAGES = {
    "collect": ("specctl.collect", "specctl.vllm.collect"),
    "train": ("specctl.train",),
    "export": ("specctl.export",),
    "bench": ("specctl.bench",),
    "cli": ("specctl.cli", "specctl.cli_schema", "specctl.__main__"),
}
TOP = "cli"


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def reaches(graph: dict[str, set[str]], sources: list[str], banned: tuple[str, ...]) -> list[str]:
    """For each source that imports a banned module, directly or through others, one import chain
    ("a -> b -> c") that shows it; [] when none does. Breadth-first, so each chain is a shortest."""
    found = []
    for source in sources:
        parent: dict[str, str | None] = {source: None}
        queue = [source]
        while queue:
            module = queue.pop(0)
            if module != source and within(module, banned):
                chain = [module]
                while parent[chain[-1]] is not None:
                    chain.append(parent[chain[-1]])
                found.append(" -> ".join(reversed(chain)))
                break
            for imported in sorted(graph.get(module, ())):
                if imported not in parent:
                    parent[imported] = module
                    queue.append(imported)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_the_reach_check_finds_direct_and_indirect_imports():
    graph = {
        "specctl.bench.run": {"specctl.bench.embedded"},
        "specctl.bench.embedded": {"specctl.engine", "specctl.export"},
        "specctl.engine": set(),
        "specctl.export": {"specctl.speculators.io"},
        "specctl.speculators.io": {"specctl.verifier"},
        "specctl.verifier": {"specctl.train"},
        "specctl.train": set(),
        "specctl.trainer_notes": set(),  # a prefix of a stage's name is not that stage
    }
    bench = ["specctl.bench.run", "specctl.bench.embedded"]
    assert reaches(graph, bench, STAGES["export"]) == [
        "specctl.bench.run -> specctl.bench.embedded -> specctl.export",
        "specctl.bench.embedded -> specctl.export",
    ]
    assert reaches(graph, ["specctl.speculators.io"], STAGES["train"]) == [
        "specctl.speculators.io -> specctl.verifier -> specctl.train"
    ]
    graph["specctl.verifier"] = {"specctl.trainer_notes"}
    assert reaches(graph, ["specctl.speculators.io"], STAGES["train"]) == []
    graph["specctl.bench.embedded"] = {"specctl.engine", "specctl.speculators.io"}
    assert reaches(graph, bench, STAGES["export"]) == []


def test_bench_reaches_no_other_stage():
    """bench loads exports through specctl.speculators, not through the export stage, and reads
    nothing of collect or train: a bench runs on a directory, not on a training run's internals."""
    graph = import_graph()
    bench = [m for m in graph if within(m, STAGES["bench"])]
    assert bench and all(any(within(m, p) for m in graph) for p in STAGES.values())
    banned = STAGES["export"] + STAGES["collect"] + STAGES["train"] + STAGES["cli"]
    assert reaches(graph, bench, banned) == []


def stage_breaches(
    graph: dict[str, set[str]], stages: dict[str, tuple[str, ...]] = STAGES, top: str = TOP
) -> list[str]:
    """One shortest import chain for each module that breaks the layering: a module of a stage
    other than the top that reaches another stage, or a bottom module (in no stage) that reaches
    any stage. Stages in their order, then the bottom in name order; [] when the layering holds."""
    every = tuple(p for prefixes in stages.values() for p in prefixes)
    found = []
    for name, prefixes in stages.items():
        if name != top:
            others = tuple(p for other, ps in stages.items() if other != name for p in ps)
            found += reaches(graph, sorted(m for m in graph if within(m, prefixes)), others)
    return found + reaches(graph, sorted(m for m in graph if not within(m, every)), every)


def test_the_stage_rule_finds_a_stage_reaching_another_and_the_bottom_reaching_a_stage():
    graph = {
        "specctl.cli": {"specctl.train", "specctl.export.directory", "specctl.bench.run"},
        "specctl.train": {"specctl.train.loop"},
        "specctl.train.loop": {"specctl.checkpoint", "specctl.recipe"},
        "specctl.export.directory": {"specctl.checkpoint"},
        "specctl.bench.run": {"specctl.recipe"},
        "specctl.checkpoint": {"specctl.recipe"},
        "specctl.recipe": set(),
    }
    assert stage_breaches(graph) == []  # the top imports every stage; stages share the bottom
    graph["specctl.bench.run"] = {"specctl.recipe", "specctl.export.directory"}
    assert stage_breaches(graph) == ["specctl.bench.run -> specctl.export.directory"]
    graph["specctl.bench.run"] = {"specctl.recipe"}
    graph["specctl.checkpoint"] = {"specctl.train.loop"}  # the bottom reaching up into a stage
    assert stage_breaches(graph) == [
        "specctl.export.directory -> specctl.checkpoint -> specctl.train.loop",
        "specctl.checkpoint -> specctl.train.loop",
    ]
    graph["specctl.checkpoint"] = {"specctl.recipe"}
    graph["specctl.recipe"] = {"specctl.cli"}  # nothing below the top imports it
    assert stage_breaches(graph) == [
        "specctl.train -> specctl.train.loop -> specctl.recipe -> specctl.cli",
        "specctl.train.loop -> specctl.recipe -> specctl.cli",
        "specctl.export.directory -> specctl.checkpoint -> specctl.recipe -> specctl.cli",
        "specctl.bench.run -> specctl.recipe -> specctl.cli",
        "specctl.checkpoint -> specctl.recipe -> specctl.cli",
        "specctl.recipe -> specctl.cli",
    ]


def test_no_stage_reaches_another_and_the_bottom_reaches_none():
    """collect, train, export and bench each import only their own package and the shared bottom;
    the bottom imports no stage; only cli, on top, imports stages. A helper two stages need moves
    down (as specctl.checkpoint, read by train and export) rather than one stage importing another."""
    graph = import_graph()
    empty = [p for prefixes in STAGES.values() for p in prefixes if not any(within(m, (p,)) for m in graph)]
    assert empty == []  # every prefix names modules that exist: a rename cannot empty a stage
    packages = [name for name in STAGES if name != TOP and not (ROOT / name / "__init__.py").is_file()]
    assert packages == []  # each stage below the top is a package of its own
    assert stage_breaches(graph) == []


def test_the_speculators_format_reaches_no_stage():
    """specctl.speculators is the bottom every stage reads the format through: it imports none."""
    graph = import_graph()
    package = [m for m in graph if within(m, ("specctl.speculators",))]
    assert {"specctl.speculators.config", "specctl.speculators.validate", "specctl.speculators.io"} <= set(
        package
    )
    assert reaches(graph, package, tuple(p for prefixes in STAGES.values() for p in prefixes)) == []


# where a drafter object is handed around: the engine, the training stage, the bench backends
TYPED_SCOPES = ("engine.py", "train", "bench")
DRAFTER_PARAMS = {"drafter", "drafters"}
UNTYPED = {"Any", "object"}


def untyped_drafter_params(source: str, where: str) -> list[str]:
    """Parameters named drafter/drafters with no annotation, or one that is (or unions in) Any or
    object: such a signature accepts anything, so the contract says nothing there."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is None or arg.arg not in DRAFTER_PARAMS:
                continue
            names = (
                set()
                if arg.annotation is None
                else {
                    n.id if isinstance(n, ast.Name) else n.attr
                    for n in ast.walk(arg.annotation)
                    if isinstance(n, ast.Name | ast.Attribute)
                }
            )
            if arg.annotation is None or names & UNTYPED:
                found.append(f"{where}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_engine_train_and_bench_take_a_typed_drafter():
    files = [
        path
        for name in TYPED_SCOPES
        for path in ([ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py")))
        if path.is_file()
    ]
    assert ROOT / "engine.py" in files and ROOT / "train" / "loop.py" in files
    assert any("bench" in p.parts for p in files)
    found = []
    for path in files:
        found += untyped_drafter_params(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []
    # the check itself finds each way of leaving the drafter untyped, and passes the typed ones
    bad = (
        "def a(drafter): ...\n"
        "def b(x, drafter: Any | None): ...\n"
        "def c(*, drafters: list[typing.Any]): ...\n"
        "def d(drafter: object): ...\n"
        "def e(drafter: Drafter | None, drafters: Sequence[Path]): ...\n"
    )
    assert [f.split()[1] for f in untyped_drafter_params(bad, "x")] == [
        "a(drafter)",
        "b(drafter)",
        "c(drafters)",
        "d(drafter)",
    ]


def test_algorithm_modules_do_not_import_the_drafters_package():
    """Registration runs one way: specctl.drafters imports each algorithm module and collects its
    `SPEC`; a module importing the package back (to call a register function) would be a loop that
    works only while the package defines what it needs above its discovery call."""
    known = modules()
    algorithms = [p for p in sorted((ROOT / "drafters").glob("*.py")) if p.name != "__init__.py"]
    variant = ROOT.parent / "tests" / "drafter_variant.py"  # the documented fifth algorithm
    back = [
        str(p.relative_to(ROOT.parent))
        for p in [*algorithms, variant]
        if "specctl.drafters" in imports(p, known)
    ]
    assert back == []
    for spec in DRAFTERS.values():  # each registered spec is the SPEC its own module exports
        assert sys.modules[spec.build.__module__].SPEC is spec, spec.name


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


# The map: docs/architecture.md draws the packages and root modules above, and the pages cite code
# by path or dotted name. Both go stale silently when a module moves, so both are checked here.
REPO = ROOT.parent
MAP = REPO / "docs" / "architecture.md"
# specctl/bench/run.py, specctl/train/, specctl.speculators.io.load_drafter; not the cache path
# ~/.cache/specctl/models/... (the look-behind)
CITED_CODE = re.compile(r"(?<![\w/.~-])specctl(?:[./][A-Za-z_]\w*)+/?")
CITED_PAGE = re.compile(r"(?<![\w/.-])docs/[\w/-]+\.md")
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)")


def defined(path: Path) -> set[str]:
    """The names a module defines or imports at top level: what `module.name` can reach."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved_code(text: str, known: dict[str, Path]) -> list[str]:
    """The code a page cites that is not there: a path (specctl/x.py, specctl/x/, or specctl/x
    for x.py) naming no file or folder, or a dotted name whose longest module prefix does not
    define the next part (`specctl.export.load_drafter` resolves; `specctl.export.nope` does not)."""
    missing = []
    for ref in dict.fromkeys(m.group(0) for m in CITED_CODE.finditer(text)):
        if "/" in ref:
            path = REPO / ref.rstrip("/")
            ok = path.exists() or path.with_name(path.name + ".py").exists()
        else:
            parts = ref.split(".")
            depth = next(i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known)
            rest = parts[depth:]
            ok = not rest or rest[0] in defined(known[".".join(parts[:depth])])
        if not ok:
            missing.append(ref)
    return missing


def test_the_check_of_cited_code_finds_what_is_gone():
    known = modules()
    text = (
        "`specctl/train.py` (the loop), `specctl/train/loop.py`, `specctl/train/`, specctl/bench/run,\n"
        "`specctl.export.load_drafter`, `specctl.export.nope`, `specctl.curves`, specctl.engine.generate.\n"
        "Weights go to ~/.cache/specctl/models/smollm2 and /root/.cache/specctl/x.\n"
    )
    assert unresolved_code(text, known) == ["specctl/train.py", "specctl.export.nope", "specctl.curves"]


def test_the_pages_cite_only_code_that_exists():
    """Every page but the changelog, whose job is to name the paths that are gone."""
    known = modules()
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if page.name == "changelog.md":
            continue
        found += [f"{page.relative_to(REPO)}: {ref}" for ref in unresolved_code(page.read_text(), known)]
    assert found == []


def test_cited_pages_and_links_exist():
    """Every docs/<page>.md the code, tests, tooling or docs cite, and every relative link of a
    page, names a file that is there (the code once cited design notes the repository never had)."""
    folders = ("specctl", "tests", "benchmarks")
    sources = [*(p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))), REPO / "Makefile"]
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [
        f"{path.relative_to(REPO)}: {ref}"
        for path in [*sources, *pages]
        for ref in sorted(set(CITED_PAGE.findall(path.read_text())))
        if not (REPO / ref).is_file()
    ]
    missing += [
        f"{page.relative_to(REPO)}: ({target})"
        for page in pages
        for target in sorted(set(LINK.findall(page.read_text())))
        if not (page.parent / target).exists()
    ]
    assert missing == []
    assert LINK.findall("[a](training.md#the-loop) [b](https://x.org/a.md) [c](#top) [d](results/run)") == [
        "training.md",
        "results/run",
    ]


def test_the_map_shows_every_package_and_root_module():
    """docs/architecture.md names each package (`specctl/<name>/`) and each root module
    (`<name>`, `<name>.py` or `specctl/<name>.py`), so a new one cannot be left off the map."""
    text = MAP.read_text()
    names = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    names += [p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"]
    assert "train" in names and "units" not in names
    unmapped = [n for n in sorted(names) if not re.search(rf"`(specctl/)?{re.escape(n)}(\.py|/)?`", text)]
    assert unmapped == []
