"""The recipe: one YAML file, validated into typed sections. Every default lives here.

`docs/recipe.md` is generated from these models (`python -m specctl.recipe --markdown`)
and a test keeps it in sync, so the documented defaults are the ones the code uses.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic.fields import FieldInfo

from specctl.drafters import DEFAULT_ALGO, DRAFTERS
from specctl.errors import RecipeError, first_line
from specctl.redact import redact_tree

BUILTIN_RECIPES = Path(__file__).parent / "recipes"


class Section(BaseModel):
    # inf/nan pass `gt=0`-style bounds (lr: .inf is "positive"); no recipe field means them
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class VerifierSection(Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="Hub id, local HF model directory, or the built-in alias `smollm2-135m-instruct`.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) to load.")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "bfloat16-if-native"] = Field(
        "auto",
        description="`auto` = bfloat16 on CUDA, float32 on CPU (vLLM engines: bfloat16 unless the CPU "
        "would emulate it); `bfloat16-if-native` = bfloat16 on CUDA and on CPUs with AVX512-BF16 / AMX, "
        "float32 on CPUs that would emulate it (5-8x slower there).",
    )
    device: str = Field("auto", description="`auto` = cuda when available, else cpu; or any torch device.")
    trust_remote_code: bool = Field(
        False, description="Run model code shipped with the checkpoint (warns when on)."
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="GPUs one verifier spans, for a verifier too large for one GPU (Llama-3.3-70B in "
        "bf16: 141 GB). vLLM engines (data generation, `features.backend: vllm`, the vLLM benches) shard "
        "it with tensor parallelism, one engine per this many GPUs; the HF backend spreads its layers "
        "over this many GPUs (`device_map`). A torchrun rank r takes GPUs r*N..r*N+N-1. Needs GPUs: "
        "1 on a CPU.",
    )


class GenerateSection(Section):
    """Self-generated conversations (Magpie): the verifier writes the question, then answers."""

    num_conversations: int = Field(64, ge=1, description="How many conversations to generate.")
    user_max_new_tokens: int = Field(96, ge=1, description="Length cap of a generated user turn.")
    user_temperature: float = Field(1.0, gt=0, description="Sampling temperature for user turns.")
    user_top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling for user turns.")
    system_prompt: str | None = Field(
        None, description="System prompt placed before the user turn (None = the template's default)."
    )
    user_prefixes: list[str] = Field(
        default_factory=list,
        description="Text the first user turn of a conversation starts with, the verifier writing the "
        "rest; conversation i gets entry i mod n, `''` = unsteered. Sets the mix of the data toward what "
        "will be served, e.g. `['', 'Show me a Python script that', 'Word problem:']` for a third each "
        "of chat, code and math (repeat an entry to weight it). Empty = every conversation unsteered.",
    )
    batch_size: int = Field(8, ge=1, description="User turns per generate batch (`data.engine: hf`).")
    num_turns: int = Field(
        1,
        ge=1,
        description="User/answer exchanges per conversation: each user turn after the first is written "
        "by the verifier from the conversation so far (multi-turn Magpie); stops early at `data.max_length`.",
    )


class DataSection(Section):
    source: str = Field(
        "self-generated",
        description="`self-generated`, a local .json/.jsonl file, or a hub dataset id "
        "(UltraChat-style `messages`, ShareGPT-style `conversations`, or pre-tokenized "
        "`input_ids` + `loss_mask`).",
    )
    split: str = Field("train", description="Dataset split (hub datasets).")
    subset: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    max_samples: int | None = Field(None, ge=1, description="Use at most this many conversations.")
    max_length: int = Field(2048, ge=8, description="Token limit per conversation.")
    overlong: Literal["truncate", "skip"] = Field(
        "truncate", description="What to do with conversations longer than `max_length`."
    )
    shuffle: bool = Field(True, description="Shuffle the source before taking `max_samples`.")
    seed: int = Field(0, description="Seed for shuffling and sampling.")
    regenerate: bool = Field(False, description="Replace assistant turns with the verifier's own answers.")
    max_new_tokens: int = Field(
        256, ge=1, description="Length cap of an answer written by the verifier (generate/regenerate)."
    )
    temperature: float = Field(0.0, ge=0, description="Answer sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for answers.")
    batch_size: int = Field(8, ge=1, description="Answers per generate batch (`data.engine: hf`).")
    engine: Literal["auto", "hf", "vllm", "server"] = Field(
        "auto",
        description="What writes generated conversations: `vllm` = vLLM's offline engine in worker "
        "processes (one per GPU, or per `verifier.tensor_parallel_size` GPUs); `server` = running "
        "OpenAI-compatible servers at `server_url`; `hf` = batched HF generate in this process; `auto` = "
        "vllm when it is installed and can run the verifier here, else hf.",
    )
    server_url: str | list[str] | None = Field(
        None,
        description="Base URL for `engine: server`, e.g. http://127.0.0.1:8000, or a list of them: each "
        "request goes to the server with the fewest in flight, and a server that stops answering has its "
        "requests moved to the others (an API key, if the servers need one, is read from OPENAI_API_KEY).",
    )
    allow_key_over_http: bool = Field(
        False,
        description="Send OPENAI_API_KEY (and credentials written in `server_url`) over plain http to a "
        "host that is not loopback. Off: such a server_url is refused before any request; use https.",
    )
    server_model: str | None = Field(
        None,
        description="Name the servers serve the verifier under (None = the first of the first server's "
        "/v1/models).",
    )
    max_in_flight: int = Field(
        256, ge=1, description="Requests in flight per vLLM worker (its max_num_seqs), or to each server."
    )
    vllm_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra `vllm.LLM` arguments for `engine: vllm`, e.g. `{gpu_memory_utilization: 0.8, "
        "enable_chunked_prefill: false}` (GPUs per engine: `verifier.tensor_parallel_size`).",
    )
    generate: GenerateSection = Field(default_factory=GenerateSection)

    @field_validator("server_url")
    @classmethod
    def _urls(cls, url: str | list[str] | None) -> str | list[str] | None:
        urls = [url] if isinstance(url, str) else url or []
        if isinstance(url, list) and not url:
            raise ValueError(
                "an empty list; give one URL or a list of them, e.g. [http://h1:8000, http://h2:8000]"
            )
        for u in urls:
            if not u.strip().startswith(("http://", "https://")):
                raise ValueError(f"{u!r} is not an http(s) URL; write http://host:port")
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"{twice[0]} is listed twice; list each server once")
        return url

    @field_validator("vllm_args")
    @classmethod
    def _no_tensor_parallel(cls, args: dict[str, Any]) -> dict[str, Any]:
        if "tensor_parallel_size" in args:
            raise ValueError(
                "tensor_parallel_size is set once, for every stage, as verifier.tensor_parallel_size; "
                "move it there"
            )
        return args

    @property
    def server_urls(self) -> list[str]:
        """`server_url` as a list (one entry for a single URL, [] for none)."""
        url = self.server_url
        return [url] if isinstance(url, str) else list(url or [])

    @model_validator(mode="after")
    def _server_needs_url(self) -> DataSection:
        if self.engine == "server" and not self.server_urls:
            raise ValueError("data.engine is server: set data.server_url, e.g. http://127.0.0.1:8000")
        return self


class FeaturesSection(Section):
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Verifier layers to keep, HF `output_hidden_states` indices "
        "(0 = embeddings). None = (2, L//2, L-3).",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="On-disk dtype of the final hidden state (`target: hidden`) and of the aux layers "
        "unless `aux_dtype` says otherwise.",
    )
    aux_dtype: Literal["bfloat16", "float16", "float32", "fp8"] | None = Field(
        None,
        description="On-disk dtype of the aux layers; None = `dtype`. `fp8` = float8 e4m3 with one "
        "float32 scale per token and layer, dequantized to float32 when read (see docs/features.md).",
    )
    target: Literal["hidden", "topk"] = Field(
        "hidden",
        description="What stands for the verifier's output: `hidden` = its final hidden state (training "
        "applies norm + LM head); `topk` = its top-`topk` log-probs and ids plus the exact logsumexp "
        "over the full vocabulary (argmax exact, tokens outside the top k get probability 0).",
    )
    topk: int = Field(16, ge=1, description="k for `target: topk`.")
    batch_tokens: int = Field(8192, ge=1, description="Token budget of one verifier forward pass.")
    shard_tokens: int = Field(
        65536, ge=1, description="Tokens per safetensors shard (the unit of resume; held in memory once)."
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="Engine that runs the verifier.")
    claim_lease_s: float = Field(
        300.0,
        gt=0,
        description="Lease of a collect worker's claim on a shard, renewed between batches: a worker "
        "on another machine takes over a shard whose holder stopped renewing after this long (on the "
        "same machine, as soon as the holder's process is gone). Longer than one verifier batch "
        "plus one shard write.",
    )


def registered_algo(algo: str) -> str:
    """`algo` if a drafter of that name is registered; the one message for every recipe field
    that names an algorithm."""
    if algo not in DRAFTERS:
        raise ValueError(f"unknown algorithm {algo!r}; choose one of " + ", ".join(DRAFTERS))
    return algo


class DrafterSectionBase(Section):
    algo: str = Field(DEFAULT_ALGO, description="Algorithm to train: " + ", ".join(DRAFTERS) + ".")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="Keep only the N most frequent assistant tokens (None = full vocabulary)."
    )
    mask_token_id: int | None = Field(
        None,
        description="Mask token for parallel drafters; None = the tokenizer's mask token, "
        "else one id past the tokenizer's length.",
    )

    @field_validator("algo")
    @classmethod
    def _registered(cls, algo: str) -> str:
        """Checked in the schema, so a recipe built in code fails as early as one read from YAML."""
        return registered_algo(algo)


def _drafter_section() -> type[Section]:
    fields: dict[str, Any] = {
        name: (spec.config_cls, Field(default_factory=spec.config_cls, description=f"{name} settings."))
        for name, spec in DRAFTERS.items()
    }
    return create_model("DrafterSection", __base__=DrafterSectionBase, **fields)


DrafterSection = _drafter_section()


CUDA_DATA_WORKERS = 4  # train.data_workers None on CUDA: at most this many per rank


class TrainSettings(Section):
    """How one drafter trains; `TrainSection` adds the per-algorithm overrides."""

    mode: Literal["offline", "online"] = Field(
        "offline", description="offline = read the feature store; online = run the verifier in the loop."
    )
    loss: Literal["kl", "ce"] = Field(
        "kl", description="kl = match the verifier's distribution; ce = its next token."
    )
    max_steps: int = Field(1000, ge=1, description="Optimizer steps.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak.")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="LR decay after warmup.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon = Muon on 2-D weights, AdamW on the rest."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(1.0, ge=0, description="Max gradient norm (0 = off).")
    max_skipped_steps: int = Field(
        10,
        ge=1,
        description="A step whose gradients hold NaN/Inf (their norm is not finite) is skipped: no "
        "update, the learning rate moves on, counted as `skipped_steps` in metrics.jsonl. This many "
        "in a row stop the run, naming the step.",
    )
    batch_tokens: int = Field(8192, ge=1, description="Token budget of one micro-batch (per rank).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Most padded tokens in one forward/backward (per rank): a micro-batch of batch_tokens "
        "is split into pieces of at most this many whose gradients accumulate, so each step sees the "
        "data batch_tokens says while activations are one piece's. None = batch_tokens. A sample "
        "longer than it is a piece of its own. `specctl plan` prints the largest that fits.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each drafter layer's activations in the backward instead of keeping them "
        "(less memory per token, about a third more layer compute).",
    )
    data_workers: int | None = Field(
        None,
        ge=0,
        description="DataLoader processes per rank that read and pad micro-batches while the step "
        "computes (pinned memory on CUDA); the batches are the same with any number. None = 0 on CPU "
        f"(the step uses the cores) and on CUDA {CUDA_DATA_WORKERS}, or fewer when the rank's share of "
        "the CPUs is small.",
    )
    val_fraction: float = Field(0.05, ge=0, lt=1, description="Held-out share of samples.")
    seed: int = Field(0, description="Seed for the split, batching, anchors and init.")
    eval_every: int = Field(100, ge=1, description="Validate every N steps.")
    save_every: int = Field(500, ge=1, description="Checkpoint every N steps.")
    log_every: int = Field(10, ge=1, description="Log the training loss every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk.")
    precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Compute dtype of training matmuls (bf16 autocast keeps float32 master weights); "
        "auto = bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16 / AMX), else float32.",
    )
    parallelism: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Under torchrun: ddp replicates the drafter; fsdp (FSDP2) shards it across ranks."
    )
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = Field(
        "none",
        description="Experiment tracker that also gets every metrics.jsonl line (rank 0; accelerate's "
        "trackers; `pip install 'specctl[tensorboard]'` etc.). tensorboard writes "
        "drafters/<algo>/tensorboard/.",
    )


class _Override(Section):
    @model_serializer(mode="wrap")
    def _set_only(self, handler: Any) -> dict[str, Any]:
        """Only the settings an override sets: a dumped recipe shows `{max_steps: 1400}`, not every
        field as null."""
        return {k: v for k, v in handler(self).items() if v is not None}


def _optional(model: type[Section]) -> type[Section]:
    """`model`'s fields, each optional with default None (= keep the base value), its bounds kept:
    an override is checked like the setting it replaces, at its own place in the recipe."""
    fields: dict[str, Any] = {
        name: (f.annotation | None, FieldInfo.merge_field_infos(f, default=None))
        for name, f in model.model_fields.items()
    }
    return create_model(f"{model.__name__}Override", __base__=_Override, **fields)


TrainOverride = _optional(TrainSettings)


class TrainSection(TrainSettings):
    collective_timeout_minutes: float = Field(
        60.0,
        gt=0,
        description="Under torchrun: how long a rank waits in one collective (a gradient all-reduce, "
        "the check that rank 0 wrote a checkpoint) before the run stops with an error. torch's default "
        "is 10 minutes on NCCL, which rank 0 writing and hashing a large checkpoint can exceed. Rank 0's "
        "hours-long work (downloading the verifier, the online data stage) is waited for outside any "
        "collective, so it is not bounded by this.",
    )
    per_algo: dict[str, TrainOverride] = Field(  # type: ignore[valid-type]
        default_factory=dict,
        description="Settings for one algorithm in place of the ones above, e.g. `{dflash: {max_steps: "
        "1400}}`: drafters whose steps cost differently can get about the same training time in one "
        "recipe. `specctl train --algo A` trains with `per_algo[A]` applied.",
    )

    @field_validator("per_algo")
    @classmethod
    def _registered(cls, per_algo: dict[str, Any]) -> dict[str, Any]:
        for algo in per_algo:
            registered_algo(algo)
        return per_algo

    def for_algo(self, algo: str) -> TrainSection:
        """These settings as `algo` trains with them: its `per_algo` entry over the shared ones."""
        over = self.per_algo.get(algo)
        if over is None:
            return self
        return self.model_copy(update=over.model_dump(exclude_none=True))


class ExportSection(Section):
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Weights dtype.")


LinearKernel = Literal["auto", "torch", "onednn-prepacked"]
VerifyAttention = Literal["exact", "batched"]  # bench.verify_attention: rows one by one, or in one call
AdaptiveMode = Literal["off", "on", "both"]  # bench.adaptive: fixed K only, adaptive only, side by side


def cli(*flags: str, metavar: str | None = None) -> dict[str, Any]:
    """A field's command-line spelling, where it is not `--field-name` (specctl.cli_schema reads
    it when it generates a command's options from a section): other flag names, a metavar.
    `cli()` with no flag: the command declares the option itself (its type differs from the
    field's, e.g. a list of levels for one setting) and applies it to the settings."""
    return {"cli": {"flags": list(flags), "metavar": metavar}}


COMMAND_DECLARES = cli()  # not generated: the command has its own option for this field


def cli_spelling(name: str, f: FieldInfo) -> tuple[tuple[str, ...], str | None]:
    """(flags, metavar) of field `name` on the command line: its own (`cli`), else `--field-name`;
    no flags when the command declares the option itself (COMMAND_DECLARES)."""
    extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
    spelling = extra.get("cli")
    if not isinstance(spelling, dict):
        return (f"--{name.replace('_', '-')}",), None
    return tuple(spelling["flags"]), spelling["metavar"]


def flag_of(model: type[BaseModel], name: str) -> str:
    """The flag an error about field `name` names: `--confidence-threshold` for
    confidence_thresholds, `--repeats` as it is (one of repeats' two spellings)."""
    plain = f"--{name.replace('_', '-')}"
    f = model.model_fields.get(name)
    flags = cli_spelling(name, f)[0] if f is not None else ()
    return plain if not flags or plain in flags else flags[0]


@dataclass(frozen=True)
class Sampling:
    """How every request of a benchmark samples: the one value the embedded engine, the vLLM
    engine options and the HTTP client read (BenchSection.sampling), rather than copies."""

    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    seed: int  # prompt i is sampled with seed + i

    def prompt_seed(self, index: int) -> int:
        return self.seed + index


# The backends' names and capabilities are their specs' (specctl.bench.backends). The recipe sits
# below bench, so it names them here: tests/test_backends.py holds the Literal equal to the specs
# picked by --backend, and VLLM_BACKENDS (read by specctl.resources, below bench, to plan a
# bench's memory) equal to those whose spec is vllm_measured.
VLLM_BACKENDS = ("vllm", "vllm-offline")  # the backends that start the installed vLLM


class BenchSection(Section):
    backend: Literal["embedded", "vllm", "vllm-offline"] = Field(
        "embedded",
        description="`embedded` engine, a vLLM server per method (`vllm`), or vLLM's offline LLM "
        "(`vllm-offline`).",
    )
    dataset: str = Field(
        "builtin",
        description="`builtin`, mt-bench, humaneval, gsm8k, spec-bench, `speed-bench` (its local "
        "directory: SPEED_BENCH_DIR, or the directory itself), a hub dataset id, or a .jsonl/.json file "
        "(messages, ShareGPT conversations, prompt or turns rows).",
    )
    dataset_split: str | None = Field(
        None,
        description="Split of a hub dataset (default train) or SPEED-Bench subset (default qualitative).",
    )
    dataset_subset: str | None = Field(None, description="Configuration name of a hub dataset.")
    dataset_column: str | None = Field(
        None, description="Column holding the prompt text or the chat turns (default: recognised by name)."
    )
    num_prompts: int = Field(16, ge=1, description="Prompts per method.")
    max_new_tokens: int = Field(128, ge=1, description="Output tokens per prompt.")
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    concurrency: int = Field(
        1,
        ge=1,
        description="Concurrent requests (vLLM backend). With `request_rate`, the most in flight when "
        "set here or by --concurrency (vllm bench serve's --max-concurrency), else every prompt.",
        json_schema_extra=COMMAND_DECLARES,  # `bench --concurrency 1,4,16`: a level each
    )
    request_rate: list[Annotated[float, Field(gt=0, allow_inf_nan=True)]] = Field(
        default_factory=list,
        description="Server backends (vllm, base_url): requests arrive as a Poisson process at each "
        "rate, requests/s (`inf`: all at once), seeded by `seed`, as `vllm bench serve --request-rate`; one "
        "sweep level per rate, each with TTFT, TPOT and ITL percentiles. Empty: a closed loop at "
        "`concurrency`.",
        json_schema_extra=cli("--request-rate", metavar="R,..."),
    )
    repeats: int | None = Field(
        None,
        ge=1,
        description="Rounds over all prompts (`bench --repeat R`). Each figure is the median over "
        "rounds with a 95% interval from a bootstrap over the (prompt, round) cells, paired for "
        "speedups. The embedded backend interleaves methods round by round, the order rotated "
        "each round; vllm, vllm-offline and a --base-url server repeat inside each configuration's "
        "engine (its passes not interleaved with other methods'; --engine-rounds interleaves "
        "engines). Unset: 3 when "
        "one round decodes at most 4096 tokens (prompts x max_new_tokens x configurations x "
        "concurrency levels), else 1. On a shared CPU a slow spell moved one pass by 20-40%.",
        json_schema_extra=cli("--repeat", "--repeats"),
    )
    engine_rounds: int = Field(
        1,
        ge=1,
        description="vllm / vllm-offline: split the prompts into this many rounds; every configuration "
        "measures each round in an engine of its own, in reverse order every other round, so a "
        "slow spell of a shared machine is spread over the configurations instead of falling on "
        "whichever ran then. Costs an engine start per configuration per round.",
    )
    seed: int = Field(0, description="Sampling seed (prompt i uses seed + i).")
    require: list[str] = Field(
        default_factory=list,
        description="Thresholds such as `dflash.acceptance_length>=2.5`; `lossless` fails the run on any "
        "output that leaves plain decoding's other than at a near-tie (greedy runs).",
        json_schema_extra=COMMAND_DECLARES,  # `bench --require` (repeatable) adds to the recipe's
    )
    confidence_thresholds: list[float] = Field(
        default_factory=list,
        description="Dynamic draft length for drafters with a confidence head (DSpark): verify only "
        "the drafts whose running product of confidences stays >= T. Several values are swept, "
        "beside each drafter's fixed K. Embedded backend only.",
        json_schema_extra=cli("--confidence-threshold", metavar="T,..."),
    )
    adaptive: AdaptiveMode = Field(
        "off",
        description="Adaptive verification (`bench --adaptive`): each step verifies only the drafts "
        "likely to be accepted. `on` measures each drafter adaptive instead of at a fixed K, `both` "
        "side by side with its fixed K (a sweep: the report compares them per concurrency). vLLM "
        "backends pass speculative_config enable_adaptive_verification (vLLM on a GPU, >= 0.32); the "
        "embedded engine cuts at `adaptive_threshold`, DSpark by its confidence head, other drafters "
        "by vLLM's acceptance estimator on their logits.",
    )
    adaptive_threshold: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="Embedded engine, adaptive verification: verify the drafts whose estimated "
        "survival (running product of per-draft acceptance probabilities) stays >= this. Low: a "
        "draft is worth verifying while its survival beats what one more verified row costs as a "
        "share of a step (about 0.02-0.08 on a CPU); DSpark's T 0.1 beat 0.2 and 0.4 "
        "(docs/benchmarking.md).",
    )
    tree_nodes: list[Annotated[int, Field(ge=1, le=31)]] = Field(
        default_factory=list,
        description="Draft trees (`bench --tree N,...`, embedded backend): each drafter is also measured "
        "verifying, per pass, a tree of at most N nodes instead of its argmax chain -- the best tree of "
        "a parallel drafter's (DFlash, DSpark, P-EAGLE) block distributions, EAGLE-3's top-k expansion "
        "-- as a method of its own named `<name>-treeN` beside the chain; the recommendation takes a "
        "tree over the drafter's best chain only where it is faster beyond noise. At most 31 nodes: a "
        "verify of 32 rows stays bit-identical to plain decoding.",
        json_schema_extra=cli("--tree", metavar="N,..."),
    )
    verify_attention: VerifyAttention = Field(
        "exact",
        description="The embedded engine's attention over a verify's rows (a chain's K+1, a tree's 1+N): "
        "`exact` = each row as its own one-row call over the keys it sees, bit-identical to plain "
        "decoding; `batched` = the block in one call with its causal or tree mask, as vLLM on a GPU: "
        "cheaper per row, but bf16 greedy outputs may leave plain decoding's at near-ties (the "
        "report's `= plain` and divergences say where; docs/benchmarking.md).",
    )
    linear_kernel: LinearKernel = Field(
        "auto",
        description="The embedded engine's matmul kernel, the same in every forward (plain decoding, "
        "verification, drafters): `torch` = F.linear; `onednn-prepacked` = oneDNN with each weight "
        "reordered once (CPU); `auto` = prepacked for a float32 engine on a CPU, where F.linear (MKL) "
        "measured 2x slower at 1-4 rows, else F.linear (docs/performance.md).",
    )
    base_url: str | None = Field(
        None,
        description="Bench an OpenAI-compatible server that is already running (`http://host:port`) "
        "instead of `backend`: nothing is started; acceptance from its /metrics when it is vLLM.",
        json_schema_extra=COMMAND_DECLARES,  # `bench --base-url URL`, normalized before use
    )
    allow_key_over_http: bool = Field(
        False,
        description="Send OPENAI_API_KEY (and credentials written in `base_url`) over plain http to a "
        "host that is not loopback. Off: such a base_url is refused before any request; use https.",
    )
    ready_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds a vLLM server may take to start (load the weights, answer /health) "
        "before its configuration counts as failed.",
    )

    @property
    def sampling(self) -> Sampling:
        """The sampling part, as one value: what every backend's requests carry."""
        return Sampling(self.max_new_tokens, self.temperature, self.top_p, self.seed)


RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def check_run_name(name: str) -> str:
    """`name` if it names one directory inside output_dir, else ValueError saying what is allowed.
    `.`, `..`, a separator or a leading dot would put runs/<name>/data (which the data stage
    replaces) somewhere else: `--set name=..` made it ./data, a user's directory."""
    if not RUN_NAME.fullmatch(name):
        raise ValueError(
            f"run name {name!r} not allowed: use letters, digits, '.', '_' and '-', not starting "
            "with '.' (no '.', '..' or path separators: the name is one directory under output_dir)"
        )
    return name


class Recipe(Section):
    name: str = Field(
        ...,
        description="Run name: outputs go to runs/<name>/. Letters, digits, `.`, `_` and `-`, not "
        "starting with `.` (so never `.`, `..` or a path).",
    )
    output_dir: str = Field("runs", description="Parent directory of run directories (any path).")
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    data: DataSection = Field(default_factory=DataSection)
    features: FeaturesSection = Field(default_factory=FeaturesSection)
    drafter: DrafterSection = Field(default_factory=DrafterSection)  # type: ignore[valid-type]
    train: TrainSection = Field(default_factory=TrainSection)
    export: ExportSection = Field(default_factory=ExportSection)
    bench: BenchSection = Field(default_factory=BenchSection)

    @field_validator("name")
    @classmethod
    def _run_name(cls, name: str) -> str:
        return check_run_name(name)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def for_training(self) -> Recipe:
        """The recipe `specctl train` runs: `train` as `drafter.algo` trains (its `per_algo` entry
        applied), so the loop, its checkpoints and their saved recipe.yaml see one set of settings."""
        return self.model_copy(update={"train": self.train.for_algo(self.drafter.algo)})


# ---------------------------------------------------------------- loading


def _exists(path: Path) -> bool:
    """Path.exists, False for names the OS refuses (too long, ...): _read_yaml then says why."""
    try:
        return path.exists()
    except OSError:
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names a key twice: YAML would keep the last value silently."""

    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader (what yaml.safe_load uses: plain types only) that refuses a key given twice
    in one mapping, with both line numbers; PyYAML itself keeps the last value silently."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may repeat keys on purpose
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line)
            except TypeError:  # an unhashable key: SafeLoader says so below
                continue
            if first != key_node.start_mark.line:
                raise DuplicateKeyError(key, first + 1, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)


def _safe_load_unique(text: str) -> Any:
    """yaml.safe_load, refusing duplicate keys (the same steps as yaml.load with the loader)."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        names = builtin_recipe_names()
        close = difflib.get_close_matches(path.stem, names, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise RecipeError(
            f"{path}: recipe not found; {hint}pass a YAML file or a built-in recipe: {', '.join(names)}"
        ) from None
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file; a recipe is UTF-8 YAML") from None
    except ValueError:  # a NUL in the name
        raise RecipeError(f"{str(path)!r}: not a valid file name") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read the recipe ({e.strerror or type(e).__name__})") from None
    try:
        data = _safe_load_unique(text)
    except DuplicateKeyError as e:
        raise RecipeError(
            f"{path}:{e.line}: duplicate key {e.key!r} (first at line {e.first_line}); "
            "keep one, YAML would silently use the last"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or first_line(str(e)) or type(e).__name__
        raise RecipeError(f"{path}{where}: not valid YAML ({problem})") from None
    except RecursionError:
        raise RecipeError(f"{path}: YAML nested too deeply; a recipe is a few levels of sections") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    return data


def builtin_recipe_names() -> list[str]:
    """The recipes shipped with specctl, by the name `specctl train NAME` takes."""
    return sorted(p.stem for p in BUILTIN_RECIPES.glob("*.yaml"))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _load_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a recipe and the recipes it `extends` (paths relative to the file)."""
    path = path.resolve() if _exists(path) else path
    if path in seen:
        raise RecipeError(f"{path}: `extends` forms a cycle")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise RecipeError(f"{path}: extends: expected a path to another recipe")
    target = _parent_path(path, parent)
    return _merge(_load_tree(target, (*seen, path)), data)


def _parent_path(path: Path, parent: str) -> Path:
    """What `extends: parent` in `path` names: a file relative to `path`, else a built-in recipe
    name as the CLI takes it (`extends: quickstart`)."""
    target = path.parent / parent
    if _is_file(target):
        return target
    builtin = _builtin_path(parent)
    if "/" not in parent and _is_file(builtin):
        return builtin
    raise RecipeError(
        f"{path}: extends: {target} not found; give a path relative to this file or a built-in recipe "
        f"({', '.join(builtin_recipe_names())})"
    )


def _printable(text: str) -> str:
    """`text`, with line breaks and other control characters escaped: messages stay one line."""
    return text if text.isprintable() else repr(text)[1:-1]


def _set(tree: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise RecipeError(f"--set {assignment!r}: expected key=value, e.g. --set train.lr=3e-4")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"--set {key!r}: empty field name; write section.field, e.g. train.lr")
    where = f"--set {_printable(key.strip())}"
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise RecipeError(f"{where}: value nested too deeply") from None
    node = tree
    for p in parts[:-1]:
        if not isinstance(node.get(p, {}), dict):
            raise RecipeError(f"{where}: {_printable(p)} is not a section")
        node = node.setdefault(p, {})
    node[parts[-1]] = value


def _describe(err: dict[str, Any]) -> str:
    """One pydantic error as `section.field: problem (got value)`, on one line whatever the value."""
    loc = ".".join(_printable(str(p)) for p in err["loc"] if not str(p).startswith("function-"))
    loc = loc or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        close = suggest_key(tuple(str(p) for p in err["loc"]))
        return f"{loc}: unknown key" + (f"; did you mean {close}?" if close else "")
    if kind == "missing":
        return f"{loc}: required field is missing"
    if kind == "value_error":  # our own validators: their message already says what and why
        return f"{loc}: {' '.join(str(err['ctx']['error']).split())}"
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{loc}: {' '.join(err['msg'].split())} (got {got})"


# names other trainers give these fields (transformers' TrainingArguments, SpecForge's flags):
# an unknown key that is one of them is pointed at specctl's field
KEY_ALIASES = {
    "learning_rate": "lr",
    "lr_scheduler_type": "schedule",
    "scheduler": "schedule",
    "warmup": "warmup_steps",
    "gradient_accumulation_steps": "grad_accum",
    "max_grad_norm": "grad_clip",
    "num_steps": "max_steps",
}


def _section_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Recipe
    names = iter(path)
    for name in names:
        field = model.model_fields.get(name)
        ann = field.annotation if field is not None else None
        if get_origin(ann) is dict:  # keyed sections (train.per_algo.<algo>): step over the key
            ann = get_args(ann)[1] if next(names, None) is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def suggest_key(loc: tuple[str, ...]) -> str | None:
    """The recipe field an unknown key most likely meant (`train.learning_rate` -> `train.lr`)."""
    section = _section_at(loc[:-1])
    if section is None or not loc:
        return None
    names = list(section.model_fields)
    wanted = KEY_ALIASES.get(loc[-1])
    close = [wanted] if wanted in names else difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.6)
    return ".".join([*loc[:-1], close[0]]) if close else None


def recipe_from_dict(
    tree: dict[str, Any], source: str = "<recipe>", overrides: dict[tuple[str, ...], str] | None = None
) -> Recipe:
    """Validate a recipe tree. An error at a path a --set override wrote (`overrides`: path ->
    the assignment) is blamed on that flag, not on the file."""
    try:
        return Recipe.model_validate(tree)
    except ValidationError as e:
        # a typo'd key first: `nme: x` would otherwise read as "name: required field is missing"
        errors = sorted(e.errors(), key=lambda err: err["type"] != "extra_forbidden")
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        loc = tuple(str(p) for p in errors[0]["loc"])
        for path, assignment in (overrides or {}).items():
            n = min(len(path), len(loc))
            if path[:n] == loc[:n]:
                source = f"--set {_printable(assignment)}"
        raise RecipeError(f"{source}: {_describe(errors[0])}{more}") from None


def resolved_tree(
    path: str | Path, overrides: list[str] | tuple[str, ...] = ()
) -> tuple[Path, dict[str, Any]]:
    """A recipe file (or built-in name) read, its `extends` chain merged, the --set overrides
    applied: the tree `load_recipe` validates, and the path it came from."""
    path = resolve_recipe_path(path)
    tree = _load_tree(path)
    for assignment in overrides:
        _set(tree, assignment)
    return path, tree


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file (or a built-in recipe name such as `quickstart`) with --set overrides."""
    path, tree = resolved_tree(path, overrides)
    written = {}
    for assignment in overrides:
        key = assignment.partition("=")[0].strip()
        written[tuple(key.split("."))] = assignment
    return recipe_from_dict(tree, str(path), written)


def resolve_recipe_path(path: str | Path) -> Path:
    """A path as given, else a recipe shipped with specctl (`quickstart` -> recipes/quickstart.yaml)."""
    p = Path(path)
    if _exists(p):
        return p
    builtin = _builtin_path(p.name)
    return builtin if _exists(builtin) else p


def _builtin_path(name: str) -> Path:
    """Where the built-in recipe `name` (`quickstart` or `quickstart.yaml`) would be."""
    return BUILTIN_RECIPES / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")  # llama-3.1-8b


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    """`key: old -> new` for each setting that differs between two nested settings dicts (at most
    three, then `+N more`): the one-line "what changed" of every refusal to reuse stale work."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    parts = [f"{k}: {_short(a.get(k))} -> {_short(b.get(k))}" for k in keys[:3]]
    return ", ".join(parts) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "") or "format changed"


def _non_default(model: BaseModel, default: BaseModel | None = None) -> dict[str, Any]:
    """`model`'s fields that a recipe must state to rebuild it: the required ones and those whose
    value differs from the default (`default`'s, where this section has a default instance, else
    the schema's); sections recursed into. JSON values, as dump_recipe writes them."""
    dumped = model.model_dump(mode="json")
    out: dict[str, Any] = {}
    for name, f in type(model).model_fields.items():
        value = getattr(model, name)
        if default is not None:
            base = getattr(default, name)
        else:
            base = None if f.is_required() else f.get_default(call_default_factory=True)
        if isinstance(value, BaseModel) and isinstance(base, BaseModel):
            sub = _non_default(value, base)
            if sub:
                out[name] = sub
        elif f.is_required() or value != base:
            out[name] = dumped[name]
    return out


def dump_recipe_diff(recipe: Recipe) -> str:
    """Only what `recipe` sets apart from the defaults, as YAML: a short recipe that loads back to
    the same settings (`specctl recipe show --diff`). Credentials masked as in dump_recipe."""
    return yaml.safe_dump(redact_tree(_non_default(recipe)), sort_keys=False)


def builtin_recipe_summaries() -> list[tuple[str, str]]:
    """(name, description) of each built-in recipe: the description is the file's first comment
    line, so `specctl recipe list` says what each header already says."""
    rows = []
    for name in builtin_recipe_names():
        lines = (BUILTIN_RECIPES / f"{name}.yaml").read_text().splitlines()
        first = next((line for line in lines if line.startswith("#")), "")
        rows.append((name, first.lstrip("#").strip()))
    return rows


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML, as every file that records it (checkpoints' recipe.yaml, provenance)
    writes it: credentials in its URLs masked (specctl.redact); the object keeps them."""
    return yaml.safe_dump(redact_tree(recipe.model_dump(mode="json")), sort_keys=False)


# ---------------------------------------------------------------- docs


def _field_rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(_field_rows(ann, f"{prefix}{name}."))
            continue
        default = "*required*" if f.is_required() else f"`{_default_repr(f)}`"
        type_name = _type_name(ann)
        rows.append(f"| `{prefix}{name}` | {type_name} | {default} | {f.description or ''} |")
    return rows


def _type_name(ann: Any) -> str:
    if get_origin(ann) is dict:  # keyed sections: the value model by its name, not its module path
        key, value = get_args(ann)
        return f"dict[{key.__name__}, {value.__name__}]"
    return str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _default_repr(f: Any) -> str:
    value = f.get_default(call_default_factory=True)
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip() or "''"


def recipe_reference_markdown() -> str:
    """The recipe reference page, generated from the schema above."""
    lines = [
        "# Recipe reference",
        "",
        "Generated from `specctl/recipe.py` by `python -m specctl.recipe --markdown`; "
        "`tests/test_recipe.py` fails when this page and the schema disagree.",
        "",
        "A recipe may start with `extends: other.yaml` (a path relative to it, or a built-in recipe "
        "name such as `quickstart`; `specctl recipe list` lists them) and override any field; "
        "`--set section.field=value` overrides on the command line; `specctl recipe show --diff` "
        "prints only what a recipe sets apart from these defaults.",
        "",
        "| field | type | default | meaning |",
        "|---|---|---|---|",
    ]
    lines.extend(_field_rows(Recipe, ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--markdown" in sys.argv:
        sys.stdout.write(recipe_reference_markdown())
