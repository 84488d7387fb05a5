"""Verifier loading: the grouped-query SDPA path computes what transformers' own SDPA computes; a
verifier spread over `tensor_parallel_size` GPUs takes its rank's group, or says in one line why not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_verifier

from specctl.devices import verifier_gpus
from specctl.errors import RecipeError, VerifierError
from specctl.recipe import VerifierSection
from specctl.verifier import GQA_SDPA, load_verifier, offloaded_modules, spread_kwargs, use_gqa_sdpa


def _left_padded(batch: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, width), generator=g)
    mask = torch.ones(batch, width, dtype=torch.long)
    for b in range(batch):
        mask[b, : 2 * b] = 0  # row b has 2b pad tokens on the left
        ids[b, : 2 * b] = 0
    return ids, mask


def test_gqa_sdpa_equals_transformers_sdpa_with_and_without_padding():
    model = make_tiny_verifier("llama", vocab_size=320)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    model.set_attn_implementation("sdpa")
    ids, mask = _left_padded(4, 12, 320)
    with torch.no_grad():
        ref_masked = model(ids, attention_mask=mask).logits
        ref_causal = model(ids).logits
        ref_gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == GQA_SDPA
    with torch.no_grad():
        assert torch.allclose(model(ids, attention_mask=mask).logits, ref_masked, atol=1e-5)
        assert torch.allclose(model(ids).logits, ref_causal, atol=1e-5)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert torch.equal(gen, ref_gen)


def test_qwen3_verifier_also_switches(tmp_path):
    model = make_tiny_verifier("qwen3")
    model.set_attn_implementation("sdpa")
    ids, mask = _left_padded(3, 10, 320)
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        use_gqa_sdpa(model)
        assert torch.allclose(model(ids, attention_mask=mask).logits, ref, atol=1e-5)


def test_load_verifier_uses_gqa_sdpa(tiny_verifier_dir):
    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    assert verifier.model.config._attn_implementation == GQA_SDPA


def test_eager_models_are_left_alone():
    model = make_tiny_verifier("llama")
    model.set_attn_implementation("eager")
    use_gqa_sdpa(model)
    assert model.config._attn_implementation == "eager"


# ---------------------------------------------------------------- verifier.tensor_parallel_size


def test_verifier_gpus_gives_each_rank_its_own_group_and_refuses_what_does_not_fit():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for gpus in range(1, 9):
        for tp in range(1, gpus + 1):
            for rank in range(gpus // tp):  # what torchrun --nproc-per-node gpus // tp starts
                assert verifier_gpus(tp, cuda, gpus, rank) == tuple(range(rank * tp, rank * tp + tp))
    taken = [set(verifier_gpus(4, cuda, 8, r)) for r in range(2)]
    assert taken == [{0, 1, 2, 3}, {4, 5, 6, 7}]  # 8 GPUs, tp 4: two disjoint groups
    assert verifier_gpus(2, torch.device("cuda:4"), 8, rank=3) == (4, 5)  # a named GPU wins over the rank
    assert verifier_gpus(1, cpu, 0) == () == verifier_gpus(1, cpu, 8)
    cases = [
        ((2, cpu, 0, 0), r"verifier.tensor_parallel_size=2: it spans GPUs, but the verifier runs on cpu"),
        ((4, cuda, 2, 0), r"verifier.tensor_parallel_size=4 from GPU 0 needs 4 GPU\(s\) but 2 are visible"),
        ((2, torch.device("cuda:7"), 8, 0), r"from GPU 7 needs 9 GPU\(s\) but 8 are visible"),
        ((4, cuda, 8, 2), r"local rank 2 would take GPUs 8-11 but 8 are visible; start 2 process\(es\)"),
        ((1, cuda, 0, 0), r"verifier.device cuda: no GPU is visible"),
    ]
    for args, message in cases:
        with pytest.raises(RecipeError, match=message) as e:
            verifier_gpus(*args)
        assert "\n" not in str(e.value)


def test_spread_kwargs_balance_over_exactly_the_group():
    assert spread_kwargs((), []) == {} == spread_kwargs((3,), [80 * GB])  # one GPU: moved whole
    kw = spread_kwargs((4, 5, 6, 7), [80 * GB, 70 * GB, 80 * GB, 60 * GB])
    assert kw["device_map"] == "auto"  # transformers balances layers over the listed GPUs
    assert kw["max_memory"] == {4: 72 * GB, 5: 63 * GB, 6: 72 * GB, 7: 54 * GB}  # no cpu/disk entry
    with pytest.raises(ValueError):
        spread_kwargs((0, 1), [GB])  # a free-memory figure per GPU, or nothing
    placed = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"}
    assert offloaded_modules(placed, (0, 1)) == ["lm_head"]
    assert offloaded_modules(placed, (0, 1, "cpu")) == [] and offloaded_modules(None, (0,)) == []


GB = 10**9


def test_load_verifier_on_cpu_refuses_tensor_parallel_before_reading_weights(tiny_verifier_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    def never(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    section = VerifierSection(name_or_path=str(tiny_verifier_dir), tensor_parallel_size=2, device="cpu")
    with pytest.raises(RecipeError, match=r"^verifier.tensor_parallel_size=2: it spans GPUs"):
        load_verifier(section)


@pytest.fixture
def eight_fake_gpus(monkeypatch):
    """torch says 8 GPUs with 80 GB free each (GPU i: 80 - i GB); from_pretrained loads on the CPU
    and reports the placement `placed(kwargs)` as its hf_device_map. Yields the kwargs it got."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained
    calls: list[dict] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # resolve_device makes it current
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda g: ((80 - g) * GB, 80 * GB))

    def fake(source, **kwargs):
        calls.append(kwargs)
        model = load(source, dtype=torch.float32)
        gpus = sorted(kwargs["max_memory"])
        model.hf_device_map = {"model.embed_tokens": gpus[0], "model.layers": gpus[-1], "lm_head": fake.last}
        return model

    fake.last = 7
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    yield fake, calls


def test_load_verifier_spreads_a_torchrun_rank_over_its_own_gpus(
    tiny_verifier_dir, monkeypatch, eight_fake_gpus
):
    fake, calls = eight_fake_gpus
    monkeypatch.setenv("LOCAL_RANK", "1")
    section = VerifierSection(name_or_path=str(tiny_verifier_dir), tensor_parallel_size=4)
    verifier = load_verifier(section)
    [kwargs] = calls
    assert kwargs["device_map"] == "auto" and kwargs["dtype"] == torch.bfloat16  # auto on CUDA
    assert kwargs["max_memory"] == {g: int((80 - g) * GB * 0.9) for g in (4, 5, 6, 7)}
    assert verifier.device == torch.device("cuda", 4)  # inputs and gathered states: the group's first
    fake.last = "disk"  # accelerate would run what did not fit from disk: refused instead
    with pytest.raises(
        VerifierError,
        match=r"does not fit in verifier.tensor_parallel_size=4 GPU.*'lm_head' "
        r"went to disk\); raise it",
    ):
        load_verifier(section)
