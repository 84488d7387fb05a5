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
from specctl.errors import UsageError
from specctl.estimate import StoreEstimate, check_store_fits, human_count
from specctl.features import (
    Layout,
    StorePlan,
    continued_layout,
    finalize_store,
    init_store,
    layout_bytes_per_token,
    plan_shards,
    shard_done,
    write_shard,
)
from specctl.progress import duration, note, progress_bar
from specctl.recipe import Recipe
from specctl.resources import check_stage
from specctl.verifier import (
    VerifierBackend,
    VerifierFiles,
    check_aux_layer_ids,
    config_hash,
    default_aux_layer_ids,
    load_verifier,
    read_verifier_files,
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
    recipe: Recipe,
    shard: str | None = None,
    progress: bool = True,
    verifier: VerifierBackend | None = None,
    force: bool = False,
) -> CollectSummary:
    """Make (or finish) runs/<name>/features for the recipe; see module docstring.

    `force` starts even when the estimate says the store will not fit on the disk, or the plan
    that the verifier forward will not fit the device (resources.check_stage).
    """
    start = time.perf_counter()
    rank, world = parse_shard(shard)
    run_dir = recipe.run_dir
    check_stage(recipe, "collect", force, lambda text: note(text, enabled=progress), run_dir)
    if verifier is None:  # the vLLM engine's log beside the data stage's (one per shard worker)
        log = run_dir / "logs" / ("collect-vllm.log" if world == 1 else f"collect-vllm-{rank}.log")
        verifier = _load_verifier(recipe, log)
    L = verifier.num_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    path = run_dir / "features"
    layout = continued_layout(path, Layout.from_section(recipe.features))
    bytes_per_token = layout_bytes_per_token(
        layout, verifier.config.hidden_size, len(aux_ids), verifier.config.vocab_size
    )
    say = lambda text: note(text, enabled=progress)  # noqa: E731

    def on_plan(samples: int, tokens: int) -> None:  # the generation warm-up's estimate
        check_store_fits(
            StoreEstimate(path, samples, tokens, bytes_per_token, layout, exact=False), force, say
        )

    prepare_data(
        recipe.data,
        verifier.tokenizer,
        run_dir / "data",
        model=verifier.generation_model,  # None unless the HF model is loaded: generation loads what it needs
        progress=progress,
        verifier=recipe.verifier,
        on_plan=on_plan,
    )
    samples = load_samples(run_dir / "data")
    lengths = [s["input_ids"].numel() for s in samples]
    plan = _store_plan(verifier, aux_ids, layout, samples, lengths, recipe.features.shard_tokens)
    init_store(path, plan)

    mine = [j for j in range(len(plan.shards)) if j % world == rank]
    todo = [j for j in mine if not shard_done(path, j)]
    if todo:
        written = sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))
        estimate = StoreEstimate(path, len(samples), sum(lengths), bytes_per_token, layout, written)
        check_store_fits(estimate, force, say)
        if isinstance(verifier, VerifierFiles):  # the data stage is done: its GPUs are free
            verifier = load_verifier(recipe.verifier)
    forward_start = time.perf_counter()
    done_tokens = _capture(verifier, recipe, aux_ids, layout, plan, samples, todo, progress, say)
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


def _load_verifier(recipe: Recipe, vllm_log: Path) -> VerifierBackend | VerifierFiles:
    """The recipe's verifier; an HF one spread over GPUs (`tensor_parallel_size` > 1) as its files
    only, its weights loaded once the data stage is done: loaded first, they would hold the GPUs
    the data stage's vLLM engines start on (a 70B verifier: 35 GB of each of 4 GPUs)."""
    if recipe.features.backend == "vllm":
        from specctl.collect_vllm import load_vllm_verifier

        return load_vllm_verifier(recipe.verifier, vllm_log)
    if recipe.verifier.tensor_parallel_size > 1:
        return read_verifier_files(recipe.verifier)
    return load_verifier(recipe.verifier)


def _store_plan(
    verifier, aux_ids, layout: Layout, samples, lengths: list[int], shard_tokens: int
) -> StorePlan:
    return StorePlan(
        verifier=verifier.hub_id or verifier.name_or_path,
        verifier_config_hash=config_hash(verifier.config),
        num_layers=verifier.num_layers,
        hidden_size=verifier.config.hidden_size,
        aux_layer_ids=list(aux_ids),
        dtype=layout.dtype,
        data_hash=samples_hash(samples),
        lengths=lengths,
        shards=plan_shards(lengths, shard_tokens),
        aux_dtype=layout.aux_dtype,
        target=layout.target,
        topk=layout.topk,
        target_stats=layout.target_stats,
    )


def _capture(
    verifier, recipe: Recipe, aux_ids, layout: Layout, plan: StorePlan, samples, todo, progress, say
) -> int:
    """Run the verifier over this worker's unfinished shards and write them; the tokens it ran."""
    lengths = plan.lengths
    total = sum(sum(lengths[a:b]) for a, b in (plan.shards[j] for j in todo))
    path = recipe.run_dir / "features"
    done_tokens = 0
    with ExitStack() as stack:
        if todo:  # start an engine (load an LM head) only when there is work
            forward = stack.enter_context(
                verifier.feature_forward(
                    aux_ids, layout, max_model_len=max(lengths) + 1, batch_tokens=recipe.features.batch_tokens
                )
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
            write_shard(path, j, forward(samples[a:b], advance), layout)
    return done_tokens
