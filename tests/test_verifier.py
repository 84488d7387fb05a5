"""Verifier loading: the grouped-query SDPA path computes what transformers' own SDPA computes; a
verifier spread over `tensor_parallel_size` GPUs takes its rank's group, or says in one line why not;
offline training's verifier (three tensors read by name) is what the full load gives."""

from __future__ import annotations

import json

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
    assert spread_kwargs((), []) == {}  # on the host
    assert spread_kwargs((3,), [80 * GB]) == {"device_map": {"": 3}}  # read straight onto its GPU
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
        gpus = sorted(kwargs["max_memory"]) if "max_memory" in kwargs else [kwargs["device_map"][""]]
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


def test_a_torchrun_rank_reads_its_verifier_straight_onto_its_gpu(
    tiny_verifier_dir, monkeypatch, eight_fake_gpus
):
    """Issue 56 item 7: with one GPU a rank, the weights go from the files to the rank's GPU (an
    accelerate device map), not into host memory whole and then across (eight ranks of an 8B
    collect: 128 GB of host RAM at once). No `.to(cuda)` follows: the load placed it."""
    fake, calls = eight_fake_gpus
    fake.last = 3
    monkeypatch.setenv("LOCAL_RANK", "3")
    moved: list = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    [kwargs] = calls
    assert kwargs["device_map"] == {"": 3} and "max_memory" not in kwargs
    assert verifier.device == torch.device("cuda", 3) and moved == []


# ---------------------------------------------------------------- the borrowed tensors, read by name


def save_verifier(path, kind: str = "llama", tied: bool = False, shard: bool = False, stored=torch.float32):
    """A tiny random verifier saved as an HF directory (several safetensors + an index when
    `shard`), its final norm not the all-ones it starts as, weights stored in `stored`."""
    from conftest import make_tiny_tokenizer

    model = make_tiny_verifier(kind, tied=tied)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.to(stored).save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
    make_tiny_tokenizer().save_pretrained(path)
    return path


BORROWED = [
    pytest.param("llama", False, False, torch.float32, "float32", id="llama"),
    pytest.param("llama", True, True, torch.float32, "bfloat16", id="llama-tied-sharded-to-bf16"),
    pytest.param("qwen3", False, True, torch.bfloat16, "float32", id="qwen3-sharded-bf16-to-fp32"),
    pytest.param("qwen3", True, False, torch.bfloat16, "auto", id="qwen3-tied-bf16"),
]


@pytest.mark.parametrize(("kind", "tied", "shard", "stored", "dtype"), BORROWED)
def test_borrowed_verifier_is_what_the_full_load_gives(tmp_path, kind, tied, shard, stored, dtype):
    """Offline training's verifier (config, tokenizer, three tensors read by name) gives the spec,
    config hash and tensors (values, dtype, device, tying) of the full model load."""
    from specctl.recipe import recipe_from_dict
    from specctl.verifier import config_hash, load_borrowed, recipe_verifier_spec, verifier_weights

    path = save_verifier(tmp_path / "v", kind, tied, shard, stored)
    if shard:
        assert len(list(path.glob("*.safetensors"))) > 2 and (path / "model.safetensors.index.json").is_file()
    section = VerifierSection(name_or_path=str(path), device="cpu", dtype=dtype)
    full, borrowed = load_verifier(section), load_borrowed(section)
    recipe = recipe_from_dict(
        {"name": "t", "verifier": section.model_dump(), "features": {"aux_layer_ids": [1, 3]}}
    )
    assert recipe_verifier_spec(borrowed, recipe) == recipe_verifier_spec(full, recipe)
    assert config_hash(borrowed.config) == config_hash(full.config)
    want = verifier_weights(full)
    for name in ("embed_tokens", "lm_head", "norm"):
        a, b = getattr(want, name), getattr(borrowed.weights, name)
        assert torch.equal(a, b) and a.dtype == b.dtype == full.dtype and b.device == full.device, name
    assert (borrowed.weights.lm_head is borrowed.weights.embed_tokens) == tied
    assert not torch.equal(borrowed.weights.norm, torch.ones_like(borrowed.weights.norm))


def test_a_hub_verifier_downloads_only_what_training_reads(tmp_path, monkeypatch):
    """A hub id: config, tokenizer, the index and the shards that hold the embeddings, final norm and
    LM head are fetched; no shard that holds only decoder layers. (The hub is a local directory
    here: snapshot_download copies the files its patterns match into a snapshot directory.)"""
    import fnmatch
    import shutil

    import huggingface_hub

    from specctl.hf_weights import INDEX_FILE
    from specctl.verifier import load_borrowed, verifier_weights

    remote = save_verifier(tmp_path / "remote", shard=True)
    snapshot = tmp_path / "snapshot"
    fetched: list[str] = []

    def snapshot_download(repo, revision=None, allow_patterns=None):
        assert repo == "someorg/tiny" and allow_patterns
        snapshot.mkdir(exist_ok=True)
        for file in sorted(remote.iterdir()):
            if any(fnmatch.fnmatch(file.name, p) for p in allow_patterns):
                shutil.copy(file, snapshot / file.name)
                fetched.append(file.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    borrowed = load_borrowed(VerifierSection(name_or_path="someorg/tiny", device="cpu"))
    weight_map = json.loads((remote / INDEX_FILE).read_text())["weight_map"]
    needed = {weight_map[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    shards = {f for f in fetched if f.endswith(".safetensors")}
    assert shards == needed and len(set(weight_map.values())) > len(needed)
    assert {"config.json", "tokenizer.json", INDEX_FILE} <= set(fetched)
    full = verifier_weights(load_verifier(VerifierSection(name_or_path=str(remote), device="cpu")))
    assert torch.equal(borrowed.weights.lm_head, full.lm_head) and torch.equal(
        borrowed.weights.norm, full.norm
    )
    assert borrowed.hub_id == "someorg/tiny"


def test_a_checkpoint_without_safetensors_is_loaded_whole_with_a_note(tmp_path, capsys):
    """.bin only: the tensors cannot be read by name, so the full load gives them (same values)."""
    from specctl.verifier import load_borrowed, verifier_weights

    path = save_verifier(tmp_path / "v")
    full = load_verifier(VerifierSection(name_or_path=str(path), device="cpu"))
    want = verifier_weights(full)
    torch.save(full.model.state_dict(), path / "pytorch_model.bin")
    for file in path.glob("*.safetensors"):
        file.unlink()
    borrowed = load_borrowed(VerifierSection(name_or_path=str(path), device="cpu"))
    assert "no safetensors files, so the whole model is loaded" in capsys.readouterr().err
    for k in ("embed_tokens", "lm_head", "norm"):
        assert torch.equal(getattr(borrowed.weights, k), getattr(want, k)), k


def test_borrowed_tensors_that_do_not_fit_the_config_are_one_line(tmp_path):
    from safetensors.torch import load_file, save_file

    from specctl.errors import VerifierError
    from specctl.verifier import load_borrowed

    path = save_verifier(tmp_path / "v")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        VerifierError, match=r"do not fit hidden size 64 / vocabulary 320 in config.json"
    ) as e:
        load_borrowed(VerifierSection(name_or_path=str(path), device="cpu"))
    assert "\n" not in str(e.value)


def test_the_builtin_alias_reads_its_converted_directory(tmp_path, monkeypatch):
    """'smollm2-135m-instruct' resolves to its converted HF directory in the cache (a tiny stand-in
    here: the package is not needed once converted); the borrowed verifier records the hub id and
    gives the full load's spec and tensors."""
    from specctl.recipe import recipe_from_dict
    from specctl.verifier import BUILTIN_VERIFIERS, load_borrowed, recipe_verifier_spec, verifier_weights

    alias = "smollm2-135m-instruct"
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path))
    converted = save_verifier(tmp_path / "models" / alias, tied=True)
    hub_id = BUILTIN_VERIFIERS[alias]["hub_id"]
    (converted / "specctl.json").write_text(json.dumps({"hub_id": hub_id, "source": "x.gguf"}))
    section = VerifierSection(name_or_path=alias, device="cpu")
    full, borrowed = load_verifier(section), load_borrowed(section)
    recipe = recipe_from_dict(
        {"name": "t", "verifier": section.model_dump(), "features": {"aux_layer_ids": [1, 2]}}
    )
    spec = recipe_verifier_spec(borrowed, recipe)
    assert spec == recipe_verifier_spec(full, recipe) and spec.name_or_path == hub_id == borrowed.hub_id
    want = verifier_weights(full)
    assert torch.equal(borrowed.weights.lm_head, want.lm_head) and torch.equal(
        borrowed.weights.norm, want.norm
    )
