"""specctl.speculators.io: a drafter's two files written, read back as the same values, accepted by
validate_export; cast as the re-export casts them; written byte for byte as export wrote them before
the format had its own package (the reference writer below is that code, inlined)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_verifier
from safetensors.torch import save_file

from specctl.drafters import DRAFTERS, VerifierWeights
from specctl.drafters.targets import build_draft_vocab
from specctl.errors import SpecctlError
from specctl.speculators.io import ExportFiles, drafter_files, export_dtype, load_drafter, read_files
from specctl.speculators.validate import CONFIG_FILE, WEIGHTS_FILE, validate_export
from specctl.verifier import spec_from_config

AUX, MASK_ID = (1, 2, 3), 300
ALGOS = sorted(DRAFTERS)


@pytest.fixture(scope="module")
def verifier():
    model = make_tiny_verifier("llama", vocab_size=320)
    weights = VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    return spec_from_config(model.config, "tiny-llama", AUX, MASK_ID), weights


def tiny_drafter(verifier, algo: str, reduced: bool):
    """One or two layers, every exported tensor moved off its init; `reduced`: a 100-id draft
    vocabulary (d2t and t2d in the file)."""
    spec, weights = verifier
    cls = DRAFTERS[algo].config_cls
    wanted = {"num_layers": 2, "num_speculative_tokens": 3}
    config = cls(**{k: v for k, v in wanted.items() if k in cls.model_fields})
    freq = torch.randperm(320, generator=torch.Generator().manual_seed(7)).float()
    d2t = build_draft_vocab(freq, 100)[0] if reduced else None
    torch.manual_seed(1)
    drafter = DRAFTERS[algo].build(config, spec, weights, d2t, "kl")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def reference_write(drafter, dtype: torch.dtype, directory: Path) -> None:
    """export.save_drafter's two files as written before specctl.speculators.io existed."""
    config = drafter.export_config()
    config.dtype = str(dtype).removeprefix("torch.")
    text = json.dumps(config.to_json(), indent=2) + "\n"
    state = {
        name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in drafter.export_state().items()
    }
    (directory / CONFIG_FILE).write_text(text)
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("algo", ALGOS)
def test_written_files_read_back_as_the_same_config_and_tensors(verifier, algo, reduced, tmp_path):
    drafter = tiny_drafter(verifier, algo, reduced)
    files = drafter_files(drafter, "float32")
    files.write(tmp_path)
    export = validate_export(tmp_path)  # the directory is a loadable export
    assert export.spec is DRAFTERS[algo]
    back = read_files(export)
    assert back.config == files.config == {**drafter.export_config().to_json(), "dtype": "float32"}
    assert export.config.to_json() == files.config  # the typed config reads back every field
    assert same_tensors(back.tensors, files.tensors)
    assert same_tensors(
        back.tensors,
        {n: t.float() if t.is_floating_point() else t for n, t in drafter.export_state().items()},
    )
    assert ("d2t" in back.tensors) == reduced and "embed_tokens.weight" not in back.tensors
    # and as a drafter: the same module back, proposing the same tokens
    loaded, config = load_drafter(tmp_path, verifier[1])
    assert type(loaded) is type(drafter) and config.to_json() == files.config
    assert same_tensors(loaded.export_state(), drafter.export_state())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("algo", ALGOS)
def test_files_are_written_byte_for_byte_as_before(verifier, algo, dtype, tmp_path):
    drafter = tiny_drafter(verifier, algo, reduced=True)
    (tmp_path / "before").mkdir()
    (tmp_path / "now").mkdir()
    reference_write(drafter, dtype, tmp_path / "before")
    drafter_files(drafter, str(dtype).removeprefix("torch.")).write(tmp_path / "now")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (tmp_path / "now" / name).read_bytes() == (tmp_path / "before" / name).read_bytes(), name


@pytest.mark.parametrize("algo", ALGOS)
def test_cast_converts_floating_tensors_only_and_says_so_in_place(verifier, algo, tmp_path):
    files = drafter_files(tiny_drafter(verifier, algo, reduced=True), "float32")
    half = files.cast(torch.float16)
    assert list(half.config) == list(files.config)  # dtype rewritten where it was, no key moved
    assert half.config == {**files.config, "dtype": "float16"}
    expected = {n: t.half() if t.is_floating_point() else t for n, t in files.tensors.items()}
    assert same_tensors(half.tensors, expected)
    assert half.tensors["d2t"].dtype == torch.int64 and half.tensors["t2d"].dtype == torch.bool
    half.write(tmp_path)
    assert read_files(validate_export(tmp_path)).config["dtype"] == "float16"
    # a config.json without a dtype field (another tool's) gets one, at the end
    bare = ExportFiles({k: v for k, v in files.config.items() if k != "dtype"}, files.tensors)
    assert list(bare.cast(torch.bfloat16).config)[-1] == "dtype"


def test_an_unknown_export_dtype_is_one_line():
    with pytest.raises(SpecctlError, match=r"^export dtype 'int8': choose bfloat16, float16 or float32$"):
        export_dtype("int8")
