"""The collect stage: conversations -> verifier forward -> feature store.

Samples are split into shards by a plan that depends only on their lengths; each shard is
computed in token-budget batches of similar-length samples (sorted, right-padded, so little
compute is spent on padding) and written atomically. Rerunning skips finished shards, so a
killed run resumes where it stopped and produces the same bytes.

The recipe's layout (`features.target` / `aux_dtype`) is applied where the states are computed
(`encode_features`: on the verifier's device for the HF backend), so a GPU does the top-k over
the vocabulary and the fp8 scaling, and only the compact tensors travel to the host.

Workers share a store through shard claims (specctl/collect/claims.py). A torchrun rank (one per GPU, on
LOCAL_RANK's GPU: devices.resolve_device) first takes its own shards (j % WORLD_SIZE == RANK),
then any shard nobody holds or whose holder is gone, and waits for shards that live workers hold
until they are written or their holder's lease runs out; so the surviving ranks, or a rerun,
finish what a dead one left. A plain run is one such worker: it finishes the whole store. A
`--shard I/N` worker keeps to its part (shard 0 alone first, to prepare the data with every GPU
free, must leave the rest to the torchrun that follows), taking over only claims of that part.
Whoever finds the store complete first writes the manifest.

Before capturing, the store's size (tokens x the layout's bytes per token) is checked against the
free space where it goes (estimate.py): collect refuses to start a store that will not fit unless
forced, once from the generation warm-up's estimate and again on the exact data.
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specctl.collect.claims import Claim, ShardClaims
from specctl.data import DATA_OWNER, load_samples, prepare_data
from specctl.data.prepare import read_manifest
from specctl.durable import recover_dirs
from specctl.errors import UsageError
from specctl.estimate import StoreEstimate, check_store_fits, human_count
from specctl.features import OWNER as FEATURES_OWNER
from specctl.features import (
    Layout,
    Manifest,
    StorePlan,
    continued_layout,
    finalize_store,
    init_store,
    layout_bytes_per_token,
    plan_shards,
    shard_done,
    write_shard,
)
from specctl.origin import FeatureOrigin
from specctl.progress import duration, note, progress_bar
from specctl.recipe import Recipe
from specctl.recipe_origin import feature_origin
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
    shards_written: int  # by this process, its own and those it took over
    shards_skipped: int  # of the shards it works on (`work_order`), done before it started
    complete: bool
    seconds: float  # the whole stage, data preparation included
    forward_seconds: float  # verifier forward + shard writes only
    bytes_per_token: float | None
    device: str  # where this process ran the verifier (its rank's GPU under torchrun)

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
    DATA_OWNER.check(run_dir / "data")  # a user's directory at either: refused before any work
    FEATURES_OWNER.check(run_dir / "features")
    say = lambda text: note(text, enabled=progress)  # noqa: E731
    check_stage(recipe, ("data", "collect"), force, say, run_dir)  # the data stage's generation runs here too
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
    estimate = functools.partial(StoreEstimate, path, bytes_per_token=bytes_per_token, layout=layout)
    samples = _prepare_data(recipe, verifier, estimate, force, progress)
    origin = feature_origin(recipe, verifier, aux_ids, layout, read_manifest(run_dir / "data")["fingerprint"])
    plan = _store_plan(verifier, aux_ids, layout, samples, origin, recipe.features.shard_tokens)
    claims = ShardClaims(path, recipe.features.claim_lease_s)
    init_store(path, plan, claims.writer_alive)
    claims.recover()

    order = work_order(len(plan.shards), rank, world, whole=shard is None)
    todo = [j for j in order if not shard_done(path, j)]
    if todo:
        written = sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))
        check_store_fits(estimate(len(samples), sum(plan.lengths), written=written), force, say)
        if isinstance(verifier, VerifierFiles):  # the data stage is done: its GPUs are free
            verifier = load_verifier(recipe.verifier)
    forward_start = time.perf_counter()
    capture = _Capture(verifier, recipe, aux_ids, layout, plan, samples, claims, say)
    capture.run(todo, own=[j for j in todo if j % world == rank], progress=progress)
    manifest = _finish_store(path, claims)
    return CollectSummary(
        features_dir=path,
        num_samples=len(samples),
        num_tokens=capture.done_tokens,
        shards_written=len(capture.written),
        shards_skipped=len(order) - len(todo),
        complete=manifest is not None,
        seconds=time.perf_counter() - start,
        forward_seconds=time.perf_counter() - forward_start,
        bytes_per_token=None if manifest is None else manifest_bytes_per_token(manifest),
        device="-" if isinstance(verifier, VerifierFiles) else str(verifier.device),  # no weights loaded
    )


def _prepare_data(
    recipe: Recipe,
    verifier: VerifierBackend | VerifierFiles,
    estimate: Callable[..., StoreEstimate],
    force: bool,
    progress: bool,
) -> list[dict[str, torch.Tensor]]:
    """The data stage (`prepare_data`), its generation on `verifier`; the store's size is checked
    against the disk from the generation warm-up's estimate, before hours of generation
    (`estimate(samples, tokens, ...)`: the store's StoreEstimate). Returns the samples."""
    say = lambda text: note(text, enabled=progress)  # noqa: E731

    def on_plan(samples: int, tokens: int) -> None:  # the generation warm-up's estimate
        check_store_fits(estimate(samples, tokens, exact=False), force, say)

    prepare_data(
        recipe.data,
        verifier.tokenizer,
        recipe.run_dir / "data",
        model=verifier.generation_model,  # None unless the HF model is loaded: generation loads what it needs
        progress=progress,
        verifier=recipe.verifier,
        on_plan=on_plan,
    )
    return load_samples(recipe.run_dir / "data")


def _finish_store(path: Path, claims: ShardClaims) -> Manifest | None:
    """The store's manifest, written by whoever finds every shard done first (None: work remains).
    Once complete, the claims mean nothing any more; nor do the leftovers of workers that died
    meanwhile: both are cleared."""
    manifest = finalize_store(path)
    if manifest is not None:
        claims.clear()
        recover_dirs(path, claims.writer_alive)
    return manifest


def manifest_bytes_per_token(manifest: Manifest) -> float:
    """What the complete store takes on disk per token: its shard files' bytes over its tokens."""
    return sum(f["bytes"] for f in manifest.shard_files) / max(1, manifest.num_tokens)


def work_order(num_shards: int, rank: int, world: int, whole: bool = True) -> list[int]:
    """The shards worker `rank` of `world` works on, in order: its own (j % world == rank) first,
    then (`whole`: a torchrun rank or a plain run) rank + 1's, rank + 2's, ..., so workers that
    run out of their own work take over from different workers instead of all from the first."""
    order = sorted(range(num_shards), key=lambda j: ((j - rank) % world, j))
    return order if whole else [j for j in order if j % world == rank]


def _load_verifier(recipe: Recipe, vllm_log: Path) -> VerifierBackend | VerifierFiles:
    """The recipe's verifier; an HF one spread over GPUs (`tensor_parallel_size` > 1) as its files
    only, its weights loaded once the data stage is done: loaded first, they would hold the GPUs
    the data stage's vLLM engines start on (a 70B verifier: 35 GB of each of 4 GPUs)."""
    if recipe.features.backend == "vllm":
        from specctl.vllm.collect import load_collect_backend

        return load_collect_backend(recipe.verifier, vllm_log)
    if recipe.verifier.tensor_parallel_size > 1:
        return read_verifier_files(recipe.verifier)
    return load_verifier(recipe.verifier)


def _store_plan(
    verifier, aux_ids, layout: Layout, samples, origin: FeatureOrigin, shard_tokens: int
) -> StorePlan:
    lengths = [s["input_ids"].numel() for s in samples]
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
        origin=origin,
    )


class ClaimLost(Exception):
    """Our claim on the shard being computed was taken over (our lease ran out): drop the shard."""


@dataclass
class _Capture:
    """One worker's pass over the store: claim a shard, run the verifier over it in batches while
    renewing the claim's lease, write it, release it; repeat until every shard is done, waiting
    while the only ones left are held by live workers."""

    verifier: VerifierBackend
    recipe: Recipe
    aux_ids: tuple[int, ...]
    layout: Layout
    plan: StorePlan
    samples: list[dict[str, torch.Tensor]]
    claims: ShardClaims
    say: Callable[[str], None]
    done_tokens: int = 0
    written: list[int] = field(default_factory=list)
    _stack: ExitStack | None = None
    _forward: Callable | None = None  # the engine's forward, once started
    _claim: Claim | None = None  # the shard being computed
    _renewed: float = 0.0  # time.monotonic() of its last renewal
    _bar: Any = None
    _task: Any = None
    _counted: set[int] = field(default_factory=set)  # shards in the progress total
    _total: int = 0  # tokens in the progress total
    _loop_start: float = 0.0

    @property
    def path(self) -> Path:
        return self.recipe.run_dir / "features"

    def tokens(self, j: int) -> int:
        a, b = self.plan.shards[j]
        return sum(self.plan.lengths[a:b])

    def run(self, todo: list[int], own: list[int], progress: bool) -> None:
        """Work through `todo` (this worker's order), `own` first counted in the progress total."""
        poll_s = min(5.0, self.claims.lease_s / 10)
        with ExitStack() as stack:
            self._stack = stack
            self._bar = stack.enter_context(progress_bar("tok", enabled=progress))
            self._counted = set(own)
            self._total = sum(self.tokens(j) for j in own)
            self._task = self._bar.add_task("collect hidden states", total=self._total)
            waiting = False
            while pending := [j for j in todo if not shard_done(self.path, j)]:
                if self._round(pending):
                    waiting = False
                    continue
                if not waiting:
                    self.say(f"collect: waiting for {len(pending)} shard(s) other workers hold")
                    waiting = True
                time.sleep(poll_s)

    def _round(self, pending: list[int]) -> bool:
        """Try each pending shard once; whether this worker computed (or attempted) any."""
        took = False
        for j in pending:
            if shard_done(self.path, j) or not self.claims.available(j):
                continue
            self._start_engine()  # before claiming: a lease must not run out while an engine starts
            claim = self.claims.take(j)
            if claim is None:
                continue
            took = True
            self._claim, self._renewed = claim, time.monotonic()
            try:
                if not shard_done(self.path, j):  # written by another worker since our look
                    self._shard(j)
            finally:
                self.claims.release(self._claim)
                self._claim = None
        return took

    def _start_engine(self) -> None:
        if self._forward is None and self._stack is not None:
            self._forward = self._stack.enter_context(
                self.verifier.feature_forward(
                    self.aux_ids,
                    self.layout,
                    max_model_len=max(self.plan.lengths) + 1,
                    batch_tokens=self.recipe.features.batch_tokens,
                )
            )

    def _shard(self, j: int) -> None:
        if j not in self._counted:  # taken over: it joins this worker's total
            self._counted.add(j)
            self._total += self.tokens(j)
            self._bar.update(self._task, total=self._total)
        a, b = self.plan.shards[j]
        if self.done_tokens == 0:  # the warm-up estimate times the first batch from here
            self._loop_start = time.perf_counter()
        try:
            rows = self._forward(self.samples[a:b], self._advance)
            self._heartbeat(force=True)  # a fresh lease for the write, which may take a while
        except ClaimLost:
            self.say(f"collect: shard {j} was taken over by another worker (this one's lease ran out)")
            return
        write_shard(self.path, j, rows, self.layout)
        self.written.append(j)

    def _heartbeat(self, force: bool = False) -> None:
        """Renew the lease every quarter lease (and when `force`); ClaimLost once it is not ours."""
        if self._claim is None or not (force or time.monotonic() - self._renewed > self.claims.lease_s / 4):
            return
        renewed = self.claims.renew(self._claim)
        if renewed is None:
            raise ClaimLost(self._claim.shard)
        self._claim, self._renewed = renewed, time.monotonic()

    def _advance(self, n: int) -> None:
        """After each verifier batch: the warm-up estimate (first batch), progress, the heartbeat."""
        if self.done_tokens == 0:  # the first batch is the warm-up: the estimate from its speed
            seconds = time.perf_counter() - self._loop_start
            total = self._total
            eta = duration((total - n) * seconds / n) if n < total else "done"
            self.say(f"collect: warm-up {n / seconds:,.0f} tok/s -> ~{eta} for {human_count(total)} tokens")
        self.done_tokens += n
        self._bar.advance(self._task, n)
        self._heartbeat()
