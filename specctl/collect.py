"""The collect stage: conversations -> verifier forward -> feature store.

Samples are split into shards by a plan that depends only on their lengths; each shard is
computed in token-budget batches of similar-length samples (sorted, right-padded, so little
compute is spent on padding) and written atomically. Rerunning skips finished shards, so a
killed run resumes where it stopped and produces the same bytes.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from specctl.data import load_samples, prepare_data
from specctl.errors import DataError, SpecctlError
from specctl.features import StorePlan, finalize_store, init_store, plan_shards, shard_done, write_shard
from specctl.progress import progress_bar
from specctl.recipe import Recipe
from specctl.verifier import (
    Verifier,
    capture_hidden_states,
    check_aux_layer_ids,
    config_hash,
    default_aux_layer_ids,
    load_verifier,
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
) -> list[dict[str, torch.Tensor]]:
    """Run the verifier over samples; returns them with aux_hidden_states / last_hidden_state (CPU)."""
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
        aux, last = aux.cpu(), last.cpu()
        for r, i in enumerate(batch):
            n = lengths[i]
            out[i] = {**samples[i], "aux_hidden_states": aux[r, :n], "last_hidden_state": last[r, :n]}
        if on_batch:
            on_batch(sum(lengths[i] for i in batch))
    return out  # type: ignore[return-value]


def collect(
    recipe: Recipe, shard: str | None = None, progress: bool = True, verifier: Verifier | None = None
) -> CollectSummary:
    """Make (or finish) runs/<name>/features for the recipe; see module docstring."""
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

    try:
        prepare_data(
            recipe.data, verifier.tokenizer, run_dir / "data", model=verifier.model, progress=progress
        )
    except DataError:
        if verifier.model is None:  # the vLLM backend holds no HF model to generate with
            raise DataError(
                "the vLLM backend cannot generate conversations; prepare the data once with --backend hf "
                "(or use a dataset source), then rerun with --backend vllm"
            ) from None
        raise
    samples = load_samples(run_dir / "data")
    lengths = [s["input_ids"].numel() for s in samples]
    plan = StorePlan(
        verifier=verifier.hub_id or verifier.name_or_path,
        verifier_config_hash=config_hash(verifier.config),
        num_layers=L,
        hidden_size=verifier.config.hidden_size,
        aux_layer_ids=list(aux_ids),
        dtype=recipe.features.dtype,
        data_hash=samples_hash(samples),
        lengths=lengths,
        shards=plan_shards(lengths, recipe.features.shard_tokens),
    )
    path = run_dir / "features"
    init_store(path, plan)

    mine = [j for j in range(len(plan.shards)) if j % world == rank]
    todo = [j for j in mine if not shard_done(path, j)]
    total = sum(sum(lengths[a:b]) for a, b in (plan.shards[j] for j in todo))
    done_tokens = 0
    forward_start = time.perf_counter()
    with ExitStack() as stack:
        if use_vllm and todo:  # start the engine only when there is work
            from specctl.collect_vllm import forward_samples_vllm, open_vllm_verifier

            engine = stack.enter_context(
                open_vllm_verifier(
                    verifier,
                    aux_ids,
                    max_model_len=max(lengths) + 1,
                    max_num_batched_tokens=recipe.features.batch_tokens,
                )
            )

            def forward(batch, on_batch):
                return forward_samples_vllm(engine, batch, aux_ids, on_batch)
        else:

            def forward(batch, on_batch):
                return forward_samples(verifier, batch, aux_ids, recipe.features.batch_tokens, on_batch)

        bar = stack.enter_context(progress_bar("tok", enabled=progress))
        task = bar.add_task("collect hidden states", total=total)

        def advance(n: int) -> None:
            nonlocal done_tokens
            done_tokens += n
            bar.advance(task, n)

        for j in todo:
            a, b = plan.shards[j]
            results = forward(samples[a:b], advance)
            write_shard(path, j, results, recipe.features.dtype)
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
