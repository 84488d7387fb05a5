"""The plan at world size: `specctl plan`'s train peak per rank against a real FSDP2 step traced as
rank 0 of `--world` ranks (specctl.train.fsdptrace), for each case: the table docs/performance.md carries.

Predicted: the plan's terms less its assumed CUDA overheads (fragmentation, context), i.e. the live
bytes it counts; traced: FSDPMemTracker's peak over two steps (pieces with gradient sync off, then
on). Both for 8 x 80 GiB GPUs. CPU only; about 20 s a case on one core. Exit 1 when a case is more
than --tolerance (15%) away.

Usage: python -m benchmarks.fsdp_plan [--world 8] [--output runs/fsdp_plan.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CASES = {  # name -> (recipe, overrides)
    "dflash-llama-70b (shipped)": ("recipes/dflash-llama-70b.yaml", []),
    "dflash-llama-70b, no checkpointing, 1 x 2048": (
        "recipes/dflash-llama-70b.yaml",
        ["train.activation_checkpointing=false", "train.micro_batch_tokens=2048"],
    ),
    "dflash-llama, fsdp": ("recipes/dflash-llama.yaml", ["train.parallelism=fsdp"]),
}
OVERHEADS = ("allocator fragmentation", "CUDA context, cuBLAS, NCCL")


def measure(path: str, overrides: list[str], world: int) -> dict:
    """One case: the plan's live bytes and total a rank, the traced FSDP2 peak and its parts."""
    from specctl import resources
    from specctl.recipe import load_recipe
    from specctl.train import fsdptrace

    recipe = load_recipe(path, overrides).for_training()
    cluster = resources.Cluster("cuda", world, 80 * resources.GIB)
    started = time.monotonic()
    plan = resources.plan_recipe(recipe, cluster, ("train",)).stages[0]
    x = resources.inputs(recipe, cluster)
    traced = fsdptrace.trace_fsdp_step(x.recipe, x.spec, resources.micro_tokens(x.recipe), world)
    live = sum(t.bytes for t in plan.terms if t.what not in OVERHEADS)
    return {
        "recipe": path,
        "overrides": overrides,
        "piece": f"{traced.sequences} x {traced.length}",
        "predicted_live_bytes": live,
        "predicted_peak_bytes": plan.peak,
        "traced_peak_bytes": traced.peak,
        "ratio": live / traced.peak,
        "traced_parts": traced.parts,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--output", type=Path, default=Path("runs/fsdp_plan.json"))
    args = parser.parse_args(argv)
    gib = 1 << 30
    rows = {name: measure(path, sets, args.world) for name, (path, sets) in CASES.items()}
    print("| case | piece | plan (live) GiB | traced GiB | plan / traced | plan with overheads GiB |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        live, traced = r["predicted_live_bytes"] / gib, r["traced_peak_bytes"] / gib
        print(
            f"| {name} | {r['piece']} | {live:.1f} | {traced:.1f} | {r['ratio']:.3f}"
            f" | {r['predicted_peak_bytes'] / gib:.1f} |"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"world": args.world, "cases": rows}, indent=2))
    return 0 if all(abs(r["ratio"] - 1) <= args.tolerance for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
