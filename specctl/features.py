"""The feature store: the verifier's hidden states on disk, sharded, checksummed, resumable.

Layout of a store directory (see docs/features.md):
    plan.json                 what this store holds and how it is split (written first)
    shard-00000.safetensors   samples concatenated along tokens (no padding on disk)
    shard-00000.json          sidecar: sha256 + size of the shard; written after the shard
    manifest.json             written once every shard is done: the store is complete

What a shard holds for the verifier's output depends on the store's `Layout` (recorded in
plan.json and manifest.json, so a store is always read the way it was written): its final hidden
state, or its top-k log-probs + the exact logsumexp; aux layers in a float dtype, or fp8 with one
scale per token and layer. Stores written before layouts existed read as the full-precision one.

A shard file is written to a temporary name and renamed, and its sidecar is written the same
way afterwards, so a process killed at any moment leaves either a finished shard or nothing
that reads as one. Which worker computes which shard is collect's business (shard claims,
specctl/collect/claims.py); whoever finds every shard done first writes the manifest, once, so the
reader always sees one store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from specctl.drafters.targets import verifier_topk
from specctl.durable import ForeignAlive, Owner, create_once, recover_dirs, sha256_file, write_atomic
from specctl.errors import FeatureStoreError
from specctl.origin import FeatureOrigin, check_origin

FORMAT_VERSION = 1
# plan.json is written first, when collect creates the store (manifest.json last): a non-empty
# directory at runs/<name>/features with neither is a user's, and collect writes nothing into it
OWNER = Owner(
    "collect-hidden-states",
    ("plan.json", "manifest.json"),
    "choose another run name or output_dir, or move those files away",
)
TENSOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8 = "fp8"  # aux_dtype: float8 e4m3 + one float32 scale per row
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: a row's largest |x| maps here
# what a sample may carry besides input_ids / loss_mask, as the reader returns it
FEATURE_KEYS = (
    "aux_hidden_states",
    "last_hidden_state",
    "target_argmax",
    "topk_ids",
    "topk_logprobs",
    "logsumexp",
)
# what a sample carries besides input_ids / loss_mask as a shard stores it (`FeatureStore.row`)
STORED_KEYS = (*FEATURE_KEYS, "aux_scale")


@dataclass(frozen=True)
class Layout:
    """How a store encodes the verifier's output on disk (recipe: features.dtype/aux_dtype/target/topk).

    target "hidden": last_hidden_state [T, H] in `dtype`; training forms the logits itself.
    target "topk": topk_ids [T, k] (uint16 when every id fits, else int32), topk_logprobs [T, k]
    float16 (descending; log-probs, not logits, so the entries holding the mass are the precise
    ones) and logsumexp [T] float32 over the full vocabulary: argmax, logsumexp and the kept
    log-probs are what the full logits give; the rest of the distribution is dropped.
    aux_dtype "fp8": aux_hidden_states [T, n_aux, H] float8_e4m3fn and aux_scale [T, n_aux]
    float32, x ~= q * scale (`quantize_fp8`).
    target_stats (target "hidden"): also target_argmax [T] int32 and logsumexp [T] float32 of
    the verifier's logits over the full vocabulary, formed at collect time from the
    full-precision state. Training then never forms [rows, V] logits for them: with a draft
    vocabulary it reads only the kept columns (8 bytes a token buy most of a CPU training step).
    """

    dtype: str = "bfloat16"  # last_hidden_state, and aux unless aux_dtype says otherwise
    aux_dtype: str = "bfloat16"  # a TENSOR_DTYPES name or "fp8"
    target: str = "hidden"  # "hidden" | "topk"
    topk: int = 0  # k when target is "topk", else 0
    target_stats: bool = False  # hidden: argmax + logsumexp stored too (stores before them: False)

    @classmethod
    def from_section(cls, features: Any) -> Layout:
        """The layout a recipe's `features` section asks for (aux_dtype None = dtype); new hidden
        stores keep the target statistics."""
        topk = features.topk if features.target == "topk" else 0
        hidden = features.target == "hidden"
        return cls(features.dtype, features.aux_dtype or features.dtype, features.target, topk, hidden)

    @property
    def needs_head(self) -> bool:
        """Whether collecting this layout forms the verifier's logits (its norm + LM head)."""
        return self.target == "topk" or self.target_stats

    def stored_keys(self) -> list[str]:
        """The STORED_KEYS a shard of this layout holds for each token."""
        keys = ["aux_hidden_states"] + (["aux_scale"] if self.aux_dtype == FP8 else [])
        if self.target == "topk":
            return [*keys, "topk_ids", "topk_logprobs", "logsumexp"]
        return [*keys, "last_hidden_state"] + (["target_argmax", "logsumexp"] if self.target_stats else [])

    def settings(self) -> dict[str, Any]:
        """The settings that change what is on disk, in the order a mismatch is reported.

        `dtype` only counts when something is stored in it, so a top-k + fp8 store does not
        clash with a recipe whose (unused) dtype differs. `target_stats` never counts: a store
        without them trains the same, forming the statistics when a step needs them.
        """
        out: dict[str, Any] = {"target": self.target}
        if self.target == "topk":
            out["topk"] = self.topk
        if self.target == "hidden" or self.aux_dtype != FP8:
            out["dtype"] = self.dtype  # before aux_dtype: it sets both when aux_dtype is None
        out["aux_dtype"] = self.aux_dtype
        return out


def layout_bytes_per_token(layout: Layout, hidden_size: int, num_aux: int, vocab_size: int) -> int:
    """Bytes a token costs on disk in `layout` (per-sample offsets and shard headers aside).

    input_ids int32 + loss_mask uint8, then the aux layers, then the target: the full layout is
    (n_aux + 1) * H * 2 + 5 in bf16; fp8 aux + top-16 is n_aux * (H + 4) + 16 * (2 + 2|4) + 4 + 5.
    """
    H = hidden_size
    total = 4 + 1
    if layout.aux_dtype == FP8:
        total += num_aux * (H + 4)  # one float32 scale per layer
    else:
        total += num_aux * H * TENSOR_DTYPES[layout.aux_dtype].itemsize
    if layout.target == "topk":
        k = min(layout.topk, vocab_size)
        total += k * (2 + (2 if vocab_size <= 2**16 else 4)) + 4
    else:
        total += H * TENSOR_DTYPES[layout.dtype].itemsize + (8 if layout.target_stats else 0)
    return total


@dataclass
class TargetHead:
    """The verifier's frozen final norm and LM head in float32, for top-k targets at collect time.

    Float32 once, here: `verifier_logits` would otherwise up-cast the [V, H] head per chunk.
    """

    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    eps: float


def encode_features(
    aux: torch.Tensor, last: torch.Tensor, layout: Layout, head: TargetHead | None
) -> dict[str, torch.Tensor]:
    """One row per token: aux [N, n_aux, H], last [N, H] (pre-norm) -> what a shard stores for them.

    aux: aux_hidden_states in `layout.aux_dtype`, or fp8 + aux_scale [N, n_aux]. Target: the
    final state in `layout.dtype` (with target_stats also target_argmax / logsumexp [N]), or
    topk_ids / topk_logprobs [N, k] + logsumexp [N] from its logits (`head` needed for both).
    Runs on the inputs' device; the float16 / id casts happen in write_shard.
    """
    out: dict[str, torch.Tensor] = {}
    if layout.aux_dtype == FP8:
        out["aux_hidden_states"], out["aux_scale"] = quantize_fp8(aux)
    else:
        out["aux_hidden_states"] = aux.to(TENSOR_DTYPES[layout.aux_dtype])
    if layout.needs_head:
        if head is None:
            raise ValueError("a top-k or target-statistics layout needs the verifier's norm and LM head")
        ids, logprobs, logsumexp = verifier_topk(
            last, head.norm.to(last.device), head.lm_head.to(last.device), head.eps, max(layout.topk, 1)
        )
        if layout.target == "topk":
            out.update(topk_ids=ids, topk_logprobs=logprobs, logsumexp=logsumexp)
        else:
            out.update(target_argmax=ids[:, 0], logsumexp=logsumexp)
    if layout.target == "hidden":
        out["last_hidden_state"] = last.to(TENSOR_DTYPES[layout.dtype])
    return out


def check_layout(path: Path, have: Layout, want: Layout) -> None:
    """One-line error when a store (`have`) was collected with other features settings than `want`."""
    a, b = have.settings(), want.settings()
    for k in dict.fromkeys([*a, *b]):
        if a.get(k) != b.get(k):
            raise FeatureStoreError(
                f"{path}: the features were collected with features.{k}={a.get(k)} but the recipe has "
                f"features.{k}={b.get(k)}; re-run collect-hidden-states or set features.{k}={a.get(k)}"
            )


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> q [..., H] float8_e4m3fn, scale [...] float32, with x ~= q * scale per row.

    One scale per row (a token's state at one layer): the residual stream's few huge channels
    differ in size from token to token and layer to layer, and one scale for a whole tensor
    would push every small row into e4m3's coarse subnormals. The row's largest |x| maps to 448,
    so nothing saturates. Error: |x - q * scale| <= |x| / 16 + scale / 1024 (3 mantissa bits,
    subnormal step 2^-9), plus float32 rounding. An all-zero row gets scale 1.
    """
    x = x.float()
    amax = x.abs().amax(-1)  # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [...]
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [..., H]
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., H] float8_e4m3fn, scale [...] -> [..., H] in `dtype` (float32: what training computes in)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def decode_features(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored rows (a sample, or a padded batch [B, T, ...]) -> the form training reads: fp8 aux
    states dequantized to float32 (aux_scale dropped), top-k ids / argmax int64, top-k log-probs and
    logsumexp float32; everything else as it is.

    Elementwise, so it gives the same values on any device and before or after padding (a padded
    row is 0 * scale 0 = 0). Training runs it after the batch crossed to the GPU: fp8 crosses as
    1 byte an element instead of 4, uint16 ids as 2 instead of 8.
    """
    out = dict(rows)
    scale = out.pop("aux_scale", None)
    if scale is not None:
        out["aux_hidden_states"] = dequantize_fp8(out["aux_hidden_states"], scale)
    for key in ("topk_ids", "target_argmax"):
        if key in out:
            out[key] = out[key].long()
    for key in ("topk_logprobs", "logsumexp"):
        if key in out:
            out[key] = out[key].float()
    return out


def all_finite(t: torch.Tensor) -> bool:
    """Whether a stored tensor holds no NaN/Inf (torch has no isfinite for float8_e4m3fn: it has no
    Inf, and its NaN is the bit pattern S1111111)."""
    if t.dtype == torch.float8_e4m3fn:
        return not bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return not t.is_floating_point() or bool(torch.isfinite(t).all())


@dataclass
class StorePlan:
    """Everything that identifies a store; resuming with a different plan is refused."""

    verifier: str
    verifier_config_hash: str
    num_layers: int
    hidden_size: int
    aux_layer_ids: list[int]
    dtype: str
    data_hash: str
    lengths: list[int]  # tokens per sample, in store order
    shards: list[list[int]]  # [start, end) sample ranges
    format_version: int = FORMAT_VERSION
    # the Layout (older stores have none of these: the full-precision layout in `dtype`)
    aux_dtype: str | None = None  # None = dtype
    target: str = "hidden"
    topk: int = 0
    target_stats: bool = False  # older stores: no argmax / logsumexp beside the hidden state
    origin: FeatureOrigin | None = None  # what it was computed from (stores before origins: None)

    def __post_init__(self) -> None:
        if self.aux_dtype is None:
            self.aux_dtype = self.dtype
        if self.origin is not None and not isinstance(self.origin, FeatureOrigin):  # read from JSON
            self.origin = FeatureOrigin.from_json(self.origin)

    @property
    def layout(self) -> Layout:
        return Layout(self.dtype, self.aux_dtype or self.dtype, self.target, self.topk, self.target_stats)

    def identity(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("lengths"), d.pop("shards")
        return d


@dataclass
class Manifest(StorePlan):
    shard_files: list[dict[str, Any]] = field(default_factory=list)  # {file, sha256, bytes, samples}
    num_tokens: int = 0


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Split samples (in order) into shards of at most `shard_tokens` tokens (>= 1 sample each).

    Depends only on the lengths, so every worker and every rerun derives the same plan.
    """
    shards, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > shard_tokens:
            shards.append([start, i])
            start, tokens = i, 0
        tokens += n
    if start < len(lengths):
        shards.append([start, len(lengths)])
    return shards


def shard_name(j: int) -> str:
    return f"shard-{j:05d}"


# ---------------------------------------------------------------- writer


def init_store(path: Path, plan: StorePlan, foreign_alive: ForeignAlive = None) -> None:
    """Create the store or check that an existing one was started with the same plan.

    Half-written files of killed workers go first; live workers' are kept (on another host: while
    `foreign_alive` says so, e.g. `ShardClaims.writer_alive`; without it, always). A directory
    that is not a store (`OWNER`) is refused before anything is written or removed in it."""
    OWNER.check(path)
    path.mkdir(parents=True, exist_ok=True)
    recover_dirs(path, foreign_alive)
    plan_file = path / "plan.json"
    if plan_file.is_file():
        old_plan = StorePlan(**json.loads(plan_file.read_text()))  # an older plan: its defaults filled in
        old, new = asdict(old_plan), asdict(plan)
        diffs = [k for k in new if k != "origin" and old.get(k) != new[k]]
        if diffs:
            k = diffs[0]
            shown = lambda v: v if not isinstance(v, list) or len(v) < 8 else f"[{len(v)} items]"
            raise FeatureStoreError(
                f"{path}: this store was collected with a different {k} ({shown(old.get(k))} vs "
                f"{shown(new[k])}); use another run name or delete {path} to start over"
            )
        if old_plan.origin is not None and plan.origin is not None:  # a store begun before origins: none
            check_origin(path, old_plan.origin, plan.origin)
        return
    write_atomic(plan_file, json.dumps(asdict(plan), indent=1).encode())


def continued_layout(path: Path, layout: Layout) -> Layout:
    """`layout`, or, for a store begun before target statistics existed, the same layout without
    them: resuming or rerunning it keeps its shards (training forms the statistics it needs)."""
    plan_file = path / "plan.json"
    if not layout.target_stats or not plan_file.is_file():
        return layout
    try:
        plan = json.loads(plan_file.read_text())
    except (OSError, ValueError):
        return layout  # init_store names the problem
    return layout if plan.get("target_stats", False) else replace(layout, target_stats=False)


def shard_done(path: Path, j: int) -> bool:
    """A shard counts as done when its sidecar exists and the file has the recorded size."""
    sidecar = path / f"{shard_name(j)}.json"
    shard = path / f"{shard_name(j)}.safetensors"
    if not sidecar.is_file() or not shard.is_file():
        return False
    try:
        return json.loads(sidecar.read_text())["bytes"] == shard.stat().st_size
    except (ValueError, KeyError):
        return False


def write_shard(
    path: Path, j: int, samples: list[dict[str, torch.Tensor]], layout: Layout | str
) -> dict[str, Any]:
    """Write shard j in `layout` (a dtype name = the full-precision layout in that dtype).

    Each sample: input_ids [T], loss_mask [T], aux_hidden_states [T, n_aux, H] (float, or fp8
    with aux_scale [T, n_aux] for aux_dtype fp8: `quantize_fp8` runs where the states are, which
    may be a GPU), and last_hidden_state [T, H] (target hidden; with target_stats also
    target_argmax [T] and logsumexp [T]) or topk_ids / topk_logprobs [T, k] + logsumexp [T]
    (target topk). Casting to the on-disk dtypes happens here.
    """
    if isinstance(layout, str):
        layout = Layout(layout, layout)

    def cat(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in samples])

    lengths = torch.tensor([0] + [s["input_ids"].numel() for s in samples], dtype=torch.int64)
    tensors = {
        "offsets": torch.cumsum(lengths, 0),
        "input_ids": cat("input_ids").to(torch.int32),
        "loss_mask": cat("loss_mask").to(torch.uint8),
    }
    if layout.aux_dtype == FP8:
        tensors["aux_hidden_states"] = cat("aux_hidden_states")
        if tensors["aux_hidden_states"].dtype != torch.float8_e4m3fn:
            raise ValueError("aux_dtype fp8: pass quantize_fp8 output (aux_hidden_states + aux_scale)")
        tensors["aux_scale"] = cat("aux_scale").float()
    else:
        tensors["aux_hidden_states"] = cat("aux_hidden_states").to(TENSOR_DTYPES[layout.aux_dtype])
    if layout.target == "topk":
        ids = cat("topk_ids").long()
        small = ids.numel() == 0 or int(ids.max()) < 2**16  # any vocabulary up to 65536 (SmolLM2's 49152)
        tensors["topk_ids"] = ids.to(torch.uint16 if small else torch.int32)
        # a log-prob below float16's range (a masked logit) stays finite: exp() of it is 0 all the same
        logprobs = cat("topk_logprobs").clamp(min=torch.finfo(torch.float16).min)
        tensors["topk_logprobs"] = logprobs.to(torch.float16)
        tensors["logsumexp"] = cat("logsumexp").float()
    else:
        tensors["last_hidden_state"] = cat("last_hidden_state").to(TENSOR_DTYPES[layout.dtype])
        if layout.target_stats:
            tensors["target_argmax"] = cat("target_argmax").to(torch.int32)
            tensors["logsumexp"] = cat("logsumexp").float()
    data = safetensors_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "specctl"})
    info = {
        "file": f"{shard_name(j)}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "samples": len(samples),
    }
    write_atomic(path / info["file"], data)
    write_atomic(path / f"{shard_name(j)}.json", json.dumps(info).encode())
    return info


def finalize_store(path: Path) -> Manifest | None:
    """Write manifest.json when every planned shard is done; returns it, or None if work remains.

    Every worker calls this when it runs out of work; the file is created once (`create_once`: of
    workers finishing together, on any host, one writes it) and left as is by the others and by
    reruns. Only a manifest that no longer matches the sidecars (a shard deleted and rewritten
    after the store was complete) is replaced.
    """
    plan = StorePlan(**json.loads((path / "plan.json").read_text()))
    if not all(shard_done(path, j) for j in range(len(plan.shards))):
        return None
    infos = [json.loads((path / f"{shard_name(j)}.json").read_text()) for j in range(len(plan.shards))]
    manifest = Manifest(**asdict(plan), shard_files=infos, num_tokens=sum(plan.lengths))
    data = json.dumps(asdict(manifest), indent=1).encode()
    target = path / "manifest.json"
    if not create_once(target, data) and target.read_bytes() != data:
        write_atomic(target, data)
    return manifest


# ---------------------------------------------------------------- reader


VERIFIED_SUFFIX = ".verified"  # beside a shard: the sha256 it verified with, at which size and mtime


def _file_record(file: Path, sha256: str) -> dict[str, Any]:
    st = file.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified_record(record: Path) -> dict[str, Any] | None:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError):
        return None


class FeatureStore:
    """Random access to samples of a complete store; shards are opened lazily (mmap).

    With `verify=True` each shard's sha256 is checked the first time it is opened, so a corrupted
    file is named before training reads garbage from it; `verify_shards` checks a given set up
    front instead (training: each shard once, split over ranks; see train.verify_store).
    `store[i]` comes back in one form whatever the layout (`decode_features`: fp8 aux states
    dequantized to float32, top-k ids int64, log-probs / logsumexp float32); `store.row(i)` as
    stored, for training to decode on its device. A store pickles without its open files (a
    DataLoader worker reopens them).
    """

    def __init__(self, path: Path, manifest: Manifest, verify: bool = True):
        self.path, self.manifest, self.verify = path, manifest, verify
        self.layout = manifest.layout
        self._starts = [s[0] for s in manifest.shards]
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}, "_offsets": {}}

    def __len__(self) -> int:
        return len(self.manifest.lengths)

    @property
    def lengths(self) -> list[int]:
        return self.manifest.lengths

    def _shard_of(self, i: int) -> int:
        import bisect

        return bisect.bisect_right(self._starts, i) - 1

    def _file(self, j: int) -> Path:
        file = self.path / self.manifest.shard_files[j]["file"]
        if not file.is_file():
            raise FeatureStoreError(f"{file}: shard missing; rerun collect-hidden-states to rebuild it")
        return file

    def verify_shards(self, shards: Iterable[int], remember: bool = False) -> None:
        """Check the sha256 of the given shards against the manifest; one-line error on the first
        that differs. `remember`: a shard whose file is unchanged since it last verified (its
        VERIFIED_SUFFIX record: same sha256, size and mtime) is not read again, and one that
        verifies now gets that record. A store of terabytes (the 8B recipes': ~4 TB) took hours
        to re-hash at every start, requeue and node; what the record skips is a file no one wrote
        since (a truncated copy or a rewrite changes its size or mtime). Delete the records to
        hash everything again."""
        for j in shards:
            file = self._file(j)
            want = self.manifest.shard_files[j]["sha256"]
            record = file.with_name(file.name + VERIFIED_SUFFIX)
            if remember and _verified_record(record) == _file_record(file, want):
                continue
            if sha256_file(file) != want:
                raise FeatureStoreError(
                    f"{file}: checksum mismatch (corrupted); delete it and its .json, then rerun "
                    f"collect-hidden-states to rewrite it"
                )
            if remember:  # one rank a machine hashes a shard: no two writers but across machines
                write_atomic(record, json.dumps(_file_record(file, want)), durable=False)

    def _open(self, j: int):
        if j not in self._handles:
            file = self._file(j)
            if self.verify:
                self.verify_shards([j])
            handle = safe_open(str(file), framework="pt")
            self._offsets[j] = handle.get_tensor("offsets").tolist()
            self._handles[j] = handle
        return self._handles[j]

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i as its shard stores it: input_ids int64 [T], loss_mask bool [T], and the layout's
        STORED_KEYS in their on-disk dtypes (fp8 aux with aux_scale, uint16/int32 ids, ...)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = self._shard_of(i)
        handle = self._open(j)
        k = i - self._starts[j]
        a, b = self._offsets[j][k], self._offsets[j][k + 1]
        row = {"input_ids": handle.get_slice("input_ids")[a:b].long()}
        row["loss_mask"] = handle.get_slice("loss_mask")[a:b].bool()
        for key in self.layout.stored_keys():
            row[key] = handle.get_slice(key)[a:b]
        return row

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return decode_features(self.row(i))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def bytes_per_token(self) -> float:
        total = sum(info["bytes"] for info in self.manifest.shard_files)
        return total / max(1, self.manifest.num_tokens)


def open_features(path: str | Path, verify: bool = True, layout: Layout | None = None) -> FeatureStore:
    """Open a complete feature store directory (runs/<name>/features).

    With `layout` (what the recipe asks for), a store collected with other features settings is
    refused with the setting that differs.
    """
    path = Path(path)
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        if (path / "plan.json").is_file():
            plan = json.loads((path / "plan.json").read_text())
            done = sum(shard_done(path, j) for j in range(len(plan["shards"])))
            raise FeatureStoreError(
                f"{path}: incomplete feature store ({done} of {len(plan['shards'])} shards); rerun "
                f"`specctl collect-hidden-states` to finish it (it takes over a dead worker's shards)"
            )
        raise FeatureStoreError(
            f"{path}: no feature store here; run `specctl collect-hidden-states RECIPE` first"
        )
    try:
        manifest = Manifest(**json.loads(manifest_file.read_text()))
    except (ValueError, TypeError) as e:
        raise FeatureStoreError(
            f"{manifest_file}: unreadable manifest ({e}); rerun collect-hidden-states"
        ) from None
    if manifest.format_version != FORMAT_VERSION:
        raise FeatureStoreError(
            f"{path}: store format {manifest.format_version}, this specctl reads {FORMAT_VERSION}"
        )
    if layout is not None:
        check_layout(path, manifest.layout, layout)
    return FeatureStore(path, manifest, verify=verify)
