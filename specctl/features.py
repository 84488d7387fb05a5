"""The feature store: the verifier's hidden states on disk, sharded, checksummed, resumable.

Layout of a store directory (see docs/features.md):
    plan.json                 what this store holds and how it is split (written first)
    shard-00000.safetensors   samples concatenated along tokens (no padding on disk)
    shard-00000.json          sidecar: sha256 + size of the shard; written after the shard
    manifest.json             written once every shard is done: the store is complete

A shard file is written to a temporary name and renamed, and its sidecar is written the same
way afterwards, so a process killed at any moment leaves either a finished shard or nothing
that reads as one. Workers of `--shard I/N` own shards j with j % N == I; whoever finishes the
last shard writes the manifest, so the reader always sees one store.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from specctl.errors import FeatureStoreError

FORMAT_VERSION = 1
TENSOR_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- writer


def init_store(path: Path, plan: StorePlan) -> None:
    """Create the store or check that an existing one was started with the same plan."""
    path.mkdir(parents=True, exist_ok=True)
    plan_file = path / "plan.json"
    if plan_file.is_file():
        old = json.loads(plan_file.read_text())
        new = asdict(plan)
        diffs = [k for k in new if old.get(k) != new[k]]
        if diffs:
            k = diffs[0]
            shown = lambda v: v if not isinstance(v, list) or len(v) < 8 else f"[{len(v)} items]"
            raise FeatureStoreError(
                f"{path}: this store was collected with a different {k} ({shown(old.get(k))} vs "
                f"{shown(new[k])}); use another run name or delete {path} to start over"
            )
        return
    _atomic_write(plan_file, json.dumps(asdict(plan), indent=1).encode())


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


def write_shard(path: Path, j: int, samples: list[dict[str, torch.Tensor]], dtype: str) -> dict[str, Any]:
    """Write shard j: samples (each input_ids [T], loss_mask [T], aux [T, n_aux, H], last [T, H])."""
    target_dtype = TENSOR_DTYPES[dtype]
    lengths = torch.tensor([0] + [s["input_ids"].numel() for s in samples], dtype=torch.int64)
    tensors = {
        "offsets": torch.cumsum(lengths, 0),
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
        "aux_hidden_states": torch.cat([s["aux_hidden_states"] for s in samples]).to(target_dtype),
        "last_hidden_state": torch.cat([s["last_hidden_state"] for s in samples]).to(target_dtype),
    }
    data = safetensors_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "specctl"})
    info = {
        "file": f"{shard_name(j)}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "samples": len(samples),
    }
    _atomic_write(path / info["file"], data)
    _atomic_write(path / f"{shard_name(j)}.json", json.dumps(info).encode())
    return info


def finalize_store(path: Path) -> Manifest | None:
    """Write manifest.json when every planned shard is done; returns it, or None if work remains."""
    plan = StorePlan(**json.loads((path / "plan.json").read_text()))
    if not all(shard_done(path, j) for j in range(len(plan.shards))):
        return None
    infos = [json.loads((path / f"{shard_name(j)}.json").read_text()) for j in range(len(plan.shards))]
    manifest = Manifest(**asdict(plan), shard_files=infos, num_tokens=sum(plan.lengths))
    _atomic_write(path / "manifest.json", json.dumps(asdict(manifest), indent=1).encode())
    return manifest


# ---------------------------------------------------------------- reader


class FeatureStore:
    """Random access to samples of a complete store; shards are opened lazily (mmap).

    Each shard's sha256 is checked the first time it is opened (`verify=True`), so a
    corrupted file is named before training reads garbage from it.
    """

    def __init__(self, path: Path, manifest: Manifest, verify: bool = True):
        self.path, self.manifest, self.verify = path, manifest, verify
        self._starts = [s[0] for s in manifest.shards]
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.manifest.lengths)

    @property
    def lengths(self) -> list[int]:
        return self.manifest.lengths

    def _shard_of(self, i: int) -> int:
        import bisect

        return bisect.bisect_right(self._starts, i) - 1

    def _open(self, j: int):
        if j not in self._handles:
            info = self.manifest.shard_files[j]
            file = self.path / info["file"]
            if not file.is_file():
                raise FeatureStoreError(f"{file}: shard missing; rerun collect-hidden-states to rebuild it")
            if self.verify and _sha256_file(file) != info["sha256"]:
                raise FeatureStoreError(
                    f"{file}: checksum mismatch (corrupted); delete it and its .json, then rerun "
                    f"collect-hidden-states to rewrite it"
                )
            handle = safe_open(str(file), framework="pt")
            self._offsets[j] = handle.get_tensor("offsets").tolist()
            self._handles[j] = handle
        return self._handles[j]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        j = self._shard_of(i)
        handle = self._open(j)
        k = i - self._starts[j]
        a, b = self._offsets[j][k], self._offsets[j][k + 1]
        return {
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "loss_mask": handle.get_slice("loss_mask")[a:b].bool(),
            "aux_hidden_states": handle.get_slice("aux_hidden_states")[a:b],
            "last_hidden_state": handle.get_slice("last_hidden_state")[a:b],
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(len(self)):
            yield self[i]

    def bytes_per_token(self) -> float:
        total = sum(info["bytes"] for info in self.manifest.shard_files)
        return total / max(1, self.manifest.num_tokens)


def open_features(path: str | Path, verify: bool = True) -> FeatureStore:
    """Open a complete feature store directory (runs/<name>/features)."""
    path = Path(path)
    manifest_file = path / "manifest.json"
    if not manifest_file.is_file():
        if (path / "plan.json").is_file():
            plan = json.loads((path / "plan.json").read_text())
            done = sum(shard_done(path, j) for j in range(len(plan["shards"])))
            raise FeatureStoreError(
                f"{path}: incomplete feature store ({done} of {len(plan['shards'])} shards); rerun "
                f"`specctl collect-hidden-states` (every --shard rank) to finish it"
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
    return FeatureStore(path, manifest, verify=verify)
