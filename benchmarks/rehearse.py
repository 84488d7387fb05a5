"""`make rehearse`: the 8B recipes' pipeline at real width on this CPU, each stage's measured peak
memory against `specctl plan`'s prediction for exactly those settings.

For each model (random weights from the published config: Llama-3.1-8B-Instruct, Qwen3-8B; hidden
4096, their vocabularies and head counts, the decoder cut to `--layers` layers with the aux layer ids
mapped into them) it runs collect -> train (each algorithm, a few steps of one sequence per rank at
the shipped block / vocabulary / feature layout) -> export -> export --check, every stage in a
process of its own, and measures the stage's peak resident memory above the process's resident
memory once its imports are done (VmHWM after resetting it through /proc/self/clear_refs, glibc told
to return every large block at once: MALLOC_MMAP_THRESHOLD_). The plan is computed for a CPU
"cluster" of one device with this host's memory, from the same recipe file.

Writes runs/rehearse.json (per model, algorithm and stage: predicted_peak_bytes,
measured_peak_bytes, their ratio, seconds) and prints the table docs/performance.md carries. Exit 1
when a stage's measurement is more than --tolerance (25%) away from the prediction.

Usage: python -m benchmarks.rehearse [--models llama,qwen3] [--algos dflash,dspark,peagle,eagle3]
           [--layers 4] [--max-length 512] [--output runs/rehearse.json]
       python -m benchmarks.rehearse --smoke  (`make test`: the same stages at hidden 64, seconds; the
           ratios mean nothing there and decide nothing)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

MODELS = {"llama": "meta-llama/Llama-3.1-8B-Instruct", "qwen3": "Qwen/Qwen3-8B"}
MASK_TOKENS = {"llama": 128002, "qwen3": 151662}  # a reserved / unused special token of each vocabulary
# --smoke: the published configs shrunk to this (the byte tokenizer's 259 ids fit the vocabulary)
SMOKE_WIDTH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 320,
    "bos_token_id": 1,  # the byte tokenizer's <|im_start|> and <|im_end|>
    "eos_token_id": 2,
}
SMOKE_MASK_TOKEN = 300
ALGOS = ("dflash", "dspark", "peagle", "eagle3")
ROOT = Path("runs/rehearse")


# ---------------------------------------------------------------- inputs built in code


def build_verifier(model: str, layers: int, out: Path, smoke: bool = False) -> Path:
    """A random-weight verifier of `model`'s published width (`smoke`: SMOKE_WIDTH) with `layers`
    decoder layers, bf16 safetensors, and a byte-level chat tokenizer (no downloads)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specctl.model_configs import published_config

    if (out / "config.json").is_file():
        return out
    config = published_config(MODELS[model], num_hidden_layers=layers, **(SMOKE_WIDTH if smoke else {}))
    torch.manual_seed(0)
    verifier = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    verifier.save_pretrained(tmp, safe_serialization=True)
    byte_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges and a ChatML template: 259 ids, enough to make
    sequences of any length from text (the verifier's own tokenizer would need a download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
        "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    )
    return fast


def write_conversations(path: Path, count: int, max_length: int) -> Path:
    """`count` conversations whose assistant turn alone runs past `max_length` byte tokens: every
    sample is cropped to max_length, so each batch is the plan's worst case (full length, loss
    tokens throughout the answer)."""
    words = ["the", "drafter", "reads", "the", "verifier's", "hidden", "states", "and", "proposes"]
    with path.open("w") as f:
        for i in range(count):
            answer = " ".join(words[(i + j) % len(words)] for j in range(max_length))
            messages = [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_recipe(model: str, verifier: Path, data: Path, args: argparse.Namespace) -> Path:
    """The shipped 8B recipe's layout (fp8 aux, top-16 targets, bf16 verifier, block 16, full
    vocabulary) at a per-rank budget this machine holds: one sequence per step, drafters of one layer."""
    L = args.layers
    recipe = {
        "name": f"rehearse-{model}",
        "output_dir": str(ROOT),
        "verifier": {"name_or_path": str(verifier.resolve()), "dtype": "bfloat16", "device": "cpu"},
        "data": {"source": str(data.resolve()), "max_length": args.max_length, "shuffle": False},
        "features": {
            "aux_layer_ids": [1, L // 2, L - 1],
            "aux_dtype": "fp8",
            "target": "topk",
            "batch_tokens": 2 * args.max_length,
            "shard_tokens": 4 * args.max_length,
        },
        "drafter": {
            "mask_token_id": SMOKE_MASK_TOKEN if args.smoke else MASK_TOKENS[model],
            "dflash": {"num_layers": 1, "block_size": 16, "max_anchors": args.anchors},
            "dspark": {"num_layers": 1, "block_size": 16, "max_anchors": args.anchors},
            "peagle": {"num_layers": 1, "max_anchors": args.anchors},
            "eagle3": {"ttt_steps": 3},
        },
        "train": {
            "max_steps": 2,
            "batch_tokens": args.max_length,
            "eval_every": 100,
            "save_every": 100,
            "log_every": 1,
            "val_fraction": 0.25,
            "warmup_steps": 1,
        },
    }
    path = ROOT / model / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# ---------------------------------------------------------------- one stage, measured in its own process


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure_stage(stage: str, recipe_path: str, algo: str | None) -> dict[str, Any]:
    """Run one stage in this process; its peak RSS above the RSS once everything is imported."""
    import specctl.collect
    import specctl.export
    import specctl.train
    import specctl.vllm.check  # noqa: F401  (imported before the baseline, like the others)

    with contextlib.suppress(ImportError):  # export --check parses the config with vLLM's code
        import vllm.config  # noqa: F401
    from specctl.recipe import load_recipe

    recipe = load_recipe(recipe_path, [f"drafter.algo={algo}"] if algo else [])
    gc.collect()
    baseline = _status("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    began = time.perf_counter()
    if stage == "collect":
        specctl.collect.collect(recipe, progress=False, force=True)
    elif stage == "train":
        specctl.train.run_training(recipe, progress=False)
    elif stage == "export":
        from specctl.vllm.check import check_export

        results = specctl.export.export_drafters(recipe.run_dir / "drafters" / algo)
        check_export(results[0].output)
    else:
        raise ValueError(stage)
    return {
        "measured_peak_bytes": _status("VmHWM:") - baseline,
        "baseline_bytes": baseline,
        "seconds": time.perf_counter() - began,
    }


def run_stage(stage: str, recipe: Path, algo: str | None, smoke: bool = False) -> dict[str, Any]:
    """The stage measured in a process of its own (`smoke`: in this one: each process's imports --
    torch, transformers, vLLM's config parser -- cost more than the tiny stage itself)."""
    if smoke:
        return measure_stage(stage, str(recipe), algo)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    cmd = [sys.executable, "-m", "benchmarks.rehearse", "--measure", stage, "--recipe", str(recipe)]
    if algo:
        cmd += ["--algo", algo]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{stage} {algo or ''} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the rehearsal


def predicted(recipe: Path, algo: str | None, stage: str) -> dict[str, Any]:
    from specctl.recipe import load_recipe
    from specctl.resources import Cluster, host_memory, plan_recipe

    r = load_recipe(str(recipe), [f"drafter.algo={algo}"] if algo else [])
    plan = plan_recipe(r, Cluster("cpu", 1, host_memory()), (stage,))
    s = plan.stages[0]
    return {"predicted_peak_bytes": s.peak, "terms": {t.what: t.bytes for t in s.terms}}


def rehearse_model(model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = ROOT / model
    folder.mkdir(parents=True, exist_ok=True)
    verifier = build_verifier(model, args.layers, folder / "verifier", args.smoke)
    data = write_conversations(folder / "conversations.jsonl", args.samples, args.max_length)
    recipe = write_recipe(model, verifier, data, args)
    shutil.rmtree(ROOT / f"rehearse-{model}", ignore_errors=True)  # every stage measured from scratch
    rows = []
    stages = [("collect", None)] + [(s, a) for a in args.algos for s in ("train", "export")]
    for stage, algo in stages:
        row = {"model": MODELS[model], "algo": algo, "stage": stage, **predicted(recipe, algo, stage)}
        row.update(run_stage(stage, recipe, algo, args.smoke))
        row["ratio"] = row["measured_peak_bytes"] / row["predicted_peak_bytes"]
        print(_line(row), flush=True)
        rows.append(row)
        if stage == "export":  # its checkpoints and export: up to 11 GB an algorithm, measured now
            shutil.rmtree(ROOT / f"rehearse-{model}" / "drafters" / algo, ignore_errors=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    gib = lambda n: f"{n / (1 << 30):.2f}"  # noqa: E731
    return (
        f"| {row['model']} | {row['algo'] or '-'} | {row['stage']} | {gib(row['predicted_peak_bytes'])} | "
        f"{gib(row['measured_peak_bytes'])} | {row['ratio']:.2f} | {row['seconds']:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,qwen3")
    p.add_argument("--algos", default=",".join(ALGOS))
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the random verifiers")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--anchors", type=int, default=16, help="max_anchors of the block drafters")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--output", default="runs/rehearse.json")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--algo", help=argparse.SUPPRESS)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="llama only, the first algorithm, hidden 64, 64 tokens: every stage's code in seconds "
        "(make test); the tolerance is not applied",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.models, args.algos = "llama", ALGOS[0]
        args.max_length, args.samples, args.anchors = 64, 4, 4
    if args.measure:
        print(json.dumps(measure_stage(args.measure, args.recipe, args.algo)))
        return 0
    args.algos = [a for a in args.algos.split(",") if a]
    print("| model | algo | stage | predicted GiB | measured GiB | measured / predicted | s |")
    print("|---|---|---|---|---|---|---|")
    rows = [row for model in args.models.split(",") for row in rehearse_model(model, args)]
    out = {
        "smoke": args.smoke,
        "what": "peak RSS of each stage above its process's RSS after imports (VmHWM, reset through "
        "/proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536) vs specctl plan for a CPU device",
        "layers": args.layers,
        "max_length": args.max_length,
        "rows": rows,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    bad = [] if args.smoke else [r for r in rows if abs(r["ratio"] - 1) > args.tolerance]
    for r in bad:
        print(f"outside {args.tolerance:.0%}: {r['model']} {r['algo']} {r['stage']} ratio {r['ratio']:.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
