"""`make gpu-check`: one prepared command that measures every drafter on a CUDA GPU.

GPU time is scarce and comes in short leases, so everything a GPU session should measure is
in this one command: each algorithm trained for a fixed number of steps at its published
Llama-3.1-8B size on synthetic features (positions/s, peak memory, MFU), then the embedded
engine on a small random Llama verifier with a random drafter of each algorithm (tokens/s
against plain decoding). The plan's pieces and one padded HF collect batch run with the math
attention kernel disabled: a call that no fused kernel takes fails its row instead of quietly
costing float32 scores. A failure or an out-of-memory in one algorithm is reported in its
row and the others still run; an out-of-memory retries at half the sequence length.

Without CUDA (or with --dry-run) the same code runs with tiny shapes, 2 steps each, in fp32
on the CPU, so CI exercises every line that the GPU run depends on.

Needs torch, transformers, pyyaml, rich and pydantic (the drafters' configs are pydantic
models); datasets and gguf are not needed. The device machine of this workplace lacks
pydantic: carry it as wheels (docs/performance.md, "Running gpu-check on the device machine").

Usage: python -m benchmarks.gpu_check [--output runs/gpu-check.json] [--dry-run] [--algos dflash,...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

import specctl
from benchmarks import perf
from benchmarks.perf import measure_train_step, synthetic_batch
from specctl.durable import write_atomic
from specctl.errors import first_line

if TYPE_CHECKING:
    from specctl.drafters import VerifierSpec, VerifierWeights


def registered_algos() -> tuple[str, ...]:
    """Every registered algorithm (imported on use: the drafters need pydantic, checked first)."""
    from specctl.drafters import DRAFTERS

    return tuple(DRAFTERS)


RECIPES = Path(specctl.__file__).parent / "recipes"  # the shipped recipes (no pydantic needed to find them)
H200_PEAK_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H200 (SXM), no sparsity
MFU_FORMULA = (
    "mfu = 6 * trainable_params * positions_per_s / peak_flops "
    "(positions = draft predictions scored per step, a proxy for the rows the drafter's layers "
    "process; 6 = 2 forward + 4 backward FLOPs per parameter per row; attention and the frozen "
    "verifier LM head are not in it). mfu_counted = counted_flops_per_step / step_s / peak_flops "
    "(torch.utils.flop_counter over one forward+backward: every matmul and attention op as executed)."
)


def llama_31_8b() -> dict[str, Any]:
    """Llama-3.1-8B-Instruct's geometry, the verifier every *-llama.yaml recipe trains against: its
    published config (specctl.model_configs) as a VerifierSpec's fields, with EAGLE-3's default aux
    layers (2, L//2, L-3)."""
    from specctl.model_configs import published_config
    from specctl.verifier import default_aux_layer_ids, spec_from_config

    name = "meta-llama/Llama-3.1-8B-Instruct"
    config = published_config(name)
    spec = spec_from_config(config, name, default_aux_layer_ids(config.num_hidden_layers), 0)
    fields = asdict(spec)
    fields.pop("mask_token_id")
    return fields


# The dry run's stand-in: same code paths, shapes small enough for 2 CPU cores.
TINY_VERIFIER: dict[str, Any] = {
    "name_or_path": "tiny-random-llama",
    "architectures": ("LlamaForCausalLM",),
    "hidden_size": 64,
    "vocab_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 4096,
    "aux_layer_ids": (1, 2, 3),
    "rope_scaling": None,
}


@dataclass(frozen=True)
class EngineShape:
    """The random Llama verifier the engine decodes with (a real 8B would not fit the time budget)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    prompt_len: int
    max_new_tokens: int
    repeats: int  # best of this many generations per method: a one-off stall must not pick the winner


@dataclass(frozen=True)
class Plan:
    """Everything one gpu-check run measures, and at what size."""

    device: torch.device
    dtype: torch.dtype
    verifier: dict[str, Any]
    seq_len: int
    min_seq_len: int  # an out-of-memory halves the sequence down to this length, then gives up
    batch_size: int
    warmup: int
    steps: int
    engine: EngineShape
    algos: tuple[str, ...] = ()  # the registered algorithms by default (main)
    drafter_overrides: dict[str, Any] = field(default_factory=dict)  # dry run: fewer layers/anchors
    max_draft_vocab: int | None = None  # dry run: the recipe's 32000 does not fit a 512 vocabulary
    compile: bool = False
    peak_tflops: float | None = None


def gpu_plan(args: argparse.Namespace) -> Plan:
    return Plan(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        verifier=llama_31_8b(),
        seq_len=args.seq_len or 4096,  # the llama recipes' data.max_length
        min_seq_len=1024,
        batch_size=args.batch_size or 1,
        warmup=args.warmup if args.warmup is not None else 2,
        steps=args.steps or 8,
        engine=EngineShape(1024, 8, 16, 8, 2816, 32000, prompt_len=128, max_new_tokens=256, repeats=2),
        algos=args.algos,
        compile=args.compile,
        peak_tflops=args.peak_tflops,
    )


def dry_plan(args: argparse.Namespace) -> Plan:
    return Plan(
        device=torch.device("cpu"),
        dtype=torch.float32,
        verifier=TINY_VERIFIER,
        seq_len=args.seq_len or 96,
        min_seq_len=32,
        batch_size=args.batch_size or 1,
        warmup=args.warmup if args.warmup is not None else 0,
        steps=args.steps or 2,
        engine=EngineShape(64, 4, 4, 2, 128, 512, prompt_len=12, max_new_tokens=16, repeats=1),
        algos=args.algos,
        drafter_overrides={"num_layers": 1, "max_anchors": 16},
        max_draft_vocab=256,
        compile=args.compile,
        peak_tflops=None,
    )


# ---------------------------------------------------------------- drafter settings


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def recipe_tree(path: Path) -> dict[str, Any]:
    """A recipe file merged over the files it `extends`, as a plain tree.

    Read with yaml, not `specctl.recipe`, so the published drafter sizes come from the
    shipped recipes themselves and this module does not load the whole recipe schema.
    """
    tree = yaml.safe_load(path.read_text()) or {}
    parent = tree.pop("extends", None)
    return _merge(recipe_tree(path.parent / parent), tree) if parent else tree


def llama_recipe(algo: str) -> dict[str, Any]:
    return recipe_tree(RECIPES / f"{algo}-llama.yaml")


def drafter_setup(algo: str, plan: Plan) -> tuple[dict[str, Any], int | None, str, int]:
    """(config fields, draft vocab size or None, loss, mask token id) for `algo` at the plan's size."""
    tree = llama_recipe(algo)
    drafter = tree.get("drafter", {})
    fields = dict(drafter.get(algo) or {})
    from specctl.drafters import DRAFTERS

    known = DRAFTERS[algo].config_cls.model_fields
    fields.update({k: v for k, v in plan.drafter_overrides.items() if k in known})
    draft_vocab = drafter.get("draft_vocab_size")
    if draft_vocab is not None and plan.max_draft_vocab is not None:
        draft_vocab = min(draft_vocab, plan.max_draft_vocab)
    mask = drafter.get("mask_token_id")
    vocab = plan.verifier["vocab_size"]
    mask = mask if mask is not None and mask < vocab else vocab - 1
    from specctl.recipe import TrainSection

    loss = (tree.get("train") or {}).get("loss", TrainSection.model_fields["loss"].default)
    return fields, draft_vocab, loss, mask


def verifier_spec(geometry: dict[str, Any], mask_token_id: int) -> VerifierSpec:
    from specctl.drafters import VerifierSpec

    return VerifierSpec(**geometry, mask_token_id=mask_token_id)


def random_weights(spec: VerifierSpec, device: torch.device, dtype: torch.dtype) -> VerifierWeights:
    """Frozen verifier tensors drafters borrow; random, made on the device (2 GiB at 8B size)."""
    from specctl.drafters import VerifierWeights

    g = torch.Generator(device=device).manual_seed(0)
    shape = (spec.vocab_size, spec.hidden_size)
    return VerifierWeights(
        embed_tokens=torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02,
        lm_head=torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02,
        norm=torch.ones(spec.hidden_size, device=device, dtype=dtype),
    )


def build_drafter(algo: str, plan: Plan, spec: VerifierSpec, weights: VerifierWeights) -> torch.nn.Module:
    """The drafter at the plan's size, parameters in fp32 on the CPU (train.py's layout: fp32
    master weights, bf16 autocast on CUDA); the verifier tensors stay where `weights` are."""
    from specctl.drafters import DRAFTERS

    fields, draft_vocab, loss, _ = drafter_setup(algo, plan)
    d2t = None if draft_vocab is None else torch.zeros(draft_vocab, dtype=torch.long)  # ids 0..Vd-1
    torch.manual_seed(0)
    return DRAFTERS[algo].build(DRAFTERS[algo].config_cls(**fields), spec, weights, d2t, loss)


# ---------------------------------------------------------------- training


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def counted_flops(drafter: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """FLOPs of one forward + backward as executed (matmuls and attention), by torch's counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        with _autocast(device):
            loss, _ = drafter(batch)
        loss.backward()
    drafter.zero_grad(set_to_none=True)
    _sync(device)
    return float(counter.get_total_flops())


def train_one(
    algo: str, plan: Plan, spec: VerifierSpec, weights: VerifierWeights, seq_len: int
) -> dict[str, Any]:
    """Train `algo` for the plan's steps at `seq_len`; raises on out-of-memory (the caller retries)."""
    drafter = build_drafter(algo, plan, spec, weights)
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    batch = synthetic_batch(spec, plan.batch_size, seq_len, torch.Generator().manual_seed(0))
    batch = {k: v.to(plan.device) for k, v in batch.items()}
    module = torch.compile(drafter) if plan.compile else drafter
    m = measure_train_step(module, batch, plan.steps, plan.device, warmup=plan.warmup)
    row: dict[str, Any] = {
        "status": "ok",
        "seq_len": seq_len,
        "batch_size": plan.batch_size,
        "steps": plan.steps,
        "trainable_params": trainable,
        "positions_per_step": m["positions_per_s"] * m["step_s"],
        "positions_per_s": m["positions_per_s"],
        "tokens_per_s": m["tokens_per_s"],
        "step_s": m["step_s"],
        "peak_mem_above_start_gib": m["peak_mem_mb"] / 1024,
    }
    if plan.device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(plan.device) / 2**30
    try:
        row["counted_flops_per_step"] = counted_flops(drafter, batch, plan.device)
    except torch.cuda.OutOfMemoryError:
        row["counted_flops_per_step"] = None  # the figures above stand; only the count is missing
    except Exception as e:  # the counter is an extra; never lose the measured row over it
        row["counted_flops_per_step"] = None
        row["flop_count_error"] = f"{type(e).__name__}: {e}"
    flops = row["counted_flops_per_step"]
    row["counted_tflops_per_s"] = None if flops is None else flops / m["step_s"] / 1e12
    if plan.peak_tflops:
        peak = plan.peak_tflops * 1e12
        row["mfu"] = 6 * trainable * m["positions_per_s"] / peak
        row["mfu_counted"] = None if flops is None else flops / m["step_s"] / peak
    return row


def train_check(plan: Plan, log: Any) -> dict[str, Any]:
    """Every algorithm of the plan; an out-of-memory halves the sequence length and retries."""
    mask = drafter_setup(plan.algos[0], plan)[3] if plan.algos else 0
    spec = verifier_spec(plan.verifier, mask)
    weights = random_weights(spec, plan.device, plan.dtype)
    rows: dict[str, Any] = {}
    for algo in plan.algos:
        seq_len, oom_at = plan.seq_len, []
        start = time.perf_counter()
        while True:
            try:
                row = train_one(algo, plan, spec, weights, seq_len)
            except torch.cuda.OutOfMemoryError as e:
                oom_at.append(seq_len)
                row = {"status": "oom", "error": first_line(e)}
            except Exception as e:  # one algorithm's bug must not hide the others' figures
                row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
            _free(plan.device)
            if row["status"] != "oom" or seq_len // 2 < plan.min_seq_len:
                break
            seq_len //= 2
        row["oom_seq_lens"] = oom_at
        row["wall_s"] = time.perf_counter() - start
        rows[algo] = row
        log(f"train {algo}: {row['status']} in {row['wall_s']:.0f} s")
    del weights
    _free(plan.device)
    return rows


# ---------------------------------------------------------------- the plan, checked


# The dry run's shrink of each shipped recipe: the same code path at CPU size.
DRY_RECIPE = [
    "data.max_length=64",
    "train.batch_tokens=128",
    "train.micro_batch_tokens=128",
    "drafter.draft_vocab_size=null",
    "train.precision=float32",  # the dry run computes in float32 (_autocast), weights float32 too
    "verifier.dtype=float32",
]
DRY_DRAFTER = {"num_layers": 1, "max_anchors": 8}


def plan_check(plan: Plan, log: Any) -> dict[str, Any]:
    """Each algorithm's shipped Llama recipe at its real per-rank piece (train.micro_batch_tokens of
    data.max_length sequences, its drafter, its feature layout, activation checkpointing as it says):
    `specctl plan`'s traced peak against the peak measured running that piece (CUDA:
    max_memory_allocated, the same live bytes the trace counts; dry run: live bytes of the real
    tensors), with tokens/s and MFU from the traced FLOPs."""
    rows: dict[str, Any] = {}
    for algo in plan.algos:
        start = time.perf_counter()
        try:
            rows[algo] = plan_piece(algo, plan)
        except torch.cuda.OutOfMemoryError as e:
            rows[algo] = {"status": "oom", "error": first_line(e)}
        except Exception as e:  # one algorithm's failure must not hide the others' figures
            rows[algo] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
        _free(plan.device)
        rows[algo]["wall_s"] = time.perf_counter() - start
        log(f"plan {algo}: {rows[algo]['status']} in {rows[algo]['wall_s']:.0f} s")
    return rows


@contextlib.contextmanager
def fused_attention_only(device: torch.device):
    """Attention without the math kernel: on CUDA torch's own switch (a call no fused kernel takes
    raises "No available kernel" instead of materialising float32 scores); in the dry run the
    calls take their CUDA form and CUDA's kernel rules check each (specctl.attention_kernels)."""
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        ):
            yield
        return
    from specctl.attention_kernels import FusedAttentionGuard, cuda_attention_form

    with cuda_attention_form(), FusedAttentionGuard():
        yield


def collect_kernel_check(plan: Plan, log: Any) -> dict[str, Any]:
    """One HF collect batch with the math kernel disabled: a random verifier of the train verifier's
    heads and head dim (2 layers), two sequences, one padded, through the attention collect uses
    (`use_gqa_sdpa`) and `capture_hidden_states` -- the padding mask with grouped-query heads is
    the call that fell to the math kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specctl.verifier import capture_hidden_states, use_gqa_sdpa

    g = plan.verifier
    start = time.perf_counter()
    config = LlamaConfig(
        **{
            k: g[k]
            for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
            if k in g
        },
        num_hidden_layers=2,
        intermediate_size=g.get("intermediate_size", 4 * g["hidden_size"]) // 4,
        vocab_size=min(g.get("vocab_size", 32000), 32000),
        attn_implementation="sdpa",
    )
    try:
        model = LlamaForCausalLM(config).to(plan.device, plan.dtype).eval()
        use_gqa_sdpa(model)
        T = min(plan.seq_len, 1024)
        ids = torch.randint(0, config.vocab_size, (2, T), device=plan.device)
        mask = torch.ones(2, T, dtype=torch.long, device=plan.device)
        mask[1, T // 2 :] = 0  # the second sequence is padded
        with fused_attention_only(plan.device), torch.no_grad():
            capture_hidden_states(model, ids, mask, (0, 1))
        row = {
            "status": "ok",
            "sequences": 2,
            "seq_len": T,
            "attention": "fused kernels only (math disabled)",
        }
    except Exception as e:
        row = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
    row["wall_s"] = time.perf_counter() - start
    log(f"collect attention: {row['status']}")
    return row


def _recipe_and_spec(algo: str, plan: Plan) -> tuple[Any, Any]:
    from specctl import resources
    from specctl.recipe import load_recipe

    dry = plan.device.type != "cuda"
    overrides = list(DRY_RECIPE) if dry else []
    if dry:
        from specctl.drafters import DRAFTERS

        known = DRAFTERS[algo].config_cls.model_fields
        overrides += [f"drafter.{algo}.{k}={v}" for k, v in DRY_DRAFTER.items() if k in known]
    recipe = load_recipe(str(RECIPES / f"{algo}-llama.yaml"), overrides).for_training()
    if not dry:
        return recipe, resources.inputs(recipe, resources.Cluster("cuda", 1, 1)).spec
    return recipe, verifier_spec(plan.verifier, plan.verifier["vocab_size"] - 1)


def plan_piece(algo: str, plan: Plan) -> dict[str, Any]:
    from specctl import distributed, resources
    from specctl.drafters import DRAFTERS
    from specctl.memtrace import MemoryTrace
    from specctl.optim import build_optimizer, vocab_sizes

    recipe, spec = _recipe_and_spec(algo, plan)
    micro = resources.micro_tokens(recipe)
    st = resources.trace_train_step(recipe, spec, micro, plan.device.type)
    d2t = resources.draft_offsets(recipe)
    cfg = recipe.train
    measure = MemoryTrace() if plan.device.type != "cuda" else contextlib.nullcontext()
    baseline = perf._reset_peak_memory(plan.device)
    with measure:
        weights = random_weights(spec, plan.device, plan.dtype)
        torch.manual_seed(0)
        drafter = DRAFTERS[algo].build(getattr(recipe.drafter, algo), spec, weights, d2t, cfg.loss)
        drafter = drafter.to(plan.device).train()
        if cfg.activation_checkpointing:
            distributed.checkpoint_layers(drafter)
        optimizer = build_optimizer(drafter, cfg, vocab_sizes(spec.vocab_size, d2t))
        batch = resources.synthetic_batch(recipe, spec, st.sequences, st.length, device=plan.device)

        def step() -> None:
            with fused_attention_only(plan.device), _autocast(plan.device):
                loss, _ = drafter(batch)
                loss.backward()  # checkpointed layers recompute their attention here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(max(1, plan.warmup)):  # the optimizer state exists from the first step on
            step()
        _sync(plan.device)
        began = time.perf_counter()
        for _ in range(plan.steps):
            step()
        _sync(plan.device)
        step_s = (time.perf_counter() - began) / plan.steps
    if plan.device.type == "cuda":
        measured = int(perf._peak_memory_mb(plan.device, baseline) * 2**20)
    else:
        measured = measure.peak
    row = {
        "status": "ok",
        "recipe": f"{algo}-llama.yaml",
        "sequences": st.sequences,
        "seq_len": st.length,
        "micro_batch_tokens": micro,
        "activation_checkpointing": cfg.activation_checkpointing,
        "predicted_peak_bytes": st.peak,
        "measured_peak_bytes": measured,
        "measured_over_predicted": measured / st.peak,
        "step_s": step_s,
        "tokens_per_s": st.sequences * st.length / step_s,
        "traced_flops_per_step": st.flops,
        "attention": "fused kernels only (math disabled)",
    }
    if plan.peak_tflops:
        row["mfu_traced"] = st.flops / step_s / (plan.peak_tflops * 1e12)
    return row


# ---------------------------------------------------------------- engine


def engine_check(plan: Plan, log: Any) -> dict[str, Any]:
    """Tokens/s of the embedded engine: plain decoding, then each drafter (random weights, so
    nearly nothing is accepted: this measures the cost of drafting and verifying, not a speedup)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specctl.drafters import VerifierWeights
    from specctl.engine import generate
    from specctl.verifier import spec_from_config

    e = plan.engine
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=e.vocab_size,
        hidden_size=e.hidden_size,
        intermediate_size=e.intermediate_size,
        num_hidden_layers=e.num_layers,
        num_attention_heads=e.num_heads,
        num_key_value_heads=e.num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(device=plan.device, dtype=plan.dtype).eval()
    L = e.num_layers
    spec = spec_from_config(model.config, "tiny-random-llama", (1, L // 2, L - 1), e.vocab_size - 1)
    weights = VerifierWeights(
        embed_tokens=model.get_input_embeddings().weight.detach(),
        lm_head=model.get_output_embeddings().weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    prompt = torch.randint(0, e.vocab_size, (e.prompt_len,), generator=torch.Generator().manual_seed(0))

    def run(drafter: torch.nn.Module | None) -> dict[str, Any]:
        generate(model, drafter, prompt[:8], 4)  # warm-up: kernels, cuBLAS handles, caches
        runs = [generate(model, drafter, prompt, e.max_new_tokens) for _ in range(e.repeats)]
        result = max(runs, key=lambda r: r.tokens_per_s)
        return {
            "status": "ok",
            "tokens": len(result.tokens),
            "tokens_per_s": result.tokens_per_s,
            "wall_s": result.wall_s,
            "acceptance_length": result.counters.acceptance_length,
        }

    out: dict[str, Any] = {"verifier": asdict(e), "no_spec": run(None)}
    base = out["no_spec"]["tokens_per_s"]
    log(f"engine no-spec: {base:.1f} tokens/s")
    engine_plan = replace(plan, verifier={**plan.verifier, "vocab_size": e.vocab_size})
    for algo in plan.algos:
        try:
            drafter = build_drafter(algo, engine_plan, spec, weights)
            drafter = drafter.to(device=plan.device, dtype=plan.dtype).eval()
            row = run(drafter)
            row["ratio_vs_no_spec"] = row["tokens_per_s"] / base if base else None
        except torch.cuda.OutOfMemoryError as err:
            row = {"status": "oom", "error": first_line(err)}
        except Exception as err:  # report and go on to the next drafter
            row = {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
        drafter = None
        _free(plan.device)
        out[algo] = row
        log(f"engine {algo}: {row['status']} {row.get('tokens_per_s', 0):.1f} tokens/s")
    return out


# ---------------------------------------------------------------- report


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=140)  # logs: no wrapped columns
    train = Table(title=f"gpu-check training ({report['device_name']}, {report['dtype']})")
    for col in ("algo", "status", "seq x batch", "positions/s", "tokens/s", "step ms", "peak GiB"):
        train.add_column(col)
    for col in ("params M", "MFU", "MFU counted"):
        train.add_column(col)
    for algo, r in report["train"].items():
        if r["status"] != "ok":
            train.add_row(algo, r["status"], r.get("error", "")[:80], *[""] * 7)
            continue
        peak = r.get("peak_mem_gib", r["peak_mem_above_start_gib"])
        train.add_row(
            algo,
            "ok" + (f" (oom at {r['oom_seq_lens']})" if r["oom_seq_lens"] else ""),
            f"{r['seq_len']} x {r['batch_size']}",
            f"{r['positions_per_s']:.0f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['step_s'] * 1e3:.1f}",
            f"{peak:.2f}",
            f"{r['trainable_params'] / 1e6:.1f}",
            _fmt(r.get("mfu"), ".1%"),
            _fmt(r.get("mfu_counted"), ".1%"),
        )
    console.print(train)
    checked = Table(title="gpu-check: each recipe's per-rank piece, `specctl plan` against measured")
    for col in ("algo", "status", "piece", "predicted GiB", "measured GiB", "ratio", "tokens/s", "MFU"):
        checked.add_column(col)
    for algo, r in report.get("plan", {}).items():
        if r["status"] != "ok":
            checked.add_row(algo, r["status"], r.get("error", "")[:80], *[""] * 5)
            continue
        checked.add_row(
            algo,
            "ok",
            f"{r['sequences']} x {r['seq_len']}" + (" ckpt" if r["activation_checkpointing"] else ""),
            f"{r['predicted_peak_bytes'] / 2**30:.2f}",
            f"{r['measured_peak_bytes'] / 2**30:.2f}",
            f"{r['measured_over_predicted']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            _fmt(r.get("mfu_traced"), ".1%"),
        )
    console.print(checked)
    if not report["engine"]:
        console.print(report["mfu_formula"])
        return
    engine = Table(title="gpu-check embedded engine (random tiny Llama verifier, random drafters)")
    for col in ("drafter", "status", "tokens/s", "vs no-spec", "tau"):
        engine.add_column(col)
    for name, r in report["engine"].items():
        if name == "verifier":
            continue
        if r["status"] != "ok":
            engine.add_row(name, r["status"], r.get("error", "")[:60], "", "")
            continue
        engine.add_row(
            name,
            "ok",
            f"{r['tokens_per_s']:.1f}",
            _fmt(r.get("ratio_vs_no_spec"), ".2f"),
            f"{r['acceptance_length']:.2f}",
        )
    console.print(engine)
    console.print(report["mfu_formula"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/gpu-check.json")
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)"
    )
    parser.add_argument(
        "--algos", default="", help="comma-separated algorithm names (default: every registered one)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (GPU: 4096)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (GPU: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per algorithm (GPU: 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (GPU: 2)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each drafter (off by default)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=H200_PEAK_BF16_TFLOPS, help="MFU denominator")
    args = parser.parse_args(argv)
    try:
        import pydantic  # noqa: F401  (the drafters' configs are pydantic models)
    except ImportError:
        print(
            "gpu-check: the drafters need pydantic, which this Python lacks: pip install 'pydantic>=2.6' "
            "(device machine: carry the wheels, see docs/performance.md)",
            file=sys.stderr,
        )
        return 2
    known = registered_algos()
    args.algos = tuple(a for a in args.algos.split(",") if a) or known
    unknown = [a for a in args.algos if a not in known]
    if unknown:
        print(f"gpu-check: unknown algorithm(s) {unknown}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    dry = args.dry_run or not torch.cuda.is_available()
    if dry:  # tiny ops: one intra-op thread beats two that spin on a shared 2-core machine
        torch.set_num_threads(1)
    plan = dry_plan(args) if dry else gpu_plan(args)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {msg}", flush=True)

    log(f"{'dry run, CPU fp32' if dry else 'CUDA bf16'}: {', '.join(plan.algos)}")
    report: dict[str, Any] = {
        "dry_run": dry,
        "device_name": torch.cuda.get_device_name(plan.device) if not dry else "cpu",
        "dtype": str(plan.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "peak_tflops": plan.peak_tflops,
        "mfu_formula": MFU_FORMULA,
        "train_verifier": {k: v for k, v in plan.verifier.items() if k != "architectures"},
        "train": train_check(plan, log),
        "plan": plan_check(plan, log),
        "collect_attention": collect_kernel_check(plan, log),
        "engine": {},
        "output": args.output,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["wall_s"] = time.perf_counter() - start
    write_atomic(out, json.dumps(report, indent=1) + "\n")  # the training figures survive an engine crash
    if not args.skip_engine:
        try:
            report["engine"] = engine_check(plan, log)
        except Exception as e:  # e.g. the verifier itself failed: keep the report, say why
            report["engine"] = {"no_spec": {"status": "error", "error": f"{type(e).__name__}: {e}"[:500]}}
        report["wall_s"] = time.perf_counter() - start
        write_atomic(out, json.dumps(report, indent=1) + "\n")
    print_report(report)
    print(f"total {report['wall_s']:.0f} s; JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
