"""The embedded engine's prepacked oneDNN linear: the same products as F.linear, the same
state dict, lossless decoding with every drafter, and the `auto` rule."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_engine import NEW, PROMPT, build_drafter, varied_verifier

from specctl.drafters import DRAFTERS
from specctl.engine import generate
from specctl.errors import UsageError
from specctl.kernels import (
    PREPACKED,
    TORCH,
    PrepackedLinear,
    apply_kernel,
    onednn_prepack_available,
    prepack_linears,
    resolve_kernel,
)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not onednn_prepack_available(), reason="this torch build has no oneDNN linear ops"),
]


BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(
        not onednn_prepack_available(torch.bfloat16), reason="oneDNN's bf16 path needs AVX-512 here"
    ),
)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (16, 48)])
def test_prepacked_product_equals_f_linear(dtype, bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    want = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    got = PrepackedLinear(linear)(x)
    assert got.shape == (*shape[:-1], 80) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: rounding of the output alone
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_prepacking_keeps_the_state_dict_and_the_logits():
    model = varied_verifier().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(ids).logits
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert prepack_linears(model) == n_linear > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    # a tied LM head still shares the embedding's parameter (and an untied one does not start to)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.fixture(scope="module")
def packed_verifier():
    model = varied_verifier().eval()
    assert apply_kernel(model, PREPACKED) == PREPACKED
    return model


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_is_lossless_with_every_drafter_on_the_prepacked_kernel(name, packed_verifier):
    """Plain decoding and speculation on the same prepacked forward: same tokens, drafts verified."""
    plain = generate(packed_verifier, None, PROMPT, NEW).tokens
    drafter = build_drafter(name, packed_verifier)
    unpacked = copy.deepcopy(drafter)
    apply_kernel(drafter, PREPACKED)
    assert any(isinstance(m, PrepackedLinear) for m in drafter.modules())
    result = generate(packed_verifier, drafter, PROMPT, NEW)
    assert result.tokens == plain
    assert result.counters.num_drafts > 0
    # the drafter's proposals are its F.linear proposals (random tiny drafters: no near-ties)
    assert generate(packed_verifier, unpacked, PROMPT, NEW).counters == result.counters


def test_auto_prepacks_float32_on_cpu_only():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert resolve_kernel("auto", cpu, torch.float32) == PREPACKED
    assert resolve_kernel("auto", cpu, torch.bfloat16) == TORCH
    assert resolve_kernel("auto", meta, torch.float32) == TORCH
    assert resolve_kernel("torch", cpu, torch.float32) == TORCH
    bf16_here = onednn_prepack_available(torch.bfloat16)
    if bf16_here:
        assert resolve_kernel(PREPACKED, cpu, torch.bfloat16) == PREPACKED
    else:  # an AVX2-only CPU: asked for explicitly, it is an error, not a silent F.linear
        with pytest.raises(UsageError, match="bfloat16"):
            resolve_kernel(PREPACKED, cpu, torch.bfloat16)
    with pytest.raises(UsageError, match="needs a CPU device"):
        resolve_kernel(PREPACKED, meta, torch.float32)
    with pytest.raises(UsageError, match="float16"):
        resolve_kernel(PREPACKED, cpu, torch.float16)


def test_bench_runs_the_kernel_the_recipe_names(tmp_path, tiny_verifier_dir):
    """bench.linear_kernel reaches the embedded backend: `torch` leaves nn.Linear, `auto` packs a
    float32 verifier on the CPU, and the report's provenance names what ran."""
    from specctl.bench.embedded import EmbeddedBackend
    from specctl.recipe import BenchSection, VerifierSection

    section = VerifierSection(name_or_path=str(tiny_verifier_dir))
    for kernel, packed in (("torch", False), ("auto", True)):
        backend = EmbeddedBackend(section, BenchSection(linear_kernel=kernel))
        modules = list(backend.verifier.model.modules())
        assert any(isinstance(m, PrepackedLinear) for m in modules) == packed
        assert backend.engine_info == {"dtype": "float32", "linear_kernel": PREPACKED if packed else TORCH}
