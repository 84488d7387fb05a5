"""`make bench-perf`: speed and size figures, each measured against a baseline in the same run.

Writes one flat JSON object (runs/bench-perf.json by default). Machines here are noisy, so
every target is a ratio to a baseline measured in the same process, never an absolute time.
Usage: python -m specctl.perf [--output FILE] [--only collect,...]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

PERF_WORDS = [
    "model",
    "data",
    "token",
    "layer",
    "speculative",
    "decoding",
    "draft",
    "verify",
    "accept",
    "block",
    "anchor",
    "train",
    "loss",
    "feature",
    "hidden",
    "state",
    "cache",
    "memory",
    "throughput",
    "latency",
    "batch",
    "sequence",
    "attention",
    "python",
    "code",
    "function",
    "return",
    "value",
    "list",
    "dictionary",
    "explain",
    "why",
    "how",
    "what",
    "when",
    "example",
    "step",
    "answer",
    "question",
]


def _conversations(path: Path, n: int, seed: int = 0) -> Path:
    """Synthetic chats with realistic lengths (a few hundred tokens); content does not matter for speed."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            q = " ".join(rng.choices(PERF_WORDS, k=rng.randint(10, 40))) + "?"
            a = " ".join(rng.choices(PERF_WORDS, k=rng.randint(120, 360))) + "."
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def bench_collect(workdir: Path, num_samples: int = 24) -> dict[str, float]:
    """collect-hidden-states vs a plain HF forward (output_hidden_states=True) on the same samples."""
    from specctl.collect import collect
    from specctl.data import load_samples
    from specctl.recipe import recipe_from_dict
    from specctl.verifier import load_verifier

    recipe = recipe_from_dict(
        {
            "name": "perf-collect",
            "output_dir": str(workdir),
            "data": {"source": str(_conversations(workdir / "chats.jsonl", num_samples)), "max_length": 1024},
            "features": {"batch_tokens": 4096},
        }
    )
    verifier = load_verifier(recipe.verifier)
    model = verifier.model
    # warm-up (allocator, kernels) on a short input, then the two measured passes
    with torch.inference_mode():
        model(torch.arange(64)[None].to(verifier.device), output_hidden_states=True)
    summary = collect(recipe, verifier=verifier, progress=False)  # includes data prep + shard writes
    samples = load_samples(recipe.run_dir / "data")
    tokens = sum(s["input_ids"].numel() for s in samples)
    start = time.perf_counter()
    with torch.inference_mode():
        for s in samples:
            model(s["input_ids"][None].to(verifier.device), output_hidden_states=True)
    hf_seconds = time.perf_counter() - start
    collect_tps = summary.tokens_per_s  # verifier forward + shard writes, data prep excluded
    hf_tps = tokens / hf_seconds
    return {
        "collect_tokens_per_s": round(collect_tps, 1),
        "hf_forward_tokens_per_s": round(hf_tps, 1),
        "collect_ratio_vs_hf_forward": round(collect_tps / hf_tps, 3),
        "feature_bytes_per_token": round(summary.bytes_per_token or 0.0, 1),
    }


BENCHES: dict[str, Callable[[Path], dict[str, float]]] = {
    "collect": bench_collect,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/bench-perf.json")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated: " + ",".join(BENCHES))
    args = parser.parse_args(argv)
    out = Path(args.output)
    figures: dict[str, float] = json.loads(out.read_text()) if out.is_file() else {}
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory(prefix=f"specctl-perf-{name}-") as tmp:
            start = time.perf_counter()
            figures.update(BENCHES[name](Path(tmp)))
            print(f"{name}: done in {time.perf_counter() - start:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(json.dumps(figures, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
