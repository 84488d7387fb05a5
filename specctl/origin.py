"""Where a feature store came from, so that a drafter is never trained on another model's features.

collect records a `FeatureOrigin` in the store's plan.json and manifest.json: the verifier (hub id
and revision, or the path given), a fingerprint of its weight files, its tokenizer, the data and
the layout. train compares it with what the recipe's verifier and data give now and refuses a
difference with one line naming the field; checkpoints, exports (origin.json beside config.json)
and model cards carry it. Checked are facts that decide the features, not how they were reached:
a verifier directory that moved keeps its weights and tokenizer, so a local path is recorded but
not compared (a hub id is).

The weights are fingerprinted, not hashed: reading 16 GB (8B) or 140 GB (70B) to start a training
run would cost minutes. Per file: its size, its safetensors header (tensor names, dtypes, shapes,
offsets) and SAMPLES blocks of SAMPLE_BYTES spread evenly over its data -- 32 KiB a file, read in
milliseconds. A fine-tune changes (nearly) every tensor, so it changes the sampled bytes; a change
confined to bytes no sample reads would pass, which is why a hub verifier's commit counts too.
Files are compared one by one where both sides have them: offline training on a hub id downloads
only the shards it borrows from (verifier.fetch_borrowed), and the index names all of them.

Stores collected before origins were recorded have none: train accepts them with a one-line
warning (the hidden size, aux layer ids and config hash are still checked, features.open_store);
recollect to have the rest checked. Refusing them would cost a recollection (GPU hours at 8B)
for a check the user can have by asking for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specctl.errors import FeatureStoreError

ORIGIN_VERSION = 1
INDEX_FILE = "model.safetensors.index.json"  # as hf_weights names it (no import: no torch here)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
SAMPLES = 8  # blocks read from each weight file's data
SAMPLE_BYTES = 4096
HEADER_MAX = 100 << 20  # a safetensors header larger than this is not one (its own limit is 100 MB)


@dataclass(frozen=True)
class FeatureOrigin:
    """What a feature store was computed from (the order is the order a mismatch is reported in)."""

    verifier: str  # hub id, or the path given
    hub_id: str | None  # compared when both sides have one
    revision: str | None  # hub commit of the snapshot, else the recipe's verifier.revision
    weights_index: str  # sha256 of the weight files' index (weight_map) or their names
    weights: dict[str, str]  # weight file -> `file_fingerprint`, for the files present
    tokenizer: str  # sha256 of the tokenizer definition and chat template (data.prepare)
    data: str  # the data manifest's fingerprint (data settings, source, tokenizer)
    config: str  # verifier.config_hash: the architecture config
    hidden_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]
    features: dict[str, Any] = field(default_factory=dict)  # features.Layout.settings()
    version: int = ORIGIN_VERSION

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}

    @classmethod
    def from_json(cls, d: Any) -> FeatureOrigin:
        """The record as JSON holds it; TypeError when it is not one (the reader names the file)."""
        if not isinstance(d, dict):
            raise TypeError(f"origin is a {type(d).__name__}, not an object")
        origin = cls(**d)
        if not isinstance(origin.weights, dict) or not isinstance(origin.aux_layer_ids, list | tuple):
            raise TypeError("origin: weights or aux_layer_ids of the wrong type")
        return cls(**{**asdict(origin), "aux_layer_ids": tuple(origin.aux_layer_ids)})

    def short(self) -> str:
        """One line for a model card or a log: verifier@revision, weights, tokenizer, data."""
        at = f"@{self.revision[:12]}" if self.revision else ""
        return (
            f"{self.verifier}{at}, weights {self.weights_index[:12]}, tokenizer {self.tokenizer[:12]}, "
            f"data {self.data[:12]}"
        )


# ---------------------------------------------------------------- fingerprints


def sample_offsets(start: int, end: int, samples: int = SAMPLES, block: int = SAMPLE_BYTES) -> list[int]:
    """Offsets of up to `samples` blocks of `block` bytes spread evenly over [start, end): the first
    block at `start`, the last ending at `end`; fewer (one) when the range holds fewer blocks."""
    span = end - start
    if span <= 0:
        return []
    if span <= block * samples:
        return list(range(start, end, block))  # small: every block, the whole range
    step = (span - block) / (samples - 1)
    return [start + round(i * step) for i in range(samples)]


def _data_start(f, size: int) -> int:
    """Where a safetensors file's tensor data starts (8 + its header's length); 0 for other files."""
    head = f.read(8)
    if len(head) == 8:
        n = int.from_bytes(head, "little")
        if 0 < n <= min(HEADER_MAX, size - 8) and f.read(1) == b"{":
            return 8 + n
    return 0


def file_fingerprint(path: Path) -> str:
    """sha256 (16 hex digits) of a weight file's size, header and SAMPLES blocks of its data."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        start = _data_start(f, size)
        f.seek(0)
        h.update(f.read(start))  # the header (nothing for a file that is not safetensors)
        for offset in sample_offsets(start, size):
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def weight_fingerprints(model_dir: Path | None) -> tuple[str, dict[str, str]]:
    """(index hash, file -> fingerprint) of a checkpoint directory: the index's weight_map when it
    has one (and the files it names that are present), else its weight files; ("", {}) without
    a directory."""
    if model_dir is None or not model_dir.is_dir():
        return "", {}
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        listed = json.dumps(sorted(weight_map.items()))
    else:
        names = sorted(p.name for p in model_dir.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
        listed = json.dumps(names)
    present = {n: file_fingerprint(model_dir / n) for n in names if (model_dir / n).is_file()}
    return hashlib.sha256(listed.encode()).hexdigest()[:16], present


def snapshot_revision(model_dir: Path | None, revision: str | None) -> str | None:
    """The commit of a hub snapshot directory (.../snapshots/<commit>), else `revision` as given."""
    if model_dir is not None and model_dir.parent.name == "snapshots":
        return model_dir.name
    return revision


def cached_model_dir(local_path: str | None, hub_id: str | None, revision: str | None) -> Path | None:
    """The directory holding the verifier's files: its local path, or its hub snapshot in the HF
    cache (never downloaded here); None when neither is on this machine."""
    if local_path is not None:
        return Path(local_path)
    if hub_id is None:
        return None
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(hub_id, revision=revision, allow_patterns=["*.json"], local_files_only=True)
        )
    except Exception:  # not cached: no weights to fingerprint here (the revision is still compared)
        return None


# ---------------------------------------------------------------- comparing


# field -> (what it is called in the message, what to do when it differs)
RECOLLECT = "rerun collect-hidden-states for this recipe (or use another run name for it)"
FIELDS = {
    "hub_id": ("verifier", "point verifier.name_or_path at the verifier they came from, or " + RECOLLECT),
    "revision": ("verifier.revision", "set verifier.revision to the one they came from, or " + RECOLLECT),
    "weights_index": ("verifier weight index", RECOLLECT),
    "weights": ("verifier weight file", RECOLLECT),
    "tokenizer": ("tokenizer (or chat template)", RECOLLECT),
    "data": (
        "data (the data.* settings or the data.source file)",
        "restore the data they came from, or " + RECOLLECT,
    ),
    "config": ("verifier config", RECOLLECT),
    "hidden_size": ("hidden size", RECOLLECT),
    "num_layers": ("number of verifier layers", RECOLLECT),
    "aux_layer_ids": ("features.aux_layer_ids", RECOLLECT),
    "features": ("features layout", RECOLLECT),
}


def mismatch(have: FeatureOrigin, want: FeatureOrigin) -> tuple[str, str, str] | None:
    """(field, recorded, current) of the first field in which the recipe's origin differs from the
    store's, None when they agree. Hub ids, revisions and the weights index count only when both
    sides know them; weight files only where both have the file (see the module docstring)."""
    for name in FIELDS:
        a, b = getattr(have, name), getattr(want, name)
        if name == "weights":
            for file in sorted(a.keys() & b.keys()):
                if a[file] != b[file]:
                    return f"{name} ({file})", a[file], b[file]
            continue
        if name in ("hub_id", "revision", "weights_index") and (not a or not b):
            continue
        if a != b:
            return name, str(a), str(b)
    return None


def check_origin(where: Path, have: FeatureOrigin, want: FeatureOrigin) -> None:
    """One-line FeatureStoreError when the store at `where` was computed from something else."""
    found = mismatch(have, want)
    if found is None:
        return
    name, a, b = found
    key, _, file = name.partition(" ")
    label, todo = FIELDS[key]
    shown = lambda v: v if len(v) <= 40 else v[:16] + "..."  # noqa: E731
    file = f"{file.strip('()')}: " if file else ""
    raise FeatureStoreError(
        f"{where}: the recipe's {label} is not the one these features were collected with "
        f"({file}recorded {shown(a)}, now {shown(b)}); {todo}"
    )


# ---------------------------------------------------------------- carried along


ORIGIN_FILE = "origin.json"  # beside an export's config.json (the speculators config stays as vLLM reads it)
META_KEY = "features_origin"  # in a checkpoint's meta.json (None: online, or a store without one)


def origin_of_meta(meta: dict[str, Any], where: Path) -> FeatureOrigin | None:
    """The origin a checkpoint's meta.json records (None when it records none)."""
    if meta.get(META_KEY) is None:
        return None
    try:
        return FeatureOrigin.from_json(meta[META_KEY])
    except TypeError as e:
        raise FeatureStoreError(f"{where}: {META_KEY} is damaged ({e}); export another checkpoint") from None


def write_origin(directory: Path, origin: FeatureOrigin) -> None:
    (directory / ORIGIN_FILE).write_text(json.dumps(origin.to_json(), indent=1) + "\n")


def read_origin(directory: Path) -> FeatureOrigin | None:
    """An export's origin.json; None without one, or when it does not parse (a card leaves it out)."""
    try:
        return FeatureOrigin.from_json(json.loads((directory / ORIGIN_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
