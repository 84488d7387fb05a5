"""`make bench-perf`: speed and size figures, each measured against a baseline in the same run.

Writes one flat JSON object (runs/bench-perf.json by default). Machines here are noisy, so
every target is a ratio to a baseline measured in the same process, never an absolute time.
Usage: python -m specctl.perf [--output FILE] [--only collect,...]
"""

from __future__ import annotations

import argparse
import contextlib
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


def _rss_mb(field: str) -> float:
    """VmRSS (current) or VmHWM (peak since the last reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak_memory(device: torch.device) -> float:
    """Start a peak-memory window; returns the baseline (MiB) that `_peak_memory_mb` subtracts."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
        Path("/proc/self/clear_refs").write_text("5")
    return _rss_mb("VmRSS")


def _peak_memory_mb(device: torch.device, baseline: float) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20 - baseline
    return _rss_mb("VmHWM") - baseline


def synthetic_batch(
    spec, batch_size: int, seq_len: int, generator: torch.Generator, prompt_fraction: float = 0.25
) -> dict[str, torch.Tensor]:
    """A drafter batch with random tokens and features, the first `prompt_fraction` not loss-masked.

    Speed and memory of a training step depend on shapes and mask density, not on content.
    """
    B, T, H, n_aux = batch_size, seq_len, spec.hidden_size, len(spec.aux_layer_ids)
    loss_mask = torch.ones(B, T, dtype=torch.bool)
    loss_mask[:, : int(T * prompt_fraction)] = False
    return {
        "input_ids": torch.randint(0, spec.vocab_size, (B, T), generator=generator),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
        "aux_hidden_states": torch.randn(B, T, n_aux, H, generator=generator),  # [B, T, n_aux, H]
        "last_hidden_state": torch.randn(B, T, H, generator=generator),  # [B, T, H]
    }


def measure_train_step(
    drafter: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    steps: int,
    device: torch.device,
    warmup: int = 1,
) -> dict[str, float]:
    """Forward + backward + AdamW step of `drafter` on one batch, repeated: throughput and peak memory.

    positions = draft predictions the loss counts (anchors x block for block drafters,
    sampled depths for P-EAGLE, TTT steps for EAGLE-3); tokens = sequence tokens consumed.
    Peak memory is above what was allocated before the first step (verifier weights excluded).
    """
    drafter = drafter.to(device).train()
    batch = {k: v.to(device) for k, v in batch.items()}
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    def step() -> float:
        with autocast:
            loss, metrics = drafter(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(metrics["count"].sum())

    baseline = _reset_peak_memory(device)
    for _ in range(warmup):
        step()
    positions, start = 0.0, time.perf_counter()
    for _ in range(steps):
        positions += step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    tokens = float(batch["attention_mask"].sum()) * steps
    return {
        "positions_per_s": positions / seconds,
        "tokens_per_s": tokens / seconds,
        "peak_mem_mb": _peak_memory_mb(device, baseline),
        "step_s": seconds / steps,
    }


def bench_train(workdir: Path, seq_len: int = 512, batch_size: int = 4, steps: int = 3) -> dict[str, float]:
    """Each quickstart-<algo> drafter (SmolLM2 verifier, CPU-sized config) on synthetic features.

    Baseline in the same run: the verifier's own forward over the same tokens
    (`train_ratio_vs_verifier_forward.<algo>` = drafter train tokens/s / verifier forward tokens/s).
    """
    from specctl.drafters import DRAFTERS
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.verifier import capture_hidden_states, load_verifier, recipe_verifier_spec, verifier_weights

    base = load_recipe(resolve_recipe_path("quickstart.yaml"))
    verifier = load_verifier(base.verifier)
    spec = recipe_verifier_spec(verifier, base)
    aux_ids = spec.aux_layer_ids
    weights = verifier_weights(verifier)
    batch = synthetic_batch(spec, batch_size, seq_len, torch.Generator().manual_seed(0))

    capture_hidden_states(verifier.model, batch["input_ids"][:1, :64], None, aux_ids)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        capture_hidden_states(verifier.model, batch["input_ids"], None, aux_ids)
    verifier_tps = batch_size * seq_len * steps / (time.perf_counter() - start)
    figures: dict[str, float] = {"train_verifier_forward_tokens_per_s": round(verifier_tps, 1)}
    for algo in DRAFTERS:
        recipe = load_recipe(resolve_recipe_path(f"quickstart-{algo}.yaml"))
        d2t = None
        if recipe.drafter.draft_vocab_size is not None:  # the most frequent ids of random data: any will do
            d2t = torch.zeros(recipe.drafter.draft_vocab_size, dtype=torch.long)
        torch.manual_seed(0)
        drafter = DRAFTERS[algo].build(getattr(recipe.drafter, algo), spec, weights, d2t, recipe.train.loss)
        m = measure_train_step(drafter, batch, steps, verifier.device)
        figures[f"train_positions_per_s.{algo}"] = round(m["positions_per_s"], 1)
        figures[f"train_tokens_per_s.{algo}"] = round(m["tokens_per_s"], 1)
        figures[f"train_peak_mem_mb.{algo}"] = round(m["peak_mem_mb"], 1)
        figures[f"train_ratio_vs_verifier_forward.{algo}"] = round(m["tokens_per_s"] / verifier_tps, 3)
        del drafter
    return figures


BENCHES: dict[str, Callable[[Path], dict[str, float]]] = {
    "collect": bench_collect,
    "train": bench_train,
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
