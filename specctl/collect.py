"""The collect stage: conversations -> verifier forward -> feature store.

Samples are split into shards by a plan that depends only on their lengths; each shard is
computed in token-budget batches of similar-length samples (sorted, right-padded, so little
compute is spent on padding) and written atomically. Rerunning skips finished shards, so a
killed run resumes where it stopped and produces the same bytes.

The recipe's layout (`features.target` / `aux_dtype`) is applied where the states are computed
(`encode_features`: on the verifier's device for the HF backend), so a GPU does the top-k over
the vocabulary and the fp8 scaling, and only the compact tensors travel to the host.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from specctl.data import load_samples, prepare_data
from specctl.errors import DataError, UsageError
from specctl.features import (
    Layout,
    StorePlan,
    continued_layout,
    finalize_store,
    init_store,
    plan_shards,
    shard_done,
    write_shard,
)
from specctl.progress import progress_bar
from specctl.recipe import Recipe
from specctl.verifier import (
    VerifierBackend,
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
        raise UsageError(f"--shard {spec!r}: expected I/N, e.g. --shard 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise UsageError(f"--shard {spec!r}: need 0 <= I < N")
    return i, n


def samples_hash(samples: list[dict[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s["input_ids"].to(torch.int32).numpy().tobytes())
        h.update(s["loss_mask"].to(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def collect(
    recipe: Recipe, shard: str | None = None, progress: bool = True, verifier: VerifierBackend | None = None
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
    model = verifier.generation_model
    L = verifier.num_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)

    try:
        prepare_data(recipe.data, verifier.tokenizer, run_dir / "data", model=model, progress=progress)
    except DataError:
        if model is None:  # the vLLM backend holds no HF model to generate with
            raise DataError(
                "the vLLM backend cannot generate conversations; prepare the data once with --backend hf "
                "(or use a dataset source), then rerun with --backend vllm"
            ) from None
        raise
    samples = load_samples(run_dir / "data")
    lengths = [s["input_ids"].numel() for s in samples]
    layout = continued_layout(run_dir / "features", Layout.from_section(recipe.features))
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
        target_stats=layout.target_stats,
    )
    path = run_dir / "features"
    init_store(path, plan)

    mine = [j for j in range(len(plan.shards)) if j % world == rank]
    todo = [j for j in mine if not shard_done(path, j)]
    total = sum(sum(lengths[a:b]) for a, b in (plan.shards[j] for j in todo))
    done_tokens = 0
    forward_start = time.perf_counter()
    with ExitStack() as stack:
        if todo:  # start an engine (load an LM head) only when there is work
            forward = stack.enter_context(
                verifier.feature_forward(
                    aux_ids, layout, max_model_len=max(lengths) + 1, batch_tokens=recipe.features.batch_tokens
                )
            )
        bar = stack.enter_context(progress_bar("tok", enabled=progress))
        task = bar.add_task("collect hidden states", total=total)

        def advance(n: int) -> None:
            nonlocal done_tokens
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
