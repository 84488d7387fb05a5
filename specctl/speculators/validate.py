"""Is this directory a speculators export the drafter it describes can load? Refuse it otherwise.

Every directory specctl writes or reads goes through `validate_export` first: config.json parses
into the algorithm's typed config (specctl.speculators.config), the drafter it describes is built on the meta
device (no memory, no init cost), and the file's tensor names, shapes and dtypes must be exactly
the ones that drafter exports. A corrupt or hand-edited directory is refused with the file and the
tensor or field that is wrong, never half-loaded.

Tolerated departures from specctl's own layout, as vLLM tolerates them: a t2d left out (vLLM
ignores it; rebuilt from d2t), copies of the verifier's embeddings / LM head (vLLM shares or keeps
them), and tensors an algorithm accepts in another shape of the same size (P-EAGLE's mask_hidden).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specctl.drafters import DRAFTERS, DrafterSpec, VerifierWeights
from specctl.drafters.vocab import d2t_problem, kept_ids
from specctl.errors import SpecctlError, first_line
from specctl.speculators.config import FormatError, SpeculatorsConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded third-party checkpoints

# Verifier tensors a directory may ship although vLLM shares them from the verifier:
# file name -> VerifierWeights field. Copies equal to the verifier's are shared.
SHAREABLE = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
# config.json fields a re-export rewrites whatever an older file says: not drift
METADATA = ("architectures", "dtype", "speculators_version")

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

Headers = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class ExportDir:
    """A directory that passed `validate_export`, with what loading it needs."""

    path: Path
    config: SpeculatorsConfig  # the algorithm's typed config.json
    spec: DrafterSpec
    files: dict[str, Path]  # tensor -> file
    headers: Headers
    shared: list[str]  # SHAREABLE tensors in the file the drafter does not own (vLLM shares them)
    derive_t2d: bool  # the drafter keeps t2d, the file omits it (vLLM ignores it): rebuilt from d2t
    num_parameters: int  # parameters of the drafter as built from config.json

    @property
    def weights_file(self) -> Path:
        return weights_file(self.path)


# ---------------------------------------------------------------- reading


def is_export_dir(path: str | Path) -> bool:
    """True when `path` holds a speculators config.json (ours or anyone's)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_json(path: Path) -> dict[str, Any]:
    """config.json of an export directory as a JSON object, or a one-line SpecctlError."""
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise SpecctlError(
            f"{path}: no such directory; pass a speculators export (config.json + model.safetensors)"
        )
    if not file.is_file():
        raise SpecctlError(f"{file}: missing; a speculators export has config.json + model.safetensors")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecctlError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise SpecctlError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config


def read_config(path: str | Path) -> tuple[DrafterSpec, SpeculatorsConfig]:
    """The registered drafter and the typed config.json of an export directory."""
    path = Path(path)
    data = read_json(path)
    where = path / CONFIG_FILE
    for dotted in SpeculatorsConfig.REQUIRED[:1]:
        if dotted not in data:
            raise SpecctlError(f"{where}: required field {dotted!r} is missing")
    model_type = data["speculators_model_type"]
    by_type = {spec.speculators_model_type: spec for spec in DRAFTERS.values()}
    if model_type not in by_type:
        raise SpecctlError(
            f"{where}: speculators_model_type {model_type!r} is not a drafter specctl knows; "
            f"known: {', '.join(sorted(by_type))}"
        )
    spec = by_type[model_type]
    try:
        return spec, spec.format_cls.from_json(data)
    except FormatError as e:
        raise SpecctlError(f"{where}: {format_problem(e)}") from None


def format_problem(e: FormatError) -> str:
    return f"required field {e.field!r} is missing" if e.reason == "is missing" else str(e)


def weights_file(path: Path) -> Path:
    return path / WEIGHTS_FILE if (path / WEIGHTS_FILE).is_file() else path / INDEX_FILE


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or shards listed in an index)."""
    single, index = path / WEIGHTS_FILE, path / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SpecctlError(f"{index}: not a safetensors index (no weight_map)") from None
        for name, shard in weight_map.items():
            if not (path / shard).is_file():
                raise SpecctlError(f"{path / shard}: missing (listed for tensor {name!r} in {INDEX_FILE})")
        files = [path / shard for shard in dict.fromkeys(weight_map.values())]
    else:
        raise SpecctlError(f"{single}: missing; a speculators export has config.json + model.safetensors")
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                where.update(dict.fromkeys(f.keys(), file))
        except (SafetensorError, OSError) as e:
            raise SpecctlError(f"{file}: not a readable safetensors file ({first_line(e)})") from None
    return where


def _by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name, file in files.items():
        grouped.setdefault(file, []).append(name)
    return grouped


def tensor_headers(files: dict[str, Path]) -> Headers:
    """name -> (shape, dtype) from the safetensors headers, without reading the tensors."""
    out: Headers = {}
    for file, names in _by_file(files).items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise SpecctlError(f"{file}: tensor {name!r} has unsupported dtype {piece.get_dtype()}")
                out[name] = (tuple(piece.get_shape()), dtype)
    return out


def iter_tensors(files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time: a check over every weight never holds them all."""
    for file, group in _by_file(files).items():
        with safe_open(str(file), "pt") as f:
            for name in group:
                yield name, f.get_tensor(name)


def load_tensors(files: dict[str, Path], names: list[str] | None = None) -> dict[str, torch.Tensor]:
    return dict(iter_tensors(files if names is None else {n: files[n] for n in names}))


# ---------------------------------------------------------------- checks


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_vocab_tables(where: Path, config: SpeculatorsConfig, tables: dict[str, torch.Tensor]) -> None:
    """d2t/t2d agree with draft_vocab_size and with each other (vLLM: target = draft + d2t[draft])."""
    vocab, draft_vocab = config.layer.vocab_size, config.draft_vocab_size
    if "d2t" not in tables:
        if draft_vocab is not None and draft_vocab != vocab:
            raise SpecctlError(
                f"{where}: missing tensor 'd2t': draft_vocab_size {draft_vocab} < vocabulary {vocab}, and "
                "vLLM needs the draft->target offset table to map draft ids"
            )
        if "t2d" in tables:
            raise SpecctlError(f"{where}: tensor 't2d' without 'd2t'; a reduced vocabulary ships both")
        return
    d2t = tables["d2t"]
    problem = d2t_problem(d2t, vocab)
    if problem is not None:
        raise SpecctlError(f"{where}: tensor 'd2t' {problem}")
    if draft_vocab is not None and d2t.numel() != draft_vocab:
        raise SpecctlError(
            f"{where}: tensor 'd2t' has {d2t.numel()} entries, config.json draft_vocab_size is {draft_vocab}"
        )
    t2d = tables.get("t2d")
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,):
            raise SpecctlError(
                f"{where}: tensor 't2d' must be bool [{vocab}], got {t2d.dtype} {_shape(t2d.shape)}"
            )
        if not torch.equal(t2d.nonzero().flatten(), kept_ids(d2t)):
            raise SpecctlError(f"{where}: tensors 't2d' and 'd2t' disagree on which target ids are kept")


def _tensor_problems(expected: Headers, headers: Headers, reshapeable: tuple[str, ...]) -> list[str]:
    """Missing, unexpected and misshapen tensors: the file vs the module config.json describes."""
    problems = [f"missing tensor {n!r} {_shape(expected[n][0])}" for n in expected if n not in headers]
    problems += [
        f"unexpected tensor {n!r} (the drafter has no such weight)" for n in headers if n not in expected
    ]
    for name, (shape, _) in headers.items():
        if name not in expected or expected[name][0] == shape:
            continue
        if name in reshapeable and torch.Size(shape).numel() == torch.Size(expected[name][0]).numel():
            continue
        problems.append(
            f"tensor {name!r} has shape {_shape(shape)}, config.json implies {_shape(expected[name][0])}"
        )
    return problems


def config_drift(expected: Any, actual: Any, prefix: str = "") -> str | None:
    """First difference between the config the rebuilt drafter exports and config.json. Fields an
    older specctl did not write yet may be missing; METADATA is not compared."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key, value in expected.items():
            if key in actual and not (not prefix and key in METADATA):
                drift = config_drift(value, actual[key], f"{prefix}{key}.")
                if drift:
                    return drift
        extra = [k for k in actual if k not in expected and not (not prefix and k in METADATA)]
        return f"unexpected field {prefix}{extra[0]!r}" if extra else None
    if expected != actual:
        name = prefix.rstrip(".")
        return f"field {name!r} is {actual!r}, the drafter rebuilt from this directory exports {expected!r}"
    return None


ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")


def rebuilt_drift(rebuilt: SpeculatorsConfig, config: SpeculatorsConfig) -> str | None:
    """config_drift of the two configs, the rope compared by what it means (`LayerConfig.rope()`):
    specctl versions spelled the same rope in different fields."""
    if rebuilt.layer.rope() != config.layer.rope():
        have, want = config.layer.rope(), rebuilt.layer.rope()
        return f"the rope of transformer_layer_config is {have}, the drafter rebuilt from it exports {want}"

    def without_rope(data: dict[str, Any]) -> dict[str, Any]:
        layer = {k: v for k, v in data["transformer_layer_config"].items() if k not in ROPE_FIELDS}
        return {**data, "transformer_layer_config": layer}

    return config_drift(without_rope(rebuilt.to_json()), without_rope(config.to_json()))


def meta_weights(vocab_size: int, hidden_size: int) -> VerifierWeights:
    """Stand-ins for the verifier tensors a drafter borrows: right shapes, no storage."""
    meta = torch.device("meta")
    return VerifierWeights(
        embed_tokens=torch.empty(vocab_size, hidden_size, device=meta),
        lm_head=torch.empty(vocab_size, hidden_size, device=meta),
        norm=torch.empty(hidden_size, device=meta),
    )


def _build_on_meta(path: Path, spec: DrafterSpec, config: SpeculatorsConfig, d2t: torch.Tensor | None):
    """The drafter config.json describes, built on the meta device; its failure is config.json's."""
    from accelerate import init_empty_weights

    weights = meta_weights(config.layer.vocab_size, config.layer.hidden_size)
    try:
        with init_empty_weights():
            return spec.build_from_format(config, weights, d2t)
    except FormatError as e:
        raise SpecctlError(f"{path / CONFIG_FILE}: {format_problem(e)}") from None
    except KeyError as e:
        raise SpecctlError(f"{path / CONFIG_FILE}: required field {first_line(e)} is missing") from None
    except (ValueError, TypeError, RuntimeError, IndexError, AttributeError) as e:
        raise SpecctlError(
            f"{path / CONFIG_FILE}: the {spec.name} drafter cannot be built from it ({first_line(e)})"
        ) from None


def validate_export(path: str | Path, check_values: bool = True) -> ExportDir:
    """Refuse a speculators directory that is incomplete, corrupt or inconsistent; return its contents.

    Checks, in order: config.json is there and parses into the algorithm's config (vLLM's required
    fields first); the weights are readable safetensors; drafter weights are floating point and
    d2t/t2d agree with draft_vocab_size; the drafter config.json describes (built on the meta
    device) has exactly the file's tensor names and shapes; a directory written by specctl (it has
    a `specctl` block) exports back to the same config.json; all weights are finite (`check_values`).
    """
    path = Path(path)
    spec, config = read_config(path)
    files = tensor_files(path)
    headers = tensor_headers(files)
    for name, (_, dtype) in headers.items():
        if name not in ("d2t", "t2d") and not dtype.is_floating_point:
            raise SpecctlError(
                f"{files[name]}: tensor {name!r} is {dtype}; drafter weights are floating point"
            )
    tables = load_tensors(files, [n for n in ("d2t", "t2d") if n in headers])
    check_vocab_tables(weights_file(path), config, tables)
    module = _build_on_meta(path, spec, config, tables.get("d2t"))
    expected = {n: (tuple(t.shape), t.dtype) for n, t in module.export_state().items()}
    V, H = config.layer.vocab_size, config.layer.hidden_size
    shared = [n for n in headers if n in SHAREABLE and n not in expected]
    derive_t2d = "t2d" in expected and "t2d" not in headers and "d2t" in headers
    file_tensors = {n: h for n, h in headers.items() if n not in shared}
    if derive_t2d:
        file_tensors["t2d"] = expected["t2d"]
    problems = _tensor_problems(expected, file_tensors, getattr(module, "export_reshapeable", ()))
    if problems:
        raise SpecctlError(
            f"{weights_file(path)}: does not match its config.json ({spec.name}): {'; '.join(problems)}"
        )
    for name in shared:
        if headers[name][0] != (V, H):
            raise SpecctlError(
                f"{files[name]}: tensor {name!r} has shape {_shape(headers[name][0])}, "
                f"the verifier's is [{V}, {H}]"
            )
    if config.specctl is not None:  # written by specctl: the drafter must export exactly this config back
        drift = rebuilt_drift(module.export_config(), config)
        if drift:
            raise SpecctlError(f"{path / CONFIG_FILE}: {drift} (hand-edited? re-export the checkpoint)")
    if check_values:
        for name, values in iter_tensors(files):
            if values.is_floating_point() and not torch.isfinite(values).all():
                raise SpecctlError(f"{files[name]}: tensor {name!r} holds NaN or Inf values")
    return ExportDir(
        path=path,
        config=config,
        spec=spec,
        files=files,
        headers=headers,
        shared=shared,
        derive_t2d=derive_t2d,
        num_parameters=sum(
            torch.Size(shape).numel() for shape, dtype in expected.values() if dtype.is_floating_point
        ),
    )
