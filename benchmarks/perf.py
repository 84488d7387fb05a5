"""`make bench-perf`: speed and size figures, each measured against a baseline in the same run.

Writes one flat JSON object (runs/bench-perf.json by default). Machines here are noisy, so
every target is a ratio to a baseline measured in the same process, never an absolute time.
Usage: python -m benchmarks.perf [--output FILE] [--only collect,...]  (`--only data`: generation, HF vs vLLM)
       python -m benchmarks.perf --smoke  (every section on a tiny random verifier in seconds; `make test`)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

import torch

from specctl.devices import torch_threads
from specctl.durable import write_atomic

if TYPE_CHECKING:
    from specctl.drafters import Drafter, VerifierSpec, VerifierWeights
    from specctl.recipe import TrainSection

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


def bench_collect(workdir: Path, num_samples: int = 24, verifier: str | None = None) -> dict[str, float]:
    """collect-hidden-states vs a plain HF forward (output_hidden_states=True) on the same samples,
    with the recipe's default verifier (`verifier`: another model's path)."""
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
            **({"verifier": {"name_or_path": verifier}} if verifier else {}),
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
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc: hand freed heap pages back to the OS,
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # so an earlier, larger step's garbage is not reused
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
    dtype: torch.dtype | None = None,
    train: TrainSection | None = None,
) -> dict[str, float]:
    """Forward + backward + optimizer step of `drafter` on one batch, repeated: throughput and
    peak memory. The optimizer is the one `specctl train` builds for `train` (default: the
    schema's, AdamW), so the figure is the trainer's.

    positions = draft predictions the loss counts (anchors x block for block drafters,
    sampled depths for P-EAGLE, TTT steps for EAGLE-3); tokens = sequence tokens consumed.
    Peak memory is above what was allocated before the first step (verifier weights excluded).
    `dtype`: the compute dtype (bf16 = autocast, as `train.precision` gives); None = what the
    training loop's `auto` picks on this device.
    """
    from specctl.devices import autocast, compute_dtype
    from specctl.optim import build_optimizer, vocab_sizes
    from specctl.recipe import TrainSection

    drafter = drafter.to(device).train()
    batch = {k: v.to(device) for k, v in batch.items()}
    sizes = vocab_sizes(drafter.verifier.vocab_size, drafter.d2t)
    optimizer = build_optimizer(drafter, train or TrainSection(), sizes)
    context = autocast(device, dtype or compute_dtype(device, "auto"))

    def step() -> float:
        with context:
            loss, metrics = drafter(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(metrics["count"].sum())

    baseline = _reset_peak_memory(device)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    positions, start, cpu_start = 0.0, time.perf_counter(), time.process_time()
    for _ in range(steps):
        positions += step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    tokens = float(batch["attention_mask"].sum()) * steps
    return {
        "positions_per_s": positions / seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
        "peak_mem_mb": _peak_memory_mb(device, baseline),
        "step_s": seconds / steps,
        "step_cpu_s": cpu_seconds / steps,  # all threads; steadier than wall time on a shared CPU
    }


def with_target_stats(batch: dict[str, torch.Tensor], weights, eps: float) -> dict[str, torch.Tensor]:
    """The batch as a store collected today gives it: the verifier's full-vocabulary argmax and
    logsumexp beside the final hidden state (features.Layout.target_stats)."""
    from specctl.drafters.targets import verifier_topk

    B, T, H = batch["last_hidden_state"].shape
    ids, _, lse = verifier_topk(
        batch["last_hidden_state"].reshape(-1, H), weights.norm, weights.lm_head, eps, 1
    )
    return {**batch, "target_argmax": ids[:, 0].view(B, T), "logsumexp": lse.view(B, T)}


# The peer's quickstart-equivalent DFlash samples 32 anchors per packed 2048-token batch; specctl's
# max_anchors counts per sequence, so 8 per 512-token sequence is the same density (docs/performance.md).
PEER_ANCHORS_PER_SEQUENCE = 8


def _train_quickstart_drafter(
    algo: str,
    spec,
    weights,
    batch,
    steps: int,
    device: torch.device,
    dtype: torch.dtype,
    threads: int = 0,
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """`measure_train_step` of the quickstart-<algo> drafter (with `--set` overrides), freshly
    built (same seed), on `threads` intra-op threads (0 = as many as now)."""
    from specctl.drafters import DRAFTERS
    from specctl.recipe import load_recipe, resolve_recipe_path

    recipe = load_recipe(resolve_recipe_path(f"quickstart-{algo}.yaml"), overrides)
    d2t = None
    if recipe.drafter.draft_vocab_size is not None:  # the most frequent ids of random data: any will do
        d2t = torch.zeros(recipe.drafter.draft_vocab_size, dtype=torch.long)
    torch.manual_seed(0)
    drafter = DRAFTERS[algo].build(getattr(recipe.drafter, algo), spec, weights, d2t, recipe.train.loss)
    with torch_threads(threads or torch.get_num_threads()):
        return measure_train_step(drafter, batch, steps, device, dtype=dtype, train=recipe.train)


def bench_train(
    workdir: Path, seq_len: int = 512, batch_size: int = 4, steps: int = 3, overrides: tuple[str, ...] = ()
) -> dict[str, float]:
    """Each quickstart-<algo> drafter (SmolLM2 verifier, CPU-sized config) on synthetic features
    (`overrides`: `--set` assignments on the quickstart recipes).

    Baselines in the same run: the verifier's own forward over the same tokens
    (`train_ratio_vs_verifier_forward.<algo>`), and the same step in float32
    (`train_speedup_vs_float32.<algo>`: what `train.precision: auto` buys on this machine).
    `train_tokens_per_s_per_thread.<algo>` is one intra-op thread, tokens per CPU second, in the
    precision `auto` picks: the figure to compare with another trainer run the same way.
    """
    from specctl.devices import compute_dtype
    from specctl.drafters import DRAFTERS
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.verifier import capture_hidden_states, load_verifier, recipe_verifier_spec, verifier_weights

    base = load_recipe(resolve_recipe_path("quickstart.yaml"), overrides)
    verifier = load_verifier(base.verifier)
    spec = recipe_verifier_spec(verifier, base)
    aux_ids = spec.aux_layer_ids
    weights = verifier_weights(verifier)
    batch = synthetic_batch(spec, batch_size, seq_len, torch.Generator().manual_seed(0))
    batch = with_target_stats(batch, weights, spec.rms_norm_eps)

    capture_hidden_states(verifier.model, batch["input_ids"][:1, :64], None, aux_ids)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        capture_hidden_states(verifier.model, batch["input_ids"], None, aux_ids)
    verifier_tps = batch_size * seq_len * steps / (time.perf_counter() - start)
    auto = compute_dtype(verifier.device, "auto")
    figures: dict[str, float] = {
        "train_verifier_forward_tokens_per_s": round(verifier_tps, 1),
        "train_compute_dtype_is_bf16": float(auto == torch.bfloat16),
    }
    for algo in DRAFTERS:
        run = partial(
            _train_quickstart_drafter, algo, spec, weights, batch, steps, verifier.device, overrides=overrides
        )
        m = run(auto)
        figures[f"train_positions_per_s.{algo}"] = round(m["positions_per_s"], 1)
        figures[f"train_tokens_per_s.{algo}"] = round(m["tokens_per_s"], 1)
        figures[f"train_peak_mem_mb.{algo}"] = round(m["peak_mem_mb"], 1)
        figures[f"train_ratio_vs_verifier_forward.{algo}"] = round(m["tokens_per_s"] / verifier_tps, 3)
        one, fp32 = run(auto, threads=1), run(torch.float32, threads=1)
        figures[f"train_tokens_per_s_per_thread.{algo}"] = round(one["tokens_per_cpu_s"], 1)
        per_cpu_s = one["positions_per_s"] * one["step_s"] / one["step_cpu_s"]
        figures[f"train_positions_per_s_per_thread.{algo}"] = round(per_cpu_s, 1)
        speedup = one["tokens_per_cpu_s"] / fp32["tokens_per_cpu_s"]
        figures[f"train_speedup_vs_float32.{algo}"] = round(speedup, 3)
        if "max_anchors" in DRAFTERS[algo].config_cls.model_fields:  # block drafters: the peer's density
            peer = f"drafter.{algo}.max_anchors={PEER_ANCHORS_PER_SEQUENCE}"
            sparse = run(auto, threads=1, overrides=(*overrides, peer))
            figures[f"train_tokens_per_s_per_thread_peer_density.{algo}"] = round(
                sparse["tokens_per_cpu_s"], 1
            )
    return figures


SEQ_LENS = (512, 2048, 8192)


def tiny_verifier(
    hidden_size: int = 128, vocab_size: int = 2048, num_aux: int = 3, seed: int = 0
) -> tuple[VerifierSpec, VerifierWeights]:
    """A verifier spec + random frozen weights for drafter-only benchmarks: no model is loaded.

    Drafters only read the verifier's geometry and its embed/norm/lm_head tensors, so a
    made-up spec measures the drafter's own cost (4 heads of 32, 2 KV heads, MLP 2H).
    """
    from specctl.drafters import VerifierSpec, VerifierWeights

    heads, kv_heads = max(1, hidden_size // 32), max(1, hidden_size // 64)
    spec = VerifierSpec(
        name_or_path="tiny-random",
        architectures=("LlamaForCausalLM",),
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_hidden_layers=num_aux + 3,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        intermediate_size=2 * hidden_size,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max(SEQ_LENS) + 64,
        aux_layer_ids=tuple(range(2, 2 + num_aux)),
        mask_token_id=vocab_size - 1,
    )
    g = torch.Generator().manual_seed(seed)
    weights = VerifierWeights(
        embed_tokens=torch.randn(vocab_size, hidden_size, generator=g) * 0.02,
        lm_head=torch.randn(vocab_size, hidden_size, generator=g) * 0.02,
        norm=torch.ones(hidden_size),
    )
    return spec, weights


def _vm_size_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_limit(extra_bytes: int) -> Iterator[None]:
    """Cap new address space at `extra_bytes` over what the process maps now (RLIMIT_AS).

    A training step that would need more fails its allocation with a RuntimeError instead of
    pushing a shared machine into swap or the OOM killer; the limit is lifted on exit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size_bytes() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def default_mem_limit_mb() -> float:
    """Half of the memory available now, at most 12 GiB: the machine is shared."""
    return min(12 * 1024.0, 0.5 * _available_mb())


def bench_seq(
    workdir: Path,
    seq_lens: tuple[int, ...] = SEQ_LENS,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 2048,
    mem_limit_mb: float | None = None,
    tokens_per_measure: int = 2048,
    threads: int = 1,
) -> dict[str, float]:
    """How each drafter's training step scales with sequence length (batch = 1 sequence).

    Tiny drafters (hidden 128, 2 layers, vocab 2048), every other setting at its recipe
    default, on synthetic features. `train_time_ratio_seq{L}_vs_{S}` is the step time
    ratio (`train_cpu_time_ratio_...` the same in process CPU time, which other jobs on a
    shared machine disturb less); linear scaling gives `train_positions_ratio_seq{L}_vs_{S}`
    (the ratio of scored positions, the sequence-length ratio unless an anchor cap binds).
    A step that would allocate more than `mem_limit_mb` is stopped and reported as
    `train_over_mem_limit_mb_seq{L}.<algo>` instead of its figures.

    One intra-op thread by default: tiny drafters are thousands of small ops, and on a shared
    2-core machine two OpenMP threads spinning for each other made steps 3-10x slower.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _bench_seq(
            workdir, seq_lens, hidden_size, num_layers, vocab_size, mem_limit_mb, tokens_per_measure
        )
    finally:
        torch.set_num_threads(threads_before)


def _bench_seq(
    workdir: Path,
    seq_lens: tuple[int, ...],
    hidden_size: int,
    num_layers: int,
    vocab_size: int,
    mem_limit_mb: float | None,
    tokens_per_measure: int,
) -> dict[str, float]:
    from specctl.drafters import DRAFTERS
    from specctl.recipe import TrainSection

    limit_mb = default_mem_limit_mb() if mem_limit_mb is None else mem_limit_mb
    spec, weights = tiny_verifier(hidden_size, vocab_size)
    device = torch.device("cpu")
    figures: dict[str, float] = {"train_seq_mem_limit_mb": round(limit_mb)}
    for algo, drafter_spec in DRAFTERS.items():
        step_s: dict[int, float] = {}
        cpu_s: dict[int, float] = {}
        positions: dict[int, float] = {}
        for seq_len in seq_lens:
            batch = synthetic_batch(spec, 1, seq_len, torch.Generator().manual_seed(seq_len))
            torch.manual_seed(0)
            drafter = drafter_spec.build(
                drafter_spec.config_cls(num_layers=num_layers), spec, weights, None, TrainSection().loss
            )
            # about the same tokens per measurement; the longest runs once, without a warm-up
            # step (its one-off costs are small next to a step that long, and 2 cores are slow)
            steps, warmup = max(1, tokens_per_measure // seq_len), int(seq_len < max(seq_lens))
            try:
                with address_space_limit(int(limit_mb * 2**20)):
                    m = measure_train_step(drafter, batch, steps, device, warmup=warmup)
            except (RuntimeError, MemoryError) as e:  # torch's "can't allocate memory" under the cap
                if isinstance(e, RuntimeError) and "allocate" not in str(e):
                    raise
                figures[f"train_over_mem_limit_mb_seq{seq_len}.{algo}"] = round(limit_mb)
                print(f"seq: {algo} at {seq_len} tokens needs more than {limit_mb:.0f} MiB; skipped")
                continue
            finally:
                del drafter
                gc.collect()
            step_s[seq_len], cpu_s[seq_len] = m["step_s"], m["step_cpu_s"]
            positions[seq_len] = m["positions_per_s"] * m["step_s"]
            figures[f"train_positions_per_s_seq{seq_len}.{algo}"] = round(m["positions_per_s"], 1)
            figures[f"train_peak_mem_mb_seq{seq_len}.{algo}"] = round(m["peak_mem_mb"], 1)
            figures[f"train_step_s_seq{seq_len}.{algo}"] = round(m["step_s"], 4)
            figures[f"train_step_cpu_s_seq{seq_len}.{algo}"] = round(m["step_cpu_s"], 4)
        short, long = min(seq_lens), max(seq_lens)
        if short in step_s and long in step_s and short != long:
            figures[f"train_time_ratio_seq{long}_vs_{short}.{algo}"] = round(step_s[long] / step_s[short], 2)
            figures[f"train_cpu_time_ratio_seq{long}_vs_{short}.{algo}"] = round(
                cpu_s[long] / cpu_s[short], 2
            )
            figures[f"train_positions_ratio_seq{long}_vs_{short}.{algo}"] = round(
                positions[long] / positions[short], 2
            )
    return figures


VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def verify_costs(
    models: dict[str, torch.nn.Module], prefix: int = 200, rounds: int = 9
) -> dict[str, dict[int, float]]:
    """Median ms of one KV-cached forward over n new tokens after `prefix` cached ones, per model
    and n (the embedded engine's verify step: n = K + 1). Models and n take turns within each
    round, so a slow spell of a shared machine lands on all of them alike."""
    import statistics

    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in models for n in VERIFY_TOKENS}
    with torch.inference_mode():
        caches = {}
        for name, model in models.items():
            caches[name] = DynamicCache(config=model.config)
            vocab = model.config.vocab_size
            model(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen), past_key_values=caches[name])
        for _ in range(rounds):
            for n in VERIFY_TOKENS:
                for name, model in models.items():
                    x = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
                    start = time.perf_counter()
                    model(input_ids=x, past_key_values=caches[name], use_cache=True, logits_to_keep=n)
                    times[(name, n)].append((time.perf_counter() - start) * 1000)
                    caches[name].crop(-n)
    return {name: {n: statistics.median(times[(name, n)]) for n in VERIFY_TOKENS} for name in models}


def prepacked_bf16(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The bf16 weights prepacked for oneDNN's linear, or None where this torch or CPU cannot
    (`specctl.kernels.onednn_prepack_available`)."""
    from specctl.kernels import onednn_prepack_available

    if not onednn_prepack_available(torch.bfloat16):
        return None
    return [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]


def linear_kernel_costs(
    shapes: list[tuple[int, int]], rows: tuple[int, ...] = (1, 4, 8), repeats: int = 30
) -> dict[str, dict[int, float]]:
    """Microseconds of one pass over every weight in `shapes` ([out, in], bf16) with a batch of
    `rows` rows, per kernel: F.linear (what transformers' forward and the drafters run), torch.mv
    (one row only) and, where torch has it, oneDNN with the weight prepacked (inductor's CPU
    path). Kernels and row counts take turns within each repeat. Why: the embedded engine's
    speedups rest on what a K+1-row verify costs against a one-row decode, and that ratio
    depends on the kernel (docs/performance.md)."""
    import statistics

    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(torch.bfloat16) for o, i in shapes]
    inputs = {m: [torch.randn(m, i, generator=gen).to(torch.bfloat16) for _, i in shapes] for m in rows}
    kernels: dict[str, Callable[[list[torch.Tensor]], object]] = {
        "linear": lambda xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
        "mv": lambda xs: [torch.mv(w, x[0]) for x, w in zip(xs, weights, strict=True)],
    }
    packed = prepacked_bf16(weights)
    if packed is not None:
        kernels["prepacked"] = lambda xs: [
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            for x, p in zip(xs, packed, strict=True)
        ]
    reference = kernels["linear"](inputs[1])
    for name, kernel in kernels.items():  # the same product, or it is no comparison
        for got, want in zip(kernel(inputs[1]), reference, strict=True):
            torch.testing.assert_close(
                got.view(-1).float(), want.view(-1).float(), rtol=2e-2, atol=2e-2, msg=f"{name} != F.linear"
            )
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(repeats + 2):  # two warm-up rounds
        for m in rows:
            for name, kernel in kernels.items():
                if name == "mv" and m != 1:  # one row only
                    continue
                start = time.perf_counter()
                kernel(inputs[m])
                if r >= 2:
                    times.setdefault((name, m), []).append((time.perf_counter() - start) * 1e6)
    return {
        name: {m: statistics.median(times[(name, m)]) for m in rows if (name, m) in times} for name in kernels
    }


def bench_verify(workdir: Path, overrides: tuple[str, ...] = (), rounds: int = 9) -> dict[str, float]:
    """The verify curve: what a SmolLM2 forward over n = 1..16 new tokens costs, in the engine's
    dtype (`verifier.dtype` of the quickstart recipe) with the engine's matmul kernel
    (`bench.linear_kernel`), and beside it with F.linear (`.f_linear`) when that kernel is the
    prepacked one, and, where this CPU has native bf16, in bfloat16 too.
    `verify_cost_ratio_8_vs_1` (a K=7 verify over a decode step) is the figure that decides
    whether a parallel drafter's long block can pay (docs/performance.md)."""
    import copy

    from specctl.devices import cpu_has_native_bf16
    from specctl.kernels import PREPACKED, apply_kernel, resolve_kernel
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.verifier import load_verifier

    recipe = load_recipe(resolve_recipe_path("quickstart.yaml"), overrides)
    verifier = load_verifier(recipe.verifier)
    dtype = next(verifier.model.parameters()).dtype
    kernel = resolve_kernel(recipe.bench.linear_kernel, verifier.device, dtype)  # as bench runs it
    extra = {}  # copies taken before the engine's kernel replaces the verifier's linears
    if kernel == PREPACKED:  # before the kernel: F.linear, same dtype
        extra["f_linear"] = copy.deepcopy(verifier.model)
    if dtype != torch.bfloat16 and verifier.device.type == "cpu" and cpu_has_native_bf16():
        extra["bfloat16"] = copy.deepcopy(verifier.model).to(torch.bfloat16)  # F.linear: bench's auto there
    apply_kernel(verifier.model, kernel)
    models = {str(dtype).removeprefix("torch."): verifier.model, **extra}
    curves = verify_costs(models, rounds=rounds)
    figures: dict[str, float] = {"verify_linear_kernel_prepacked": float(kernel == PREPACKED)}
    for i, (name, curve) in enumerate(curves.items()):
        suffix = "" if i == 0 else f".{name}"  # the engine's own dtype first, unsuffixed
        for n, ms in curve.items():
            figures[f"verify_cost_ms_n{n}{suffix}"] = round(ms, 1)
        figures[f"verify_cost_ratio_8_vs_1{suffix}"] = round(curve[8] / curve[1], 3)
        figures[f"verify_cost_ratio_16_vs_1{suffix}"] = round(curve[16] / curve[1], 3)
    if verifier.device.type == "cpu" and cpu_has_native_bf16():
        figures.update(kernel_figures(verifier.model.config))
    return figures


def kernel_figures(config) -> dict[str, float]:
    """`linear_kernel_costs` of `config`'s projections: `linear_us.<kernel>.<part>.m<rows>` for one
    decoder layer and for the LM head, and `linear_speedup_vs_f_linear.<kernel>.m<rows>` over all
    of a forward's products (num_hidden_layers layers and the head)."""
    H, inter, V = config.hidden_size, config.intermediate_size, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or H // heads
    attention = [(heads * hd, H), (kv * hd, H), (kv * hd, H), (H, heads * hd)]
    parts = {"layer": linear_kernel_costs([*attention, (inter, H), (inter, H), (H, inter)])}
    parts["lm_head"] = linear_kernel_costs([(V, H)])
    figures: dict[str, float] = {}
    for part, costs in parts.items():
        for name, by_rows in costs.items():
            for m, us in by_rows.items():
                figures[f"linear_us.{name}.{part}.m{m}"] = round(us, 1)

    def forward_us(name: str, m: int) -> float:
        return config.num_hidden_layers * parts["layer"][name][m] + parts["lm_head"][name][m]

    for name, by_rows in parts["layer"].items():
        for m in by_rows:
            if name != "linear":
                figures[f"linear_speedup_vs_f_linear.{name}.m{m}"] = round(
                    forward_us("linear", m) / forward_us(name, m), 3
                )
    return figures


@contextlib.contextmanager
def timed(obj: object, name: str) -> Iterator[list[float]]:
    """Seconds of every call to `obj.name` while the block runs (an instance attribute shadows the
    method, removed after), so one generation tells the drafter's share of a step from the verifier's."""
    method, seconds = getattr(obj, name), []

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)
    try:
        yield seconds
    finally:
        delattr(obj, name)


def bench_engine(
    workdir: Path,
    run_dir: Path = Path("runs/quickstart"),
    num_prompts: int = 3,
    max_new_tokens: int = 64,
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """The embedded engine on SmolLM2, batch 1, greedy, the built-in prompts.

    Baseline in the same run: HF `generate` (greedy, KV cache) on the same prompts, so
    `engine_nospec_ratio_vs_hf_generate` says whether speedups are measured against a fair plain
    decoder. `engine_speedup.<algo>` (and `engine_speedup_best` over the parallel drafters) uses
    the drafters exported under `run_dir` (the quickstart's), and is left out when there are none:
    an untrained drafter's speedup means nothing.
    """
    from specctl.bench.prompts import load_prompts
    from specctl.drafters import DRAFTERS
    from specctl.engine import generate
    from specctl.kernels import PREPACKED, apply_kernel
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.speculators.io import load_drafter
    from specctl.verifier import load_verifier

    recipe = load_recipe(resolve_recipe_path("quickstart.yaml"), overrides)
    verifier = load_verifier(recipe.verifier)
    # the dev prompts: a kernel is chosen by these figures, never on what the bench reports
    prompts, _ = load_prompts("builtin", verifier.tokenizer, num_prompts, split="dev")
    model = verifier.model

    def tokens_per_s(decode: Callable[[list[int]], int]) -> float:
        decode(list(prompts[0].prompt_ids)[:8])  # warm-up
        tokens, start = 0, time.perf_counter()
        for p in prompts:
            tokens += decode(list(p.prompt_ids))
        return tokens / (time.perf_counter() - start)

    def hf(ids: list[int]) -> int:
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
        return out.shape[1] - len(ids)

    def engine(drafter: Drafter | None) -> Callable[[list[int]], int]:
        return lambda ids: len(generate(verifier, drafter, ids, max_new_tokens).tokens)

    hf_tps = tokens_per_s(hf)  # transformers' own kernels
    kernel = apply_kernel(model, recipe.bench.linear_kernel)  # then the engine's, as bench runs it
    plain_tps = tokens_per_s(engine(None))
    figures = {
        "engine_linear_kernel_prepacked": float(kernel == PREPACKED),
        "engine_hf_generate_tokens_per_s": round(hf_tps, 2),
        "engine_nospec_tokens_per_s": round(plain_tps, 2),
        "engine_nospec_ratio_vs_hf_generate": round(plain_tps / hf_tps, 3),
    }
    parallel = []
    for export in sorted(run_dir.glob("drafters/*/export")):
        drafter, _ = load_drafter(export, verifier=verifier)
        apply_kernel(drafter, kernel)
        with timed(drafter, "propose_with_logits") as propose_s, timed(model, "forward") as verify_s:
            speedup = tokens_per_s(engine(drafter)) / plain_tps
        figures[f"engine_speedup.{drafter.algo}"] = round(speedup, 3)
        # what a step costs besides the verify: speedup ~ tau / (verify_k / verify_1 + this)
        figures[f"engine_propose_ratio_vs_verify.{drafter.algo}"] = round(mean(propose_s) / mean(verify_s), 3)
        if DRAFTERS[drafter.algo].parallel:
            parallel.append(speedup)
    if parallel:
        figures["engine_speedup_best"] = round(max(parallel), 3)
    else:
        print(
            f"engine: no exported drafters under {run_dir}; run the quickstart pipeline "
            "(docs/getting-started.md) for engine_speedup.<algo>"
        )
    return figures


def bench_features(
    workdir: Path,
    run_dir: Path = Path("runs/quickstart"),
    algos: tuple[str, ...] | None = None,
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """The compact feature layout (fp8 aux states + top-16 targets) against bf16, on quickstart data.

    Both stores are collected from the same prepared conversations (`run_dir/data`, which the
    quickstart pipeline writes), and each drafter is trained on each with the quickstart recipe and the same
    seed: `tau_hat_ratio_compact_vs_bf16` is what the smaller store costs in held-out acceptance.
    Left out when there is no quickstart data: self-generating it here would take minutes more.
    `overrides` (`--set` assignments on both recipes) must match how `run_dir/data` was made.
    `algos` default: the algorithms trained under `run_dir` (by the quickstart pipeline,
    docs/getting-started.md).
    """
    from specctl.collect import collect
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.train import run_training
    from specctl.verifier import load_verifier

    if not (run_dir / "data" / "manifest.json").is_file():
        print(
            f"features: no prepared data under {run_dir}; run the quickstart pipeline for "
            "tau_hat_ratio_compact_vs_bf16"
        )
        return {}
    if algos is None:
        algos = tuple(
            sorted(p.name for p in (run_dir / "drafters").glob("*") if (p / "metrics.jsonl").is_file())
        )
    layouts = {"bf16": [], "compact": ["features.aux_dtype=fp8", "features.target=topk", "features.topk=16"]}
    figures: dict[str, float] = {}
    tau: dict[str, dict[str, float]] = {}
    verifier = None
    for name, settings in layouts.items():
        shutil.copytree(run_dir / "data", workdir / name / "data")  # same samples, no regeneration
        base = [*overrides, f"output_dir={workdir}", f"name={name}", *settings]
        recipe = load_recipe(resolve_recipe_path("quickstart.yaml"), base)
        verifier = verifier or load_verifier(recipe.verifier)
        summary = collect(recipe, verifier=verifier, progress=False)
        figures[f"feature_bytes_per_token.{name}"] = round(summary.bytes_per_token or 0.0, 1)
        for algo in algos:
            trained = run_training(
                load_recipe(resolve_recipe_path("quickstart.yaml"), [*base, f"drafter.algo={algo}"]),
                progress=False,
            )
            if trained is None or trained.tau_hat is None:
                raise RuntimeError(f"features: training {algo} on the {name} store gave no validation")
            tau.setdefault(algo, {})[name] = trained.tau_hat
            figures[f"tau_hat_{name}.{algo}"] = round(trained.tau_hat, 4)
    figures["feature_bytes_ratio_compact_vs_bf16"] = round(
        figures["feature_bytes_per_token.compact"] / figures["feature_bytes_per_token.bf16"], 3
    )
    for algo, pair in tau.items():
        figures[f"tau_hat_ratio_compact_vs_bf16.{algo}"] = round(pair["compact"] / pair["bf16"], 4)
    figures["tau_hat_ratio_compact_vs_bf16"] = round(min(p["compact"] / p["bf16"] for p in tau.values()), 4)
    return figures


PROMPT_STYLES = ("", " Answer in two sentences.", " Explain step by step.", " Answer as a teacher would.")


def _answer_prompts(path: Path) -> Path:
    """The bench's 18 built-in dev prompts (chat, code, math), each in four phrasings: 72 distinct
    conversations whose assistant turn is regenerated (its placeholder text is replaced). The dev
    split: this figure chooses `data.engine`, and nothing is chosen on the test prompts."""
    from specctl.bench.prompts import builtin_rows

    questions = [row.messages[-1]["content"] for row in builtin_rows("dev")]
    with open(path, "w") as f:
        for style in PROMPT_STYLES:
            for q in questions:
                msgs = [{"role": "user", "content": q + style}, {"role": "assistant", "content": "-"}]
                f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def bench_data(
    workdir: Path,
    max_new_tokens: int = 64,
    engines: tuple[str, ...] = ("hf", "vllm"),
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """The data stage's generation through HF generate and through vLLM, on SmolLM2: the same 72
    prompts, the same max tokens and (greedy) sampling, each engine at the recipe defaults (HF:
    data.batch_size 8; vLLM: 256 in flight, bfloat16, one worker).

    `generate_tokens_per_s_<engine>`: new tokens over the generation loop's wall time (the model
    load and vLLM's start apart, in `generate_stage_s_<engine>`, the whole data stage);
    `generate_ratio_vllm_vs_hf` the speedup (target >= 5 on 2 cores);
    `generate_same_answers_vllm_vs_hf` the share of answers the two write identically (greedy,
    fp32 HF vs bf16 vLLM: numerics decide near-ties).
    """
    from transformers import AutoTokenizer

    from specctl.data import prepare_data
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.verifier import locate_verifier
    from specctl.vllm.support import vllm_support

    recipe = load_recipe(resolve_recipe_path("quickstart.yaml"), overrides)
    source, _ = locate_verifier(recipe.verifier.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(source)
    chats = _answer_prompts(workdir / "prompts.jsonl")
    figures: dict[str, float] = {}
    answers: dict[str, list[str]] = {}
    for engine in engines:
        if engine == "vllm":
            from transformers import AutoConfig

            why = vllm_support(AutoConfig.from_pretrained(source)).why_not
            if why:
                print(f"data: no vllm figures ({why})")
                continue
        data = recipe.data.model_copy(
            update=dict(
                source=str(chats),
                regenerate=True,
                shuffle=False,
                engine=engine,
                max_new_tokens=max_new_tokens,
                temperature=0.0,
                max_length=1024,
            )
        )
        start = time.perf_counter()
        summary = prepare_data(
            data, tokenizer, workdir / engine / "data", verifier=recipe.verifier, progress=False
        )
        figures[f"generate_stage_s_{engine}"] = round(time.perf_counter() - start, 1)
        figures[f"generate_tokens_per_s_{engine}"] = round(summary.generation_tokens_per_s or 0.0, 1)
        lines = (workdir / engine / "data" / "conversations.jsonl").read_text().splitlines()
        answers[engine] = [json.loads(line)["messages"][-1]["content"] for line in lines]
    if "hf" in answers and "vllm" in answers:
        hf, vllm = figures["generate_tokens_per_s_hf"], figures["generate_tokens_per_s_vllm"]
        figures["generate_ratio_vllm_vs_hf"] = round(vllm / hf, 2) if hf else 0.0
        same = sum(a == b for a, b in zip(answers["hf"], answers["vllm"], strict=True))
        figures["generate_same_answers_vllm_vs_hf"] = round(same / len(answers["hf"]), 3)
    return figures


def bench_optim(
    workdir: Path, shapes: tuple[tuple[int, int], ...] = ((576, 1536), (2048, 2048))
) -> dict[str, float]:
    """Why specctl.optim is torch's: torch.optim.Muon (bfloat16 Newton-Schulz) against the float32
    iteration (`Float32Muon`'s; time per step and how far the updates differ), which of the two
    specctl runs on this CPU (`muon_float32_here`: 1 where bf16 would be emulated), and the torch
    schedulers build_scheduler chains against the closed form lr_at (and transformers' nearest)."""
    import warnings

    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C

    from specctl.optim import Float32Muon, build_scheduler, lr_at, muon_class, newton_schulz_fp32
    from specctl.recipe import TrainSection

    figures: dict[str, float] = {"muon_float32_here": float(muon_class(torch.device("cpu")) is Float32Muon)}
    for rows, cols in shapes:
        torch.manual_seed(0)
        grads = [torch.randn(rows, cols) for _ in range(3)]
        start = time.perf_counter()
        ours = [newton_schulz_fp32(g, (DEFAULT_A, DEFAULT_B, DEFAULT_C), 5, 1e-7) for g in grads]
        fp32_s = (time.perf_counter() - start) / len(grads)
        p = torch.nn.Parameter(torch.zeros(rows, cols))
        opt = torch.optim.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)
        elapsed, diffs = 0.0, []
        for g, ref in zip(grads, ours, strict=True):
            p.data.zero_()
            p.grad = g
            start = time.perf_counter()
            opt.step()
            elapsed += time.perf_counter() - start
            diffs.append(((-p.detach()) - ref).norm().item() / ref.norm().item())  # lr 1: p = -update
        key = f"{rows}x{cols}"
        figures[f"muon_step_s_fp32_newton_schulz.{key}"] = round(fp32_s, 4)
        figures[f"muon_step_s_torch.{key}"] = round(elapsed / len(grads), 4)
        figures[f"muon_speedup_torch_vs_fp32.{key}"] = round(fp32_s / (elapsed / len(grads)), 2)
        figures[f"muon_update_rel_diff_torch_vs_fp32.{key}"] = round(max(diffs), 5)
    cfg = TrainSection(lr=3e-4, warmup_steps=50, max_steps=1000, schedule="cosine", min_lr_ratio=0.1)
    closed = [lr_at(s, cfg.lr, 50, 1000, "cosine", 0.1) for s in range(cfg.max_steps)]

    def deviation(make) -> float:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        sched, worst = make(opt), 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for want in closed:
                worst = max(worst, abs(opt.param_groups[0]["lr"] - want) / cfg.lr)
                opt.step()
                sched.step()
        return worst

    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    figures["lr_max_deviation_torch_schedulers"] = deviation(lambda o: build_scheduler(o, cfg))
    figures["lr_max_deviation_transformers_cosine_with_min_lr"] = round(
        deviation(lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 50, 1000, min_lr_rate=0.1)), 5
    )
    return figures


BENCHES: dict[str, Callable[[Path], dict[str, float]]] = {
    "collect": bench_collect,
    "train": bench_train,
    "seq": bench_seq,
    "engine": bench_engine,
    "verify": bench_verify,
    "features": bench_features,
    "data": bench_data,
    "optim": bench_optim,
}


# ---------------------------------------------------------------- --smoke: the tooling held by `make test`

SMOKE_VOCAB = 320  # 259 byte ids and the chat specials fit; small enough for every LM head to be cheap


def smoke_verifier(out: Path) -> Path:
    """A random Llama (hidden 64, 8 layers: EAGLE-3's default aux layers 2, 4, 5 are distinct) with
    the byte-level chat tokenizer, saved as an HF directory every section can load in place of
    SmolLM2: no download, loads in a second."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.rehearse import byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SMOKE_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


def smoke_run(overrides: tuple[str, ...]) -> Path:
    """What the quickstart pipeline leaves for `engine` and `features`, made in seconds: prepared data
    and features of a few synthetic chats, and an untrained tiny export of every drafter (the
    engine's figures then mean nothing; the code paths are the real ones)."""
    from specctl.collect import collect
    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import load_recipe, resolve_recipe_path
    from specctl.verifier import load_verifier, recipe_verifier_spec, verifier_weights

    recipe = load_recipe(resolve_recipe_path("quickstart.yaml"), overrides)
    verifier = load_verifier(recipe.verifier)
    collect(recipe, verifier=verifier, progress=False)
    spec, weights = recipe_verifier_spec(verifier, recipe), verifier_weights(verifier)
    for name, algo in DRAFTERS.items():
        torch.manual_seed(0)
        drafter = algo.build(algo.config_cls(**algo.tiny), spec, weights, None, "kl")
        save_drafter(drafter, recipe.run_dir / "drafters" / name / "export", dtype="float32")
    return recipe.run_dir


def smoke_arguments(workdir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each section's arguments at its smallest: one tiny verifier for all, one step, a few tokens."""
    verifier = smoke_verifier(workdir / "verifier")
    overrides = (f"verifier.name_or_path={verifier}", "drafter.draft_vocab_size=null")
    run_args = (
        f"data.source={_conversations(workdir / 'chats.jsonl', 8)}",
        "data.max_length=256",
        f"output_dir={workdir / 'runs'}",
        "name=smoke",
    )
    small_train = ("train.max_steps=2", "train.warmup_steps=0", "train.eval_every=2", "train.save_every=2")
    run_dir = smoke_run((*overrides, *run_args)) if {"engine", "features"} & set(names) else None
    return {
        "collect": {"num_samples": 4, "verifier": str(verifier)},
        "train": {"seq_len": 64, "batch_size": 1, "steps": 1, "overrides": overrides},
        "seq": {
            "seq_lens": (32, 64),
            "hidden_size": 32,
            "num_layers": 1,
            "vocab_size": 128,
            "tokens_per_measure": 32,
        },
        "engine": {"run_dir": run_dir, "num_prompts": 1, "max_new_tokens": 8, "overrides": overrides},
        "verify": {"overrides": overrides, "rounds": 1},
        "features": {
            "run_dir": run_dir,
            "algos": ("eagle3",),
            "overrides": (*overrides, *run_args[:2], *small_train, "train.batch_tokens=512"),
        },
        "data": {"max_new_tokens": 4, "engines": ("hf",), "overrides": overrides},
        "optim": {"shapes": ((8, 12),)},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None, help="default: runs/bench-perf.json (--smoke: -smoke.json)")
    parser.add_argument("--only", default=",".join(BENCHES), help="comma-separated: " + ",".join(BENCHES))
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every section on a tiny random verifier at its smallest sizes, in seconds: checks that the "
        "tooling runs (make test); the figures mean nothing and are not merged into earlier ones",
    )
    args = parser.parse_args(argv)
    names = args.only.split(",")
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {', '.join(BENCHES)}")
    out = Path(args.output or ("runs/bench-perf-smoke.json" if args.smoke else "runs/bench-perf.json"))
    figures: dict[str, float] = json.loads(out.read_text()) if out.is_file() and not args.smoke else {}
    with tempfile.TemporaryDirectory(prefix="specctl-perf-smoke-") as smoke:
        start = time.perf_counter()
        kwargs = smoke_arguments(Path(smoke), names) if args.smoke else {}
        if args.smoke:
            print(f"smoke inputs: made in {time.perf_counter() - start:.0f} s")
        for name in names:
            with tempfile.TemporaryDirectory(prefix=f"specctl-perf-{name}-") as tmp:
                start = time.perf_counter()
                figures.update(BENCHES[name](Path(tmp), **kwargs.get(name, {})))
                print(f"{name}: done in {time.perf_counter() - start:.0f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(json.dumps(figures, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
