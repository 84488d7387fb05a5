"""The resource plan behind `specctl plan`: per stage, peak memory per device, disk, tokens, time.

A 3-day job should fail in its first second, not at step 1 after hours of collection. For each
stage the plan adds named terms, each with how it was obtained:

- what is exact by counting: verifier and drafter weights (modules built on the meta device),
  the feature store's bytes per token (features.layout_bytes_per_token), checkpoint sizes;
- what depends on code paths too intricate to model by hand -- a drafter's training step
  (anchors, blocks, its loss over the vocabulary, optimizer state), the verifier's feature forward
  -- is *traced*: the stage's own code runs at the recipe's real shapes with fake heavy tensors
  (specctl.memtrace), and its live-bytes peak and FLOPs are read off. The trace runs the worst
  micro-batch the recipe allows: sequences of data.max_length, every token a loss token;
- what the trace cannot see is a named, stated assumption (CUDA context and NCCL buffers, the
  caching allocator's fragmentation, vLLM's preallocation, throughput per GPU).

`make rehearse` checks the traced figures against peaks measured on this CPU at real width
(docs/performance.md). Every stage checks its own plan when it starts (`check_stage`) and refuses
with one line and the numbers when it does not fit; `--force` overrides.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specctl.devices import launcher_local_rank, local_device
from specctl.errors import SpecctlError, UsageError
from specctl.recipe import VLLM_BACKENDS

GIB = 1 << 30
# Assumptions that no trace sees, each printed with the plan it enters.
CUDA_RESERVE = 2 * GIB  # CUDA context, cuBLAS workspaces, NCCL buffers per process
FRAGMENTATION = 0.10  # the CUDA caching allocator's blocks beyond the live bytes it holds
VLLM_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU it preallocates
DECODE_TOKENS_PER_S_8B = 2500.0  # vLLM output tokens/s per 8B-sized engine at batch 256 (H100-class)


class PlanError(SpecctlError):
    """A stage will not fit (one line: the stage, its numbers, what to change; --force overrides)."""


@dataclass(frozen=True)
class Cluster:
    """Where a recipe will run: `gpus` devices per node, each with `memory` bytes."""

    device: str  # "cuda" or "cpu" (cpu: one device per node, the host's memory)
    gpus: int
    memory: int
    nodes: int = 1
    disk: int | None = None  # bytes free for the run directory, None = not checked
    tflops: float = 989.0  # dense bf16 peak of one device (H100 SXM)
    mfu: float = 0.35  # the share of it a training step reaches

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


def this_machine(path: Path | None = None, device: str = "auto", span: int = 1) -> Cluster:
    """The machine a stage starts on: its visible GPUs, each with the memory of this process's own
    (`own_gpu`), else its host memory; the free disk where `path` lives.

    Only this process's GPU is asked, and without a CUDA context: every torchrun rank of train and
    collect plans, and `mem_get_info(i)` makes a context on GPU i that stays for the process's life
    (about 500 MB), so ranks asking every GPU left 7 foreign contexts (~3.5 GB) on each GPU of an
    8-GPU node. `get_device_properties` reads the total memory without one; a node's GPUs are
    assumed alike (what the plan assumes of every node anyway)."""
    from specctl.estimate import free_bytes

    disk = free_bytes(path) if path is not None else None
    nodes = max(
        1, int(os.environ.get("WORLD_SIZE", "1")) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    )
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(own_gpu(device, span, count)).total_memory
        return Cluster("cuda", count, memory, nodes, disk)
    return Cluster("cpu", 1, host_memory(), 1, disk, tflops=1.0, mfu=0.5)


def own_gpu(device: str, span: int, count: int) -> int:
    """The first GPU this process runs on (`devices.local_device`: LOCAL_RANK's group under
    torchrun, the recipe's `cuda:N` outside it), else the current GPU; asks no GPU anything."""
    own = local_device(device, launcher_local_rank(), count, span)
    if own.type == "cuda" and own.index is not None:
        return own.index
    return torch.cuda.current_device()


def host_memory() -> int:
    """Total memory of this host (bytes), from /proc/meminfo; os.sysconf elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Term:
    """One named part of a stage's peak: its bytes per device and how they were obtained."""

    what: str
    bytes: int
    how: str


@dataclass
class StagePlan:
    """One stage on one device: the terms of its peak, against the device's capacity."""

    stage: str
    terms: list[Term]
    capacity: int  # bytes per device (0: the stage uses no device memory)
    disk: int  # bytes this stage adds to the run directory
    tokens: int
    seconds: float | None
    assumptions: list[str] = field(default_factory=list)
    fix: str = ""  # what to change when it does not fit

    @property
    def peak(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool:
        return self.capacity == 0 or self.peak <= self.capacity


@dataclass
class Plan:
    recipe: str
    cluster: Cluster
    stages: list[StagePlan]

    def failures(self) -> list[StagePlan]:
        return [s for s in self.stages if not s.fits]

    def disk_total(self) -> int:
        return sum(s.disk for s in self.stages)

    def to_json(self) -> dict[str, Any]:
        stages = []
        for s in self.stages:
            entry = asdict(s)
            entry.update(peak_bytes=s.peak, fits=s.fits)
            stages.append(entry)
        fits = not self.failures() and (self.cluster.disk is None or self.disk_total() <= self.cluster.disk)
        return {
            "recipe": self.recipe,
            "cluster": asdict(self.cluster),
            "stages": stages,
            "disk_bytes": self.disk_total(),
            "fits": fits,
        }


def refusal(plan: Plan) -> str | None:
    """The one-line reason the plan does not fit (the first stage that does not), or None."""
    from specctl.estimate import si_bytes

    for s in plan.failures():
        return (
            f"{s.stage} does not fit: {gib(s.peak)} per {plan.cluster.device} device against "
            f"{gib(s.capacity)} ({plan.cluster.nodes} x {plan.cluster.gpus}); {s.fix}"
        )
    disk = plan.cluster.disk
    if disk is not None and plan.disk_total() > disk:
        return (
            f"the run needs {si_bytes(plan.disk_total())} of disk but {si_bytes(disk)} is free; "
            "store compact features (features.aux_dtype=fp8, features.target=topk) or fewer samples"
        )
    return None


def gib(n: float) -> str:
    """Bytes in GiB, the unit GPU memory is sold and set in (--gpu-memory)."""
    return f"{n / GIB:,.1f} GiB"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def verifier_config(section: Any) -> Any:
    """The verifier's transformers config: the published one for a listed hub id (no download),
    else from its directory, the built-in alias or the hub cache."""
    from specctl.model_configs import published_config

    config = published_config(section.name_or_path)
    if config is not None:
        return config
    from transformers import AutoConfig

    from specctl.verifier import locate_verifier

    source, _ = locate_verifier(section.name_or_path, section.revision)
    try:
        return AutoConfig.from_pretrained(source, revision=section.revision)
    except (OSError, ValueError) as e:
        raise UsageError(
            f"verifier {section.name_or_path!r}: no config to plan from ({str(e).splitlines()[0][:120]}); "
            "pass a local HF directory as verifier.name_or_path"
        ) from None


DENSE_DECODERS = ("llama", "qwen3", "qwen2", "mistral")  # the architectures `count_parameters` sums by hand


def count_parameters(config: Any) -> int:
    """Parameters of the verifier `config` describes. A dense Llama-style decoder is summed from its
    shapes (embeddings, attention with its biases and Qwen3's q/k norms, gated MLP, norms, LM head
    unless tied): training's check must not build the verifier, not even on the meta device. Other
    architectures (mixtures of experts...) are built on the meta device and counted."""
    if getattr(config, "model_type", None) not in DENSE_DECODERS:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())
    H, V, inter = config.hidden_size, config.vocab_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or H // heads
    attention = H * heads * d + 2 * H * kv * d + heads * d * H
    if config.model_type == "qwen2":
        attention += heads * d + 2 * kv * d  # q, k, v biases
    elif getattr(config, "attention_bias", False):
        attention += heads * d + 2 * kv * d + H  # q, k, v and o biases
    if config.model_type == "qwen3":
        attention += 2 * d  # q_norm, k_norm
    layer = attention + 3 * H * inter + 2 * H
    head = 0 if getattr(config, "tie_word_embeddings", False) else V * H
    return V * H + config.num_hidden_layers * layer + H + head


# ---------------------------------------------------------------- traced stages


@dataclass(frozen=True)
class StepTrace:
    """A training step traced at real shapes (bytes on one rank; FLOPs of one piece's fwd+bwd)."""

    weights: int  # drafter parameters and the verifier tensors it borrows, as built
    batch: int  # one piece's batch as the drafter reads it
    optimizer: int  # optimizer state after a step
    grads: int  # gradients after a backward
    params: int  # the drafter's own parameters (what FSDP2 shards), as built
    peak: int  # the largest live bytes of a steady-state step (the second), everything included
    flops: int
    trainable: int  # trainable parameters (numel)
    sequences: int  # sequences in the traced piece
    length: int  # their length
    accumulated: bool = False  # the traced piece ran with the previous piece's gradients alive


def synthetic_batch(
    recipe: Any, spec: Any, sequences: int, length: int, heavy: Any = None, device: Any = "cpu"
) -> dict[str, Any]:
    """The worst piece the recipe allows, as the drafter contract reads it: `sequences` rows of
    `length` tokens, every token real and a loss token but the first. Features are random (made
    under `heavy`: fake in a trace), in the recipe's target layout; ids and masks are real."""
    B, T, H, V = sequences, length, spec.hidden_size, spec.vocab_size
    k = min(recipe.features.topk, V)
    g = torch.Generator().manual_seed(0)
    batch: dict[str, Any] = {
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": torch.ones(B, T, dtype=torch.bool),
        "attention_mask": torch.ones(B, T, dtype=torch.bool),
    }
    batch["loss_mask"][:, :1] = False  # the first token of a conversation is never scored
    if recipe.features.target == "topk":
        batch["topk_ids"] = torch.randint(0, V, (B, T, k), generator=g)
    batch = {key: value.to(device) for key, value in batch.items()}
    with heavy if heavy is not None else contextlib.nullcontext():
        batch["aux_hidden_states"] = torch.randn(B, T, len(spec.aux_layer_ids), H, device=device)
        if recipe.features.target == "topk":
            batch["topk_logprobs"] = -torch.rand(B, T, k, device=device).sort(-1).values.flip(-1) * 10
            batch["logsumexp"] = torch.randn(B, T, device=device)
        else:
            batch["last_hidden_state"] = torch.randn(B, T, H, device=device)
    return batch


def trace_train_step(
    recipe: Any, spec: Any, micro_tokens: int, device: str, accumulate: bool = False
) -> StepTrace:
    """Two optimizer steps of the recipe's drafter over its worst piece of `micro_tokens`, traced.

    The second step is the steady state: optimizer state exists through its forward and backward.
    `accumulate`: the recipe's step has more than one piece (pieces of a micro-batch, or
    train.grad_accum), so every piece but a step's first runs with the gradients of the ones before
    it alive; the first step's are then kept into the second (one more piece, not zeroed), which is
    traced that way. `device` "cuda" traces bf16 autocast (as train.precision auto does there) and
    attention in its CUDA form (K/V repeated to the query's heads where a mask needs the
    memory-efficient kernel: specctl.attention_kernels); on the CPU it follows train.precision as
    this machine resolves it.
    """
    from specctl.attention_kernels import cuda_attention_form
    from specctl.memtrace import MemoryTrace

    cfg = recipe.train
    length = min(recipe.data.max_length, cfg.batch_tokens)
    sequences = max(1, min(micro_tokens, cfg.batch_tokens) // length)
    with MemoryTrace() as t:
        drafter = build_traced_drafter(recipe, spec, t, device)
        optimizer = traced_optimizer(recipe, spec, drafter)
        built = t.mark().live
        batch = synthetic_batch(recipe, spec, sequences, length, t.heavy())
        with_batch = t.mark().live
        autocast = devices_autocast(cfg, device)
        # the backward too: checkpointed layers recompute their forward there
        with cuda_attention_form() if device == "cuda" else contextlib.nullcontext():
            for step in range(2):
                if step == 1:
                    before = t.mark()
                with autocast:
                    loss, _ = drafter(batch)
                loss.backward()
                grads = sum(p.grad.nbytes for p in drafter.parameters() if p.grad is not None)
                optimizer.step()
                if step == 1 or not accumulate:
                    optimizer.zero_grad(set_to_none=True)
        after = t.mark()
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return StepTrace(
        weights=built,
        batch=with_batch - built,
        optimizer=before.live - with_batch - (grads if accumulate else 0),
        grads=grads,
        params=sum(p.nbytes for p in drafter.parameters()),
        peak=after.peak,
        flops=(after.flops - before.flops),
        trainable=trainable,
        sequences=sequences,
        length=length,
        accumulated=accumulate,
    )


def build_traced_drafter(recipe: Any, spec: Any, t: Any, device: str) -> Any:
    """The recipe's drafter (its weights and the verifier tensors it borrows fake, made under the
    MemoryTrace `t`), layers checkpointed as train.activation_checkpointing says: what the loop
    builds, for `trace_train_step` and the FSDP2 trace (specctl.train.fsdptrace)."""
    from specctl import distributed
    from specctl.drafters import DRAFTERS
    from specctl.drafters.api import VerifierWeights

    cfg, algo = recipe.train, recipe.drafter.algo
    vdtype = _verifier_dtype(recipe, device)
    V, H = spec.vocab_size, spec.hidden_size
    d2t = draft_offsets(recipe)  # steers (gathers, checks): real
    with t.heavy():
        lm_head = torch.empty(V, H, dtype=vdtype)
        embed = lm_head if spec.tie_word_embeddings else torch.empty(V, H, dtype=vdtype)
        weights = VerifierWeights(embed, lm_head, torch.empty(H, dtype=vdtype))
        torch.manual_seed(cfg.seed)
        drafter = DRAFTERS[algo].build(getattr(recipe.drafter, algo), spec, weights, d2t, cfg.loss)
    if cfg.activation_checkpointing:
        distributed.checkpoint_layers(drafter)
    return drafter


def traced_optimizer(recipe: Any, spec: Any, drafter: Any) -> Any:
    """train.optimizer over `drafter`, as the loop builds it (after wrapping, under FSDP2)."""
    from specctl.optim import build_optimizer, vocab_sizes

    return build_optimizer(drafter, recipe.train, vocab_sizes(spec.vocab_size, draft_offsets(recipe)))


def devices_autocast(cfg: Any, device: str) -> Any:
    """The autocast a traced step runs under (on this machine's CPU): bf16 for a "cuda" plan unless
    train.precision is float32 (train.precision auto resolves to bf16 there), else what
    train.precision resolves to on this CPU."""
    from specctl import devices

    if device == "cuda":
        dtype = torch.float32 if cfg.precision == "float32" else torch.bfloat16
    else:
        dtype = devices.compute_dtype(torch.device("cpu"), cfg.precision)
    return devices.autocast(torch.device("cpu"), dtype)


def draft_offsets(recipe: Any) -> torch.Tensor | None:
    """A d2t table of drafter.draft_vocab_size entries (the first ids kept): the shapes of the one
    training builds from token frequencies (None: the full vocabulary)."""
    size = recipe.drafter.draft_vocab_size
    return None if size is None else torch.zeros(size, dtype=torch.long)


def _verifier_dtype(recipe: Any, device: str) -> torch.dtype:
    from specctl import devices

    return devices.resolve_dtype(recipe.verifier.dtype, torch.device(device))


@dataclass(frozen=True)
class ForwardTrace:
    """The collect forward of one batch of features.batch_tokens, traced on one device."""

    weights: int  # the verifier's weights as loaded (and the float32 LM head a top-k layout keeps)
    peak: int  # the largest live bytes, weights included
    flops: int
    sequences: int
    length: int


def trace_collect_forward(recipe: Any, config: Any, device: str) -> ForwardTrace:
    """The HF backend's feature forward (decoder, hooks, the layout's encoding: fp8, top-k over the
    vocabulary) over the worst batch: features.batch_tokens of data.max_length sequences."""
    from transformers import AutoModelForCausalLM

    from specctl.features import Layout, TargetHead, encode_features
    from specctl.memtrace import MemoryTrace
    from specctl.verifier import capture_hidden_states, check_aux_layer_ids, default_aux_layer_ids

    L = config.num_hidden_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    layout = Layout.from_section(recipe.features)
    length = min(recipe.data.max_length, recipe.features.batch_tokens)
    sequences = max(1, recipe.features.batch_tokens // length)
    with MemoryTrace() as t:
        with t.heavy():
            model = AutoModelForCausalLM.from_config(config, dtype=_verifier_dtype(recipe, device)).eval()
            head = None
            if layout.needs_head:
                w = model.get_output_embeddings().weight
                head = TargetHead(model.get_decoder().norm.weight.float(), w.float(), config.rms_norm_eps)
        built = t.mark().live
        ids = torch.randint(0, config.vocab_size, (sequences, length))
        mask = torch.ones(sequences, length, dtype=torch.long)
        aux, last = capture_hidden_states(model, ids, mask, aux_ids)
        with torch.inference_mode():
            encoded = encode_features(aux.flatten(0, 1), last.flatten(0, 1), layout, head)
        del encoded, aux, last
        point = t.mark()
    return ForwardTrace(built, point.peak, point.flops, sequences, length)


# ---------------------------------------------------------------- stages


@dataclass(frozen=True)
class Inputs:
    """What every stage's plan reads: the recipe, where it runs, and the verifier's shape."""

    recipe: Any
    cluster: Cluster
    config: Any  # the verifier's transformers config
    params: int  # the verifier's parameters
    spec: Any  # the VerifierSpec drafters are built from

    @property
    def tp(self) -> int:
        return self.recipe.verifier.tensor_parallel_size

    @property
    def cuda(self) -> bool:
        return self.cluster.device == "cuda"

    @property
    def vdtype_bytes(self) -> int:
        return _bytes_of(_verifier_dtype(self.recipe, self.cluster.device))

    def max_tokens(self) -> int:
        """Tokens of the data at most: every conversation at data.max_length."""
        samples = self.recipe.data.max_samples or _generated_count(self.recipe)
        return samples * self.recipe.data.max_length

    def overheads(self, traced: int) -> list[Term]:
        """What a CUDA process holds beyond the live tensors a trace counts."""
        if not self.cuda:
            return []
        return [
            Term(
                "allocator fragmentation",
                int(traced * FRAGMENTATION),
                f"assumed {FRAGMENTATION:.0%} of traced",
            ),
            Term("CUDA context, cuBLAS, NCCL", CUDA_RESERVE, "assumed per process"),
        ]


def _generated_count(recipe: Any) -> int:
    return recipe.data.generate.num_conversations


def _gpu_seconds(flops: float, cluster: Cluster, devices: int) -> float:
    return flops / (cluster.tflops * 1e12 * cluster.mfu * max(1, devices))


def vllm_stage(
    stage: str, x: Inputs, tokens: int, seconds: float | None, disk: int, extra: int = 0
) -> StagePlan:
    """A stage served by vLLM engines of verifier.tensor_parallel_size GPUs each: vLLM takes its
    share of every GPU up front; what must fit inside it is the weights' slice and one sequence's KV."""
    c, tp = x.config, x.tp
    weights = x.params * x.vdtype_bytes // tp + extra
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * x.vdtype_bytes // tp
    one_sequence = kv_per_token * x.recipe.data.max_length
    share = int(x.cluster.memory * VLLM_MEMORY_UTILIZATION)
    terms = [
        Term("verifier weights / TP", weights, f"{x.params / 1e9:.1f}B params x {x.vdtype_bytes} B / {tp}"),
        Term("KV cache + activations", max(share - weights, one_sequence), "the rest of vLLM's share"),
    ]
    engines = max(1, x.cluster.world // tp)
    return StagePlan(
        stage,
        terms,
        x.cluster.memory if x.cuda else 0,
        disk,
        tokens,
        seconds,
        [
            f"vLLM preallocates gpu_memory_utilization {VLLM_MEMORY_UTILIZATION} of each GPU",
            f"{engines} engine(s) of TP {tp}; one {x.recipe.data.max_length}-token sequence needs "
            f"{one_sequence / GIB:.2f} GiB of KV per GPU",
        ],
        f"raise verifier.tensor_parallel_size (now {tp}) until the weights' slice fits",
    )


def plan_data(x: Inputs) -> StagePlan:
    """Conversations: tokenizing a source costs no device; generating answers runs vLLM engines
    (data.engine auto/vllm on GPUs) or the HF model, or remote servers (data.engine server)."""
    from specctl.data import sources

    d = x.recipe.data
    generating = sources.is_self_generated(d.source) or d.regenerate
    tokens = x.max_tokens()
    disk = tokens * 9  # int32 ids + bool mask + ~4 bytes of jsonl text per token
    if not generating or d.engine == "server" or not x.cuda:
        return StagePlan("data", [], 0, disk, tokens, None, ["no verifier on this machine's devices"])
    new_tokens = (d.max_samples or _generated_count(x.recipe)) * d.max_new_tokens
    engines = max(1, x.cluster.world // x.tp)
    rate = DECODE_TOKENS_PER_S_8B * 8e9 / x.params * x.tp
    plan = vllm_stage("data", x, tokens, new_tokens / (rate * engines), disk)
    plan.assumptions.append(
        f"assumed {rate:,.0f} output tok/s per engine ({DECODE_TOKENS_PER_S_8B:,.0f} at 8B, TP 1)"
    )
    return plan


def plan_collect(x: Inputs) -> StagePlan:
    """The feature forward: HF (traced; weights split over verifier.tensor_parallel_size GPUs by a
    device map) or vLLM engines; the store's bytes from its layout."""
    from specctl.features import Layout, layout_bytes_per_token

    r = x.recipe
    layout = Layout.from_section(r.features)
    n_aux = len(x.spec.aux_layer_ids)
    bpt = layout_bytes_per_token(layout, x.config.hidden_size, n_aux, x.config.vocab_size)
    tokens = x.max_tokens()
    disk = tokens * bpt
    flops_per_token = 2 * x.params  # decoder + LM head, the top-k chunked over the vocabulary
    seconds = _gpu_seconds(flops_per_token * tokens, x.cluster, x.cluster.world) if x.cuda else None
    if r.features.backend == "vllm":
        return vllm_stage("collect", x, tokens, seconds, disk)
    ft = trace_collect_forward(r, x.config, x.cluster.device)
    tp = x.tp
    activations = ft.peak - ft.weights
    weights = x.params * x.vdtype_bytes
    terms = [
        Term("verifier weights / TP", weights // tp, f"{x.params / 1e9:.2f}B params over {tp} GPU(s)"),
        Term("float32 LM head (top-k targets)", ft.weights - weights, "on the first GPU"),
        Term(
            "forward of one batch",
            activations,
            f"traced: {ft.sequences} x {ft.length} tokens (features.batch_tokens), hooks, encoding",
        ),
    ]
    terms += x.overheads(sum(t.bytes for t in terms))
    shard = r.features.shard_tokens * bpt
    return StagePlan(
        "collect",
        terms,
        x.cluster.memory,
        disk,
        tokens,
        # a device map runs the layers one GPU after another: a verifier spread over tp GPUs
        # keeps one of them busy at a time, so world // tp GPUs compute at once, not world
        _gpu_seconds(ft.flops * tokens / (ft.sequences * ft.length), x.cluster, max(1, x.cluster.world // tp))
        if x.cuda
        else None,
        [
            f"{bpt:,} B/token on disk; a shard ({shard / GIB:.1f} GiB) is held in host memory until written",
            f"HF device map over {tp} GPU(s): one computes at a time "
            f"({max(1, x.cluster.world // tp)} at once in all)",
        ],
        f"raise verifier.tensor_parallel_size (now {tp}) or lower features.batch_tokens "
        f"(now {r.features.batch_tokens})",
    )


def train_terms(x: Inputs, st: StepTrace) -> list[Term]:
    """A rank's peak from a traced step, with what the trace (one process, no DDP or FSDP2) leaves out."""
    r, cluster = x.recipe, x.cluster
    cfg = r.train
    kept = st.grads if st.accumulated else 0
    terms = [
        Term(
            "drafter + borrowed verifier tensors", st.weights, f"built: {st.trainable / 1e6:,.0f}M trainable"
        ),
        Term("optimizer state", st.optimizer, f"traced ({cfg.optimizer})"),
    ]
    if kept:
        terms.append(Term("gradients kept across the step's pieces", kept, "traced: a piece after the first"))
    terms.append(
        Term(
            "step: batch, activations, gradients, loss",
            st.peak - st.weights - st.optimizer - kept,
            f"traced: {st.sequences} x {st.length} tokens"
            + (", activation checkpointing" if cfg.activation_checkpointing else ""),
        )
    )
    if cfg.parallelism == "fsdp":
        terms += fsdp_terms(st, cluster.world)
    elif cluster.world > 1:
        terms.append(Term("DDP gradient buckets", st.grads, "one copy of the gradients"))
    if r.train.mode == "online":
        terms.append(Term("online: the verifier on every rank", x.params * x.vdtype_bytes, "weights only"))
    return terms + x.overheads(sum(t.bytes for t in terms))


def fsdp_terms(st: StepTrace, world: int) -> list[Term]:
    """What FSDP2 changes on a rank against the one-process trace (distributed.wrap: the whole
    drafter is one FSDP unit, no mixed precision; the loop gathers it before each piece): the
    parameters and the optimizer state are sharded over the ranks, but a whole gathered copy of the
    parameters lives from each piece's forward through its backward, beside the shard. The gradients
    are not sharded where the peak is: FSDP2 keeps them whole across the pieces it does not
    synchronise and reduce-scatters them after the last piece's backward, its activations gone.
    Checked against a real FSDP2 step at world size 8 on a fake process group (specctl.train.fsdptrace)."""
    share = 1 - 1 / world
    return [
        Term("FSDP2: parameters sharded", -int(st.params * share), f"/ {world} ranks"),
        Term("FSDP2: optimizer state sharded", -int(st.optimizer * share), f"/ {world} ranks"),
        Term(
            "FSDP2: parameters gathered whole", st.params, "one FSDP unit: each piece's forward and backward"
        ),
    ]


def checkpoints_kept(cfg: Any) -> int:
    """Checkpoints on disk at once: train.keep_checkpoints, or fewer when the run saves fewer
    (every save_every steps and at the end)."""
    return max(1, min(cfg.keep_checkpoints, ceil_div(cfg.max_steps, cfg.save_every)))


def micro_tokens(recipe: Any) -> int:
    cfg = recipe.train
    return min(cfg.micro_batch_tokens or cfg.batch_tokens, cfg.batch_tokens)


def accumulates(recipe: Any, micro: int) -> bool:
    """Whether a step runs more than one piece, so gradients live across pieces: a micro-batch
    split by train.micro_batch_tokens, or train.grad_accum micro-batches."""
    cfg = recipe.train
    length = min(recipe.data.max_length, cfg.batch_tokens)
    per_piece = max(1, min(micro, cfg.batch_tokens) // length) * length
    return cfg.grad_accum > 1 or ceil_div(cfg.batch_tokens, per_piece) > 1


def plan_train(x: Inputs) -> StagePlan:
    """One rank's training step at train.micro_batch_tokens, traced; when it does not fit, the
    largest micro-batch that does (halving down to one sequence) goes into the fix."""
    r, cluster = x.recipe, x.cluster
    cfg = r.train
    micro = micro_tokens(r)
    st = trace_train_step(r, x.spec, micro, cluster.device, accumulates(r, micro))
    terms = train_terms(x, st)
    pieces = ceil_div(cfg.batch_tokens, st.sequences * st.length)
    steps_flops = st.flops * pieces * cfg.grad_accum * cfg.max_steps
    tokens = cfg.max_steps * cfg.batch_tokens * cfg.grad_accum * cluster.world
    plan = StagePlan(
        "train",
        terms,
        cluster.memory,
        checkpoints_kept(cfg) * (st.trainable * 4 + st.optimizer),
        tokens,
        _gpu_seconds(steps_flops, cluster, 1) if x.cuda else None,
        [
            f"{pieces} piece(s) of {st.sequences} x {st.length} tokens per micro-batch of "
            f"{cfg.batch_tokens:,} (train.micro_batch_tokens), every token a loss token",
            f"{st.flops / 1e12:,.1f} TFLOP per piece (traced), MFU {cluster.mfu:.0%} of "
            f"{cluster.tflops:,.0f} TFLOP/s"
            if x.cuda
            else "time not estimated on the CPU",
        ],
    )
    if not plan.fits:
        plan.fix = train_fix(x, micro, plan.capacity)
    return plan


def train_fix(x: Inputs, micro: int, capacity: int) -> str:
    """What to change when the step does not fit: the largest micro-batch that does, else the
    switches that cut memory further."""
    r = x.recipe
    length = min(r.data.max_length, r.train.batch_tokens)
    candidate = micro // 2
    while candidate >= length:
        st = trace_train_step(r, x.spec, candidate, x.cluster.device, accumulates(r, candidate))
        if sum(t.bytes for t in train_terms(x, st)) <= capacity:
            return f"set train.micro_batch_tokens={candidate} (the largest power-of-two share that fits)"
        candidate //= 2
    switches = []
    if not r.train.activation_checkpointing:
        switches.append("train.activation_checkpointing=true")
    if r.train.parallelism != "fsdp":
        switches.append("train.parallelism=fsdp")
    switches.append("a smaller drafter or data.max_length, or GPUs with more memory")
    return f"even one {length}-token sequence per piece does not fit; try " + ", ".join(switches)


def plan_export(x: Inputs) -> StagePlan:
    """Export on the host, as export.save_drafter does it: the checkpoint's float32 state, its copy in
    export.dtype, safetensors' in-memory serialization of that copy, and the written file read back
    to validate it before it replaces anything."""
    saved, exported = drafter_tensors(x)
    b = _bytes_of(getattr(torch, x.recipe.export.dtype))
    terms = [
        Term("checkpoint state (float32)", saved * 4, "the drafter's state dict"),
        Term(f"export copy ({x.recipe.export.dtype})", exported * b, "export_state(), cast"),
        Term("safetensors serialization", exported * b, "the file is built in memory"),
        Term("validation: the file read back", exported * b, "validate_export(values)"),
    ]
    return StagePlan("export", terms, 0, exported * b, 0, None, ["runs on the host"])


def drafter_parameters(x: Inputs) -> int:
    """Trainable parameters of the recipe's drafter."""
    return _drafter_counts(x)[0]


def drafter_tensors(x: Inputs) -> tuple[int, int]:
    """(floating elements in the drafter's state dict, in its export)."""
    return _drafter_counts(x)[1:]


def _drafter_counts(x: Inputs) -> tuple[int, int, int]:
    """(trainable parameters, floating state-dict elements, floating export elements) of the
    recipe's drafter, built with fake weights (no memory; its draft vocabulary table real)."""
    from specctl.drafters import DRAFTERS
    from specctl.drafters.api import VerifierWeights
    from specctl.memtrace import MemoryTrace

    V, H = x.spec.vocab_size, x.spec.hidden_size
    algo = x.recipe.drafter.algo
    floating = lambda tensors: sum(t.numel() for t in tensors if t.is_floating_point())  # noqa: E731
    with MemoryTrace() as t:
        d2t = draft_offsets(x.recipe)
        with t.heavy():
            weights = VerifierWeights(torch.empty(V, H), torch.empty(V, H), torch.empty(H))
            section = getattr(x.recipe.drafter, algo)
            drafter = DRAFTERS[algo].build(section, x.spec, weights, d2t, x.recipe.train.loss)
        trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        return trainable, floating(drafter.state_dict().values()), floating(drafter.export_state().values())


def plan_bench(x: Inputs) -> StagePlan:
    """Serving the exported drafter beside the verifier: vLLM engines, or the embedded engine
    (the whole verifier on one device)."""
    draft = drafter_tensors(x)[1] * _bytes_of(getattr(torch, x.recipe.export.dtype))
    if x.recipe.bench.backend in VLLM_BACKENDS and x.cuda:
        return vllm_stage("bench", x, 0, None, 0, extra=draft)
    weights = x.params * x.vdtype_bytes
    terms = [
        Term("verifier weights", weights, f"{x.params / 1e9:.2f}B params, one device"),
        Term("drafter", draft, f"export.dtype {x.recipe.export.dtype}"),
        *x.overheads(weights + draft),
    ]
    return StagePlan(
        "bench",
        terms,
        x.cluster.memory,
        0,
        0,
        None,
        ["embedded engine: batch 1, short KV"],
        "bench with --backend vllm and verifier.tensor_parallel_size, or on a larger GPU",
    )


STAGES = {
    "data": plan_data,
    "collect": plan_collect,
    "train": plan_train,
    "export": plan_export,
    "bench": plan_bench,
}


def inputs(recipe: Any, cluster: Cluster) -> Inputs:
    from specctl.verifier import check_aux_layer_ids, default_aux_layer_ids, spec_from_config

    config = verifier_config(recipe.verifier)
    L = config.num_hidden_layers
    aux = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    mask = recipe.drafter.mask_token_id if recipe.drafter.mask_token_id is not None else config.vocab_size - 1
    spec = spec_from_config(config, recipe.verifier.name_or_path, aux, mask)
    return Inputs(recipe, cluster, config, count_parameters(config), spec)


def plan_recipe(recipe: Any, cluster: Cluster, stages: tuple[str, ...] = tuple(STAGES)) -> Plan:
    """The plan of `stages` of `recipe` (as `train --algo` trains it) on `cluster`."""
    recipe = recipe.for_training()
    x = inputs(recipe, cluster)
    return Plan(recipe.name, cluster, [STAGES[s](x) for s in stages])


def check_stage(
    recipe: Any, stages: str | tuple[str, ...], force: bool = False, say=None, path: Path | None = None
) -> Plan | None:
    """The plan of `stages` on this machine (one verifier read for all), each said in one line on a
    GPU; PlanError when one does not fit (unless `force`, which says the refusal as a warning and
    goes on). A recipe that cannot be planned (a verifier config not to be read here, settings the
    verifier refuses) is not checked: the stage refuses it itself, in its own one line."""
    stages = (stages,) if isinstance(stages, str) else stages
    try:
        # memory only: the disk a stage fills is its own check (collect's store estimate, which names
        # the layout and the fix), made where it knows what is already written
        # this process's GPUs: train's rank takes one, collect's (and its data stage's) a group of
        # verifier.tensor_parallel_size
        span = 1 if "train" in stages else recipe.verifier.tensor_parallel_size
        machine = this_machine(path, recipe.verifier.device, span)
        plan = plan_recipe(recipe, replace(machine, disk=None), stages)
    except (SpecctlError, ValueError):  # a recipe the stage itself refuses, in its own one line
        return None
    for s in plan.stages:
        if say is not None and s.capacity and plan.cluster.device == "cuda":  # a CPU run's figures are noise
            say(f"plan: {s.stage} peak {gib(s.peak)} per {plan.cluster.device} device of {gib(s.capacity)}")
    message = refusal(plan)
    if message is not None and not force:
        raise PlanError(message + " (or pass --force)")
    if message is not None and say is not None:
        say(f"warning (--force): {message}")
    return plan
