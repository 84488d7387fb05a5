"""`make demo-trees`: draft trees on the demo's own drafters, chosen on dev, reported on test.

    python -m benchmarks.demo_trees [RECIPE] [--tree 4,8,16]

After `make demo`. Two benches of the demo's DFlash and EAGLE-3 at their exported K, in the
embedded engine (the one that verifies trees): on the built-in bench's dev prompts each drafter's
chain and a tree of each node count, one round, where each drafter's fastest tree is chosen; then
on its test prompts the chain and the chosen tree, TEST_REPEATS rounds with every method taking its
turn in each, so the tree-over-chain ratio the report prints (paired, with its 95% interval) is
measured on prompts nothing was chosen on. It is not a part of `make demo`: a tree beside each K of
the demo's K sweep would add about 2 of its 20 minutes, for a figure this target measures apart.
The stages are `benchmarks.results`' (each command, commit and wall time in the run's
`demo-trees-stages.json`; a rerun reuses a bench whose command is unchanged and whose report is
newer than the exports).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from benchmarks.results import DEV, TEST, TEST_REPEATS, Stage, bench_is_current, run_stages, tree_choices
from specctl.recipe import load_recipe, resolve_recipe_path

DEFAULT_RECIPE = "demo.yaml"
DRAFTERS = ("dflash", "eagle3")  # what `make demo` trains; EAGLE-3 the baseline, with its own trees
# Node counts dev chooses among. On the demo's drafters (K 3, exact verify, 2026-12-05) dev put the
# fastest tree at 4 nodes; 16 ran below its chain, and 31 (1.86 decode steps a verify) further
# below (docs/benchmarking.md#draft-trees---tree).
TREE_NODES = "4,8,16"


def tree_stages(recipe_arg: str, run: Path, nodes: str) -> list[Stage]:
    """The dev bench that chooses each drafter's tree and the test bench that reports it beside
    the chain (its `--tree` read from the dev report when its turn comes)."""
    exports = [run / "drafters" / algo / "export" for algo in DRAFTERS]
    missing = [str(e) for e in exports if not (e / "config.json").is_file()]
    if missing:
        raise SystemExit(f"demo-trees: no exported drafter at {', '.join(missing)}; run `make demo` first")
    drafters = [f"--drafter={e}" for e in exports]
    dev_out, test_out = run / "bench-trees-dev", run / "bench-trees"

    def chosen() -> list[str]:
        counts = sorted(set(tree_choices(dev_out / "report.json").values()))
        if not counts:
            raise SystemExit(f"demo-trees: {dev_out}/report.json chose no tree; rerun the dev bench")
        return [f"--tree={','.join(map(str, counts))}"]

    dev = ["--dataset-split", DEV, "--repeats", "1", "--tree", nodes]
    test = ["--dataset-split", TEST, "--repeats", str(TEST_REPEATS)]
    return [
        Stage(
            name,
            ["bench", recipe_arg, *args, *drafters, "--output", str(out)],
            partial(bench_is_current, out, exports),
            late=late,
        )
        for name, args, out, late in (
            ("trees dev", dev, dev_out, list),
            ("trees test", test, test_out, chosen),
        )
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.demo_trees", description=__doc__.splitlines()[0]
    )
    parser.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE)
    parser.add_argument(
        "--tree", default=TREE_NODES, help="node counts dev chooses among (default %(default)s)"
    )
    args = parser.parse_args(argv)
    recipe = load_recipe(resolve_recipe_path(args.recipe))
    run_stages(tree_stages(args.recipe, recipe.run_dir, args.tree), recipe.run_dir / "demo-trees-stages.json")
    print(f"trees against the chain, on test: {recipe.run_dir / 'bench-trees' / 'report.md'}")


if __name__ == "__main__":
    main()
