"""The collect stage: conversations -> verifier forward -> feature store.

Samples are split into shards by a plan that depends only on their lengths; each shard is
computed in token-budget batches of similar-length samples (sorted, right-padded, so little
compute is spent on padding) and written atomically. Rerunning skips finished shards, so a
killed run resumes where it stopped and produces the same bytes.

The recipe's layout (`features.target` / `aux_dtype`) is applied where the states are computed
(`encode_features`: on the verifier's device for the HF backend), so a GPU does the top-k over
the vocabulary and the fp8 scaling, and only the compact tensors travel to the host.

Before capturing, the store's size (tokens x the layout's bytes per token) is checked against the
free space where it goes (estimate.py): collect refuses to start a store that will not fit unless
forced, once from the generation warm-up's estimate and again on the exact data.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from specctl.data import load_samples, prepare_data
from specctl.drafters.targets import verifier_topk
from specctl.errors import SpecctlError
from specctl.estimate import StoreEstimate, check_store_fits, human_count
from specctl.features import (
    FP8,
    TENSOR_DTYPES,
    Layout,
    StorePlan,
    finalize_store,
    init_store,
    layout_bytes_per_token,
    plan_shards,
    quantize_fp8,
    shard_done,
    write_shard,
)
from specctl.progress import duration, note, progress_bar
from specctl.recipe import Recipe
from specctl.verifier import (
    Verifier,
    capture_hidden_states,
    check_aux_layer_ids,
    config_hash,
    default_aux_layer_ids,
    load_verifier,
    verifier_weights,
)


@dataclass
class CollectSummary:
    features_dir: Path
    num_samples: int
    num_tokens: int  # tokens this process ran through the verifier
    shards_written: int
    shards_skipped: int
    complete: bool
    seconds: float  # the whole stage, data preparation included
    forward_seconds: float  # verifier forward + shard writes only
    bytes_per_token: float | None

    @property
    def tokens_per_s(self) -> float:
        """Collection throughput: tokens through the verifier per second of forward + write."""
        return self.num_tokens / self.forward_seconds if self.forward_seconds > 0 else 0.0


def parse_shard(spec: str | None) -> tuple[int, int]:
    """'I/N' -> (I, N); defaults to the torchrun rank when launched by torchrun."""
    import os

    if spec is None:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SpecctlError(f"--shard {spec!r}: expected I/N, e.g. --shard 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise SpecctlError(f"--shard {spec!r}: need 0 <= I < N")
    return i, n


@dataclass
class TargetHead:
    """The verifier's frozen final norm and LM head in float32, for top-k targets at collect time.

    Float32 once, here: `verifier_logits` would otherwise up-cast the [V, H] head per chunk.
    """

    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    eps: float

    @classmethod
    def from_verifier(cls, verifier: Verifier) -> TargetHead:
        """The HF verifier's own tensors, on its device: the same ones training would use."""
        weights = verifier_weights(verifier)
        eps = getattr(verifier.config, "rms_norm_eps", 1e-6)
        return cls(weights.norm.float(), weights.lm_head.float(), eps)


def encode_features(
    aux: torch.Tensor, last: torch.Tensor, layout: Layout, head: TargetHead | None
) -> dict[str, torch.Tensor]:
    """One row per token: aux [N, n_aux, H], last [N, H] (pre-norm) -> what a shard stores for them.

    aux: aux_hidden_states in `layout.aux_dtype`, or fp8 + aux_scale [N, n_aux]. Target: the
    final state in `layout.dtype`, or topk_ids / topk_logprobs [N, k] + logsumexp [N] from its
    logits (`head` needed). Runs on the inputs' device; the float16 / id casts happen in write_shard.
    """
    out: dict[str, torch.Tensor] = {}
    if layout.aux_dtype == FP8:
        out["aux_hidden_states"], out["aux_scale"] = quantize_fp8(aux)
    else:
        out["aux_hidden_states"] = aux.to(TENSOR_DTYPES[layout.aux_dtype])
    if layout.target == "topk":
        if head is None:
            raise ValueError("target topk needs the verifier's norm and LM head (TargetHead)")
        ids, logprobs, logsumexp = verifier_topk(
            last, head.norm.to(last.device), head.lm_head.to(last.device), head.eps, layout.topk
        )
        out.update(topk_ids=ids, topk_logprobs=logprobs, logsumexp=logsumexp)
    else:
        out["last_hidden_state"] = last.to(TENSOR_DTYPES[layout.dtype])
    return out


def samples_hash(samples: list[dict[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s["input_ids"].to(torch.int32).numpy().tobytes())
        h.update(s["loss_mask"].to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def token_budget_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices, longest first, so each padded batch holds <= batch_tokens tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def forward_samples(
    verifier: Verifier,
    samples: list[dict[str, torch.Tensor]],
    aux_layer_ids: tuple[int, ...],
    batch_tokens: int,
    on_batch=None,
    layout: Layout | None = None,
    head: TargetHead | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run the verifier over samples; returns them with their features, on the CPU.

    Without `layout`: aux_hidden_states [T, n_aux, H] and last_hidden_state [T, H] in the
    verifier's dtype. With one: `encode_features` of them, computed on the verifier's device.
    """
    out: list[dict[str, torch.Tensor] | None] = [None] * len(samples)
    lengths = [s["input_ids"].numel() for s in samples]
    pad_id = 0
    for batch in token_budget_batches(lengths, batch_tokens):
        T = lengths[batch[0]]
        input_ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), T), dtype=torch.long)
        for r, i in enumerate(batch):
            input_ids[r, : lengths[i]] = samples[i]["input_ids"]
            attention_mask[r, : lengths[i]] = 1
        aux, last = capture_hidden_states(
            verifier.model, input_ids.to(verifier.device), attention_mask.to(verifier.device), aux_layer_ids
        )
        if layout is None:
            aux, last = aux.cpu(), last.cpu()
            for r, i in enumerate(batch):
                n = lengths[i]
                out[i] = {**samples[i], "aux_hidden_states": aux[r, :n], "last_hidden_state": last[r, :n]}
        else:
            real = attention_mask.to(verifier.device).bool()  # right-padded: rows of sample 0, then 1...
            encoded = {k: v.cpu() for k, v in encode_features(aux[real], last[real], layout, head).items()}
            pieces = {k: v.split([lengths[i] for i in batch]) for k, v in encoded.items()}
            for r, i in enumerate(batch):
                out[i] = {**samples[i], **{k: v[r] for k, v in pieces.items()}}
        if on_batch:
            on_batch(sum(lengths[i] for i in batch))
    return out  # type: ignore[return-value]


def collect(
    recipe: Recipe,
    shard: str | None = None,
    progress: bool = True,
    verifier: Verifier | None = None,
    force: bool = False,
) -> CollectSummary:
    """Make (or finish) runs/<name>/features for the recipe; see module docstring.

    `force` starts even when the estimate says the store will not fit on the disk.
    """
    start = time.perf_counter()
    rank, world = parse_shard(shard)
    run_dir = recipe.run_dir
    use_vllm = recipe.features.backend == "vllm"
    if verifier is None:
        if use_vllm:
            from specctl.collect_vllm import load_vllm_verifier

            verifier = load_vllm_verifier(recipe.verifier)
        else:
            verifier = load_verifier(recipe.verifier)
    L = verifier.num_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    layout = Layout.from_section(recipe.features)
    bytes_per_token = layout_bytes_per_token(
        layout, verifier.config.hidden_size, len(aux_ids), verifier.config.vocab_size
    )
    path = run_dir / "features"
    say = lambda text: note(text, enabled=progress)  # noqa: E731

    def on_plan(samples: int, tokens: int) -> None:  # the generation warm-up's estimate
        check_store_fits(
            StoreEstimate(path, samples, tokens, bytes_per_token, layout, exact=False), force, say
        )

    prepare_data(
        recipe.data,
        verifier.tokenizer,
        run_dir / "data",
        model=verifier.model,  # None for the vLLM backend: generation then loads what it needs
        progress=progress,
        verifier=recipe.verifier,
        on_plan=on_plan,
    )
    samples = load_samples(run_dir / "data")
    lengths = [s["input_ids"].numel() for s in samples]
    plan = StorePlan(
        verifier=verifier.hub_id or verifier.name_or_path,
        verifier_config_hash=config_hash(verifier.config),
        num_layers=L,
        hidden_size=verifier.config.hidden_size,
        aux_layer_ids=list(aux_ids),
        dtype=layout.dtype,
        data_hash=samples_hash(samples),
        lengths=lengths,
        shards=plan_shards(lengths, recipe.features.shard_tokens),
        aux_dtype=layout.aux_dtype,
        target=layout.target,
        topk=layout.topk,
    )
    init_store(path, plan)

    mine = [j for j in range(len(plan.shards)) if j % world == rank]
    todo = [j for j in mine if not shard_done(path, j)]
    total = sum(sum(lengths[a:b]) for a, b in (plan.shards[j] for j in todo))
    if todo:
        written = sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))
        estimate = StoreEstimate(path, len(samples), sum(lengths), bytes_per_token, layout, written)
        check_store_fits(estimate, force, say)
    done_tokens = 0
    forward_start = time.perf_counter()
    with ExitStack() as stack:
        if use_vllm and todo:  # start the engine only when there is work
            from specctl.collect_vllm import forward_samples_vllm, load_target_head, open_vllm_verifier

            # the LM head from the checkpoint files, on the CPU (vLLM's model is in its own process)
            head = load_target_head(verifier) if layout.target == "topk" else None

            engine = stack.enter_context(
                open_vllm_verifier(
                    verifier,
                    aux_ids,
                    max_model_len=max(lengths) + 1,
                    max_num_batched_tokens=recipe.features.batch_tokens,
                )
            )

            def forward(batch, on_batch):
                return forward_samples_vllm(engine, batch, aux_ids, on_batch, layout=layout, head=head)
        else:
            head = TargetHead.from_verifier(verifier) if layout.target == "topk" and todo else None

            def forward(batch, on_batch):
                return forward_samples(
                    verifier, batch, aux_ids, recipe.features.batch_tokens, on_batch, layout, head
                )

        bar = stack.enter_context(progress_bar("tok", enabled=progress))
        task = bar.add_task("collect hidden states", total=total)
        loop_start = time.perf_counter()

        def advance(n: int) -> None:
            nonlocal done_tokens
            if done_tokens == 0:  # the first batch is the warm-up: the estimate from its speed
                seconds = time.perf_counter() - loop_start
                eta = duration((total - n) * seconds / n) if n < total else "done"
                say(f"collect: warm-up {n / seconds:,.0f} tok/s -> ~{eta} for {human_count(total)} tokens")
            done_tokens += n
            bar.advance(task, n)

        for j in todo:
            a, b = plan.shards[j]
            results = forward(samples[a:b], advance)
            write_shard(path, j, results, layout)
    manifest = finalize_store(path)
    bpt = None
    if manifest:
        bpt = sum(f["bytes"] for f in manifest.shard_files) / max(1, manifest.num_tokens)
    return CollectSummary(
        features_dir=path,
        num_samples=len(samples),
        num_tokens=done_tokens,
        shards_written=len(todo),
        shards_skipped=len(mine) - len(todo),
        complete=manifest is not None,
        seconds=time.perf_counter() - start,
        forward_seconds=time.perf_counter() - forward_start,
        bytes_per_token=bpt,
    )
