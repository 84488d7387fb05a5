"""Reliability and security: pre-flight validation, corrupt checkpoints and features, hub tokens,
unsafe calls, and the reliability matrix page generated from the tests' @fault lines.

The pipeline tests drive the real CLI entry point (`specctl.cli.main`, as `python -m specctl`
runs it) on the tiny random verifier of conftest.py; the bad-input fuzzing is in test_fuzz.py.
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from reliability_matrix import DOC, Row, collect_rows, fault, render
from test_collect import write_conversations

from specctl import checkpoint as ckpt
from specctl import runlock
from specctl.cli import main
from specctl.collect import collect
from specctl.distributed import DistContext
from specctl.durable import host_name
from specctl.errors import CheckpointError
from specctl.features import finalize_store, open_features, shard_name, write_shard
from specctl.recipe import load_recipe
from specctl.speculators.validate import validate_export
from specctl.train import loop as train_mod
from specctl.train import run_training

ROOT = Path(__file__).resolve().parents[1]
CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)
TINY_VOCAB, TINY_LAYERS = 320, 4  # conftest.make_tiny_verifier


def run_main(monkeypatch, capfd, *args: str) -> tuple[int, str, str]:
    """`specctl ARGS` in this process: exit code, stdout, stderr (file descriptors, so whatever
    a library prints is caught too)."""
    monkeypatch.setattr(sys, "argv", ["specctl", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capfd.readouterr()
    return code, out, err


def write_recipe(tmp_path: Path, verifier: Path | str) -> Path:
    """A CPU-sized recipe for the tiny verifier: 8 short conversations, a 1-layer DFlash, 2 steps."""
    tree = {
        "name": "tiny",
        "output_dir": str(tmp_path / "runs"),
        "verifier": {"name_or_path": str(verifier), "device": "cpu"},
        "data": {"source": str(write_conversations(tmp_path / "chats.jsonl", n=8)), "max_length": 96},
        "features": {"aux_layer_ids": [1, 2, 3], "shard_tokens": 400, "dtype": "float32"},
        "drafter": {"algo": "dflash", "dflash": {"num_layers": 1, "block_size": 4, "max_anchors": 8}},
        "train": {"max_steps": 2, "save_every": 2, "eval_every": 2, "batch_tokens": 256, "warmup_steps": 0},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


# ---------------------------------------------------------------- pre-flight validation


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if training gets as far as loading the verifier's weights, the data or the
    feature store: pre-flight errors must come first."""

    def heavy(what: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"pre-flight let the run reach {what}")

        return refuse

    monkeypatch.setattr(train_mod, "load_verifier", heavy("load_verifier"))
    monkeypatch.setattr(train_mod, "load_borrowed", heavy("load_borrowed"))
    monkeypatch.setattr(train_mod, "prepare_data", heavy("prepare_data"))
    monkeypatch.setattr(train_mod, "open_features", heavy("open_features"))


PREFLIGHT = [
    pytest.param(["--algo", "medusa"], 2, "drafter.algo: unknown algorithm 'medusa'", id="unknown-algo"),
    pytest.param(
        ["--set", "drafter.dflash.block_size=0"],
        2,
        "drafter.dflash.block_size: Input should be greater than or equal to 2",
        id="block-size-0",
    ),
    pytest.param(
        ["--set", "drafter.dflash.block_size=4", "--set", "drafter.dflash.num_speculative_tokens=8"],
        2,
        "num_speculative_tokens=8 exceeds the 3 predictions of a block of 4",
        id="dflash-k-over-block",
    ),
    pytest.param(
        [
            "--algo",
            "dspark",
            "--set",
            "drafter.dspark.block_size=4",
            "--set",
            "drafter.dspark.num_speculative_tokens=5",
        ],
        2,
        "num_speculative_tokens=5 exceeds the 4 predictions of a block of 4",
        id="dspark-k-over-block",
    ),
    pytest.param(
        [
            "--algo",
            "peagle",
            "--set",
            "drafter.peagle.num_depths=3",
            "--set",
            "drafter.peagle.num_speculative_tokens=4",
        ],
        2,
        "num_speculative_tokens (4) cannot exceed num_depths (3)",
        id="peagle-k-over-depths",
    ),
    pytest.param(
        ["--set", f"drafter.mask_token_id={TINY_VOCAB}"],
        2,
        f"drafter.mask_token_id {TINY_VOCAB}: out of the verifier's vocabulary 0..{TINY_VOCAB - 1}",
        id="mask-id-past-vocab",
    ),
    pytest.param(
        ["--set", "drafter.mask_token_id=-1"],
        2,
        f"drafter.mask_token_id -1: out of the verifier's vocabulary 0..{TINY_VOCAB - 1}",
        id="mask-id-negative",
    ),
    pytest.param(
        ["--set", f"drafter.draft_vocab_size={TINY_VOCAB + 1}"],
        2,
        f"drafter.draft_vocab_size={TINY_VOCAB + 1} exceeds the verifier's vocabulary of {TINY_VOCAB}",
        id="draft-vocab-over-vocab",
    ),
    pytest.param(
        ["--set", "features.aux_layer_ids=[1,2,5]"],
        2,
        f"features.aux_layer_ids [1, 2, 5]: each must be in 0..{TINY_LAYERS}",
        id="aux-layer-past-last",
    ),
    pytest.param(
        ["--set", "features.aux_layer_ids=[-1,2]"],
        2,
        f"features.aux_layer_ids [-1, 2]: each must be in 0..{TINY_LAYERS}",
        id="aux-layer-negative",
    ),
]


@fault(
    stage="train",
    fault="unknown algorithm, block size 0, K past the block (dflash, dspark) or depths (peagle), mask "
    "token id outside the vocabulary, draft vocab larger than the verifier's, aux layer ids out of range",
    result="`specctl train` exits non-zero with one line naming the field, before the verifier's "
    "weights, the data or the features are loaded",
)
@pytest.mark.parametrize("args, code, needle", PREFLIGHT)
def test_train_preflight_rejects_before_heavy_work(
    monkeypatch, capfd, tmp_path, tiny_verifier_dir, no_heavy_work, args, code, needle
):
    recipe = write_recipe(tmp_path, tiny_verifier_dir)
    got, out, err = run_main(monkeypatch, capfd, "train", str(recipe), *args)
    assert got == code, err
    assert needle in err
    assert err.strip().startswith("error:") and err.strip().count("\n") == 0
    assert not (tmp_path / "runs").exists()  # nothing written: no data, no features, no checkpoints


# ---------------------------------------------------------------- corrupt checkpoints


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tiny_checkpoint(root: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path = ckpt.save_checkpoint(
        root, 3, model, optimizer, {"step": 3, "cursor": 3}, "name: x\n", {"algo": "toy"}, CPU, keep=2
    )
    return path, model, optimizer


@fault(
    stage="train",
    fault="one flipped bit in any file of a checkpoint: drafter.safetensors, optimizer.pt, "
    "trainer_state.pt, recipe.yaml, meta.json",
    result="loading it (and export, for the drafter file) refuses it: CheckpointError naming the file, "
    "`checksum mismatch`, and what to delete; resume passes over it to the one before",
)
@pytest.mark.parametrize("name", ckpt.CHECKSUMMED)
def test_flipped_bit_in_a_checkpoint_is_named(tmp_path, name):
    path, model, optimizer = _tiny_checkpoint(tmp_path / "checkpoints")
    ckpt.load_checkpoint(path, model, optimizer, CPU)  # intact: loads
    _flip_byte(path / name)
    with pytest.raises(CheckpointError) as e:
        ckpt.load_checkpoint(path, model, optimizer, CPU)
    assert str(e.value).startswith(f"{path / name}: checksum mismatch (corrupted); delete {path}")
    assert ckpt.checkpoint_problem(path) == f"{name}: checksum mismatch (corrupted)"
    assert "\n" not in str(e.value)
    if name == ckpt.DRAFTER_FILE:
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            ckpt.load_drafter_state(path)
    else:
        assert ckpt.load_drafter_state(path).keys() == model.state_dict().keys()


@fault(
    stage="train",
    fault="a checkpoint whose checksums.json is missing or not JSON",
    result="missing: not a complete checkpoint, never picked as latest; "
    "unreadable: CheckpointError naming it",
)
def test_checkpoint_without_readable_checksums(tmp_path):
    root = tmp_path / "checkpoints"
    path, model, optimizer = _tiny_checkpoint(root)
    (path / ckpt.CHECKSUM_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"checksums\.json: missing or unreadable"):
        ckpt.load_checkpoint(path, model, optimizer, CPU)
    (path / ckpt.CHECKSUM_FILE).unlink()
    assert not ckpt.is_complete(path) and ckpt.latest_checkpoint(root) is None


@fault(
    stage="train",
    fault="a checkpoint's meta.json or recipe.yaml that does not parse (not JSON, not an object, bad "
    "YAML, an invalid recipe), its checksum matching (a checkpoint from before they were checksummed)",
    result="export and resume stop with a CheckpointError naming the file and why, never a traceback",
)
@pytest.mark.parametrize(
    ("name", "text", "why"),
    [
        (ckpt.META_FILE, "{broken", r"unreadable \(Expecting property name"),
        (ckpt.META_FILE, "[1, 2]", "holds a JSON list, not an object"),
        (ckpt.META_FILE, "\udcff", r"unreadable \("),
        (ckpt.RECIPE_FILE, "drafter: [unclosed\n", r"unreadable \(while parsing a flow sequence"),
        (ckpt.RECIPE_FILE, "- a list\n", r"not a valid recipe \("),
        (ckpt.RECIPE_FILE, "train: {lr: -1}\n", r"not a valid recipe \(recipe\.yaml: name: required"),
    ],
)
def test_broken_meta_or_recipe_of_a_checkpoint_is_one_line(tmp_path, name, text, why):
    path, _, _ = _tiny_checkpoint(tmp_path / "checkpoints")
    data = text.encode("utf-8", "surrogateescape")
    (path / name).write_bytes(data)
    sums = json.loads((path / ckpt.CHECKSUM_FILE).read_text())
    del sums[ckpt.RECIPE_FILE], sums[ckpt.META_FILE]  # as an older checkpoint lists them
    (path / ckpt.CHECKSUM_FILE).write_text(json.dumps(sums))
    read = ckpt.read_meta if name == ckpt.META_FILE else ckpt.saved_recipe
    message = rf"^{re.escape(str(path / name))}: {why}.*; delete {re.escape(str(path))}:"
    with pytest.raises(CheckpointError, match=message) as e:
        read(path)
    assert "\n" not in str(e.value)
    assert re.fullmatch(rf"{re.escape(name)}: {why}.*", ckpt.checkpoint_problem(path))


# ---------------------------------------------------------------- non-finite features


@fault(
    stage="train",
    fault="NaN or Inf in a feature shard whose checksum matches (a float16 overflow at collect time)",
    result="`specctl train` stops before the sample reaches a batch, naming the shard file, the sample "
    "and the tensor",
)
@pytest.mark.parametrize(
    "bad, key", [(float("nan"), "aux_hidden_states"), (float("inf"), "last_hidden_state")]
)
def test_non_finite_features_are_named_before_training(
    monkeypatch, capfd, tmp_path, tiny_verifier_dir, bad, key
):
    recipe = write_recipe(tmp_path, tiny_verifier_dir)
    assert run_main(monkeypatch, capfd, "collect-hidden-states", str(recipe))[0] == 0
    features = tmp_path / "runs" / "tiny" / "features"
    store = open_features(features)
    assert len(store.manifest.shards) >= 2
    start, end = store.manifest.shards[1]
    samples = [store[i] for i in range(start, end)]
    samples[-1][key] = samples[-1][key].clone()
    samples[-1][key][0, 0] = bad
    (features / "manifest.json").unlink()
    write_shard(features, 1, samples, store.layout)  # a valid shard, checksum and all, holding `bad`
    finalize_store(features)

    from specctl.drafters.dflash import DFlashDrafter

    forward = DFlashDrafter.forward

    def finite_forward(self, batch):
        assert all(v.isfinite().all() for v in batch.values() if v.is_floating_point()), "NaN reached"
        return forward(self, batch)

    monkeypatch.setattr(DFlashDrafter, "forward", finite_forward)
    # enough steps to visit every sample (each is checked once, the first time it is read)
    code, _, err = run_main(monkeypatch, capfd, "train", str(recipe), "--set", "train.max_steps=40")
    assert code == 1, err
    shard = features / f"{shard_name(1)}.safetensors"
    last = err.strip().splitlines()[-1]  # after the progress line
    assert last.startswith(
        f"error: {shard}: sample {end - start - 1} (store sample {end - 1}) holds NaN/Inf in {key}"
    )


# ---------------------------------------------------------------- hub tokens

SENTINEL = "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0123"


@fault(
    stage="hygiene",
    fault="HF_TOKEN / HUGGING_FACE_HUB_TOKEN set while collect, train, export, push --dry-run succeed and "
    "an unreachable hub verifier and a refused push fail",
    result="the token appears in no output (stdout, stderr) and in no file written (run dir, caches)",
)
def test_hub_token_is_never_printed_or_written(monkeypatch, capfd, tmp_path, tiny_verifier_dir):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(var, SENTINEL)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # whatever the hub libraries cache lands here
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "specctl-cache"))
    # no network: the hub client gets the token and fails at once (huggingface_hub reads the
    # variable at import, so its constant is set too)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    recipe = write_recipe(tmp_path, tiny_verifier_dir)
    run = tmp_path / "runs" / "tiny"
    outputs = []

    def specctl(*args: str, code: int) -> None:
        got, out, err = run_main(monkeypatch, capfd, *args)
        assert got == code, err
        outputs.append(out + err)

    specctl("collect-hidden-states", str(recipe), code=0)
    specctl("train", str(recipe), code=0)
    specctl("export", str(run), "--push-to-hub", "me/tiny-drafter", "--dry-run", code=0)
    specctl("export", str(run), "--push-to-hub", "me/tiny-drafter", code=1)
    assert "push to me/tiny-drafter failed" in outputs[-1]
    (tmp_path / "hub").mkdir()
    hub_verifier = write_recipe(tmp_path / "hub", "someorg/not-a-cached-model")
    specctl("collect-hidden-states", str(hub_verifier), code=1)
    assert "not-a-cached-model" in outputs[-1]

    assert not [i for i, text in enumerate(outputs) if SENTINEL in text]
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in written)  # the export really ran
    assert not [p for p in written if SENTINEL.encode() in p.read_bytes()]


# ---------------------------------------------------------------- unsafe calls, by reading the source

# SafeLoader is what safe_load runs (plain types only): recipe.py subclasses it to refuse duplicate keys
YAML_SAFE = {"safe_load", "safe_dump", "YAMLError", "SafeLoader"}
SHELL_CALLS = {
    ("os", "system"),
    ("os", "popen"),
    ("subprocess", "getoutput"),
    ("subprocess", "getstatusoutput"),
}


def unsafe_calls(source: str, filename: str) -> list[str]:
    """`file:line: what` for each call specctl must not make: a YAML loader that builds Python
    objects, a shell, torch.load without weights_only=True, pickle, eval/exec."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        line = getattr(node, "lineno", 0)
        where = f"{filename}:{line}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, name = node.value.id, node.attr
            if owner == "yaml" and name not in YAML_SAFE:
                found.append((line, f"{where}: yaml.{name} (use yaml.safe_load / yaml.safe_dump)"))
            if (owner, name) in SHELL_CALLS:
                found.append((line, f"{where}: {owner}.{name} runs a shell"))
        if isinstance(node, ast.ImportFrom) and node.module in ("yaml", "pickle", "torch"):
            names = {a.name for a in node.names}
            bad = names - YAML_SAFE if node.module == "yaml" else names & {"load", "loads", "Unpickler"}
            if bad:
                found.append((line, f"{where}: from {node.module} import {', '.join(sorted(bad))}"))
        if isinstance(node, ast.Import) and any(a.name in ("pickle", "dill", "marshal") for a in node.names):
            found.append((line, f"{where}: imports a pickle-like deserializer"))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kwargs = {k.arg: k.value for k in node.keywords}
        if "shell" in kwargs and not (
            isinstance(kwargs["shell"], ast.Constant) and kwargs["shell"].value is False
        ):
            found.append((line, f"{where}: shell=... (pass an argument list)"))
        if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
            found.append((line, f"{where}: {func.id}()"))
        is_torch_load = (
            isinstance(func, ast.Attribute)
            and func.attr == "load"
            and getattr(func.value, "id", None) == "torch"
        )
        weights_only = kwargs.get("weights_only")
        if is_torch_load and not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
            found.append((line, f"{where}: torch.load without weights_only=True"))
    return [text for _, text in sorted(found)]


@fault(
    stage="hygiene",
    fault="unsafe calls in specctl/: yaml.load/full_load/unsafe_load, shell=True, os.system/popen, "
    "torch.load without weights_only=True, pickle, eval/exec",
    result="none, checked by reading every source file (the scan itself is tested on a bad snippet)",
)
def test_no_unsafe_calls_in_specctl():
    bad = (
        "import yaml, pickle, subprocess, os, torch\n"
        "yaml.load(s, Loader=yaml.Loader)\nyaml.unsafe_load(s)\n"
        "subprocess.run('ls', shell=True)\nos.system('ls')\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\neval('1')\n"
        "torch.load(f, weights_only=True)\nsubprocess.run(['ls'], shell=False)\nmodel.eval()\n"
    )
    assert [line.split(": ", 1)[0] for line in unsafe_calls(bad, "bad.py")] == [
        "bad.py:1",  # import pickle
        "bad.py:2",  # yaml.load
        "bad.py:2",  # yaml.Loader
        "bad.py:3",
        "bad.py:4",
        "bad.py:5",
        "bad.py:6",
        "bad.py:7",
        "bad.py:8",
    ]
    sources = sorted((ROOT / "specctl").rglob("*.py"))
    assert len(sources) > 20
    found = [f for path in sources for f in unsafe_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


# ---------------------------------------------------------------- the reliability matrix


def test_reliability_doc_in_sync():
    rows = collect_rows()
    assert {r.stage for r in rows} >= {"recipe", "data", "collect", "train", "export", "bench", "hygiene"}
    assert DOC.read_text() == render(rows), "run `python tests/reliability_matrix.py > docs/reliability.md`"


def test_fault_lines_are_checked(tmp_path):
    with pytest.raises(ValueError, match="stage 'trian'"):
        fault(stage="trian", fault="x", result="y")
    (tmp_path / "test_x.py").write_text(
        "@fault(stage='train', fault='a', result='b')\ndef test_a(): ...\n\n"
        "@fault(stage='recipe', fault=F, result='b')\ndef test_b(): ...\n"
    )
    with pytest.raises(ValueError, match=r"test_x.py::test_b: @fault\(fault=...\) must be a string literal"):
        collect_rows(tmp_path)
    (tmp_path / "test_x.py").write_text(
        "@fault(stage='train', fault='a|b', result='c')\ndef test_a(): ...\n\n"
        "@fault(stage='recipe', fault='d', result='e')\ndef test_b(): ...\n"
    )
    rows = collect_rows(tmp_path)
    assert rows == [
        Row("recipe", "d", "e", "tests/test_x.py::test_b"),
        Row("train", "a|b", "c", "tests/test_x.py::test_a"),
    ]
    assert "| a\\|b | c | `tests/test_x.py::test_a` |" in render(rows)


# ---------------------------------------------------------------- real processes: kill -9 and a full disk
# `python -m specctl` runs in a child process and is killed or refused disk space for real; the
# reruns go through the same CLI in this process (the fault is the child's, the recovery is ours).
# Every run uses one torch thread (OMP_NUM_THREADS=1 in the child, the one_thread fixture here) so
# that a resumed run can be compared bit for bit with an uninterrupted one.

FAULT_SEED = int(os.environ.get("SPECCTL_FAULT_SEED", "0"))  # another seed: other kill points
FAULT_TRAIN = {"max_steps": 16, "save_every": 4, "eval_every": 8, "log_every": 1, "warmup_steps": 0}
FIRST, LAST = FAULT_TRAIN["save_every"], FAULT_TRAIN["max_steps"]  # first and last checkpoint
CHILD_ENV = {**{k: v for k, v in os.environ.items() if k != "SPECCTL_DEBUG"}, "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class FaultRun:
    """A collected tiny run and the uninterrupted training every faulted run must end up equal to."""

    recipe: dict  # the recipe tree; output_dir is set per run
    features: Path
    reference: Path  # runs/tiny/drafters/dflash of the uninterrupted run

    def fresh(self, tmp_path: Path) -> tuple[Path, Path]:
        """A new run dir holding a copy of the features: (recipe path, checkpoints dir)."""
        recipe = write_yaml(tmp_path / "tiny.yaml", {**self.recipe, "output_dir": str(tmp_path / "runs")})
        shutil.copytree(self.features, tmp_path / "runs" / "tiny" / "features")
        return recipe, tmp_path / "runs" / "tiny" / "drafters" / "dflash" / "checkpoints"


def write_yaml(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory, tiny_verifier_dir, one_thread) -> FaultRun:
    """Collected once per module: the features and the reference run cost seconds each."""
    tmp = tmp_path_factory.mktemp("fault-run")
    tree = yaml.safe_load(write_recipe(tmp, tiny_verifier_dir).read_text())
    tree["train"].update(FAULT_TRAIN)
    recipe = load_recipe(write_yaml(tmp / "tiny.yaml", tree))
    collect(recipe, progress=False)
    run_training(recipe, progress=False)
    return FaultRun(tree, recipe.run_dir / "features", recipe.run_dir / "drafters" / "dflash")


def start_specctl(tmp_path: Path, *args: str, preexec=None) -> subprocess.Popen:
    """`python -m specctl ARGS` in a child process; stderr goes to tmp_path/stderr.txt (a pipe
    nobody reads while polling could fill up and stall the child)."""
    with open(tmp_path / "stderr.txt", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "specctl", *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=CHILD_ENV,
            preexec_fn=preexec,
        )


def wait_until(proc: subprocess.Popen, ready, what: str, timeout: float = 240) -> None:
    """Poll `ready()` every 2 ms while the child runs; fail if it ends or times out first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the child exited ({proc.returncode}) before {what}: too late to test"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def steps_logged(metrics: Path) -> int:
    """The last training step metrics.jsonl holds a complete line for (0 when none)."""
    if not metrics.is_file():
        return 0
    lines = metrics.read_text().split("\n")[:-1]  # the last piece may be a line being written
    return max((r["step"] for r in map(json.loads, lines) if "loss" in r), default=0)


def pointer(root: Path) -> str | None:
    try:
        return (root / ckpt.LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def assert_never_half_written(root: Path) -> Path:
    """The checkpoint resume would pick is complete and its checksums verify, and so is every
    step-N directory that looks complete (a half-written one stays hidden as .step-N.tmp-PID)."""
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None, f"no checkpoint survived in {root}"
    for path in [latest, *(p for p in root.glob("step-*") if ckpt.is_complete(p))]:
        ckpt.verify_checksums(path)
    return latest


def assert_same_as_reference(fault_run: FaultRun, root: Path) -> None:
    """metrics.jsonl (each step once, throughput aside) and the final weights equal the
    uninterrupted run's; the interrupted writes left nothing behind."""

    def records(drafter_dir: Path) -> list[dict]:
        lines = (drafter_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]

    assert records(root.parent) == records(fault_run.reference)
    want = ckpt.load_drafter_state(fault_run.reference / "checkpoints" / f"step-{LAST}")
    got = ckpt.load_drafter_state(root / f"step-{LAST}")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    kept = ["latest", f"step-{LAST - FIRST}", f"step-{LAST}"]  # train.keep_checkpoints: 2
    assert sorted(p.name for p in root.iterdir()) == kept


@fault(
    stage="train",
    fault="kill -9 of `specctl train` at a seeded-random point after the first checkpoint: mid-step, "
    "or while a checkpoint is written (its temporary dir or its new step dir just appeared)",
    result="the checkpoint resume picks is complete and its checksums verify; `--resume` finishes "
    "with metrics.jsonl and final weights identical to an uninterrupted run, no temporary files left; "
    "resumed from another node (mid-step), the dead run's lock is taken over once its lease lapsed",
)
@pytest.mark.parametrize("when", ["mid-step", "mid-checkpoint"])
def test_kill_9_during_train_then_resume_matches_uninterrupted(monkeypatch, capfd, tmp_path, fault_run, when):
    """A preempted or OOM-killed trainer gets no chance to clean up: whatever instant it dies at,
    --resume must pick a whole checkpoint and repeat the lost steps exactly. Polled every 2 ms, the
    kill as a checkpoint appears lands mid-write in practice (seeds 0-3 left .step-N.tmp-PID behind)."""
    recipe, root = fault_run.fresh(tmp_path)
    rng = random.Random(f"{FAULT_SEED}-{when}")
    proc = start_specctl(tmp_path, "train", str(recipe))
    if when == "mid-step":
        # any step between checkpoints, some steps before the end (the kill must beat the run)
        step, delay = rng.randint(FIRST + 1, LAST - FIRST), rng.uniform(0, 0.05)
        where = f"seed {FAULT_SEED}: after step {step} was logged, +{delay * 1000:.0f} ms"
        wait_until(proc, lambda: steps_logged(root.parent / "metrics.jsonl") >= step, f"step {step}")
        time.sleep(delay)
    else:
        step = rng.choice(range(2 * FIRST, LAST, FIRST))  # a checkpoint after the first one
        where = f"seed {FAULT_SEED}: as checkpoint step-{step} appeared"
        wait_until(
            proc,
            lambda: (root / f"step-{step}").exists() or any(root.glob(f".step-{step}.tmp-*")),
            f"checkpoint step-{step}",
        )
    proc.kill()
    assert proc.wait() == -signal.SIGKILL, f"{where}: the run finished before the kill"
    latest = assert_never_half_written(root)
    # the run may have gone on past `step` before the kill landed (a loaded CI machine): a
    # checkpoint can never be newer than the last step the killed run logged (log_every: 1)
    ran = steps_logged(root.parent / "metrics.jsonl")
    assert FIRST <= ckpt.step_of(latest) <= ran, f"{where}: {ran} steps logged before the kill"

    if when == "mid-step":  # requeued onto another node, after the dead run's lease lapsed
        monkeypatch.setattr(runlock, "host_name", lambda: "node-b")
        lock = runlock.lock_path(root.parent)
        os.utime(lock, (time.time() - 7200, time.time() - 7200))
    code, _, err = run_main(monkeypatch, capfd, "train", str(recipe), "--resume")
    assert code == 0, f"{where}: {err}"
    if when == "mid-step":
        assert f"taking over a stale lock of pid {proc.pid} on {host_name()}" in err, err
        assert "(no heartbeat for 720" in err and not lock.exists()
    assert_same_as_reference(fault_run, root)


@fault(
    stage="train",
    fault="disk full (RLIMIT_FSIZE lowered on the running `specctl train` once its first checkpoint "
    "is saved) while a later checkpoint's optimizer.pt is written",
    result="exit 1, one line `step-N/optimizer.pt: disk full, checkpoint step-N not saved; free space "
    "and rerun the same command (it continues from step-M)`; step-M intact, no temporary dir; the "
    "rerun of the same command matches an uninterrupted run",
)
def test_disk_full_during_train_keeps_the_previous_checkpoint(monkeypatch, capfd, tmp_path, fault_run):
    """A disk filling up hours into a run: the user needs to know what failed and that nothing
    is lost, and the state files must not be half-written where resume would read them. The limit
    lands in optimizer.pt, the torch.save path (the export test covers the safetensors one)."""
    recipe, root = fault_run.fresh(tmp_path)
    reference = fault_run.reference / "checkpoints" / f"step-{LAST}"
    drafter, optimizer = (
        (reference / name).stat().st_size for name in (ckpt.DRAFTER_FILE, ckpt.OPTIMIZER_FILE)
    )
    limit = (drafter + optimizer) // 2  # drafter.safetensors fits, optimizer.pt does not
    assert drafter < limit < optimizer
    assert (fault_run.reference / "metrics.jsonl").stat().st_size < limit  # the log keeps growing freely
    proc = start_specctl(tmp_path, "train", str(recipe))
    # a preexec_fn limit would refuse the first checkpoint too: lower it on the running child
    wait_until(proc, lambda: pointer(root) == f"step-{FIRST}", f"checkpoint step-{FIRST}")
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
    assert proc.wait(timeout=240) == 1
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    failed = re.fullmatch(
        rf"error: {re.escape(str(root))}/step-(\d+)/optimizer\.pt: disk full, checkpoint step-\1 not "
        r"saved; free space and rerun the same command \(it continues from step-(\d+)\)",
        line,
    )
    assert failed, line
    step, previous = int(failed.group(1)), int(failed.group(2))
    assert step > FIRST and previous == step - FIRST
    assert assert_never_half_written(root) == root / f"step-{previous}"
    assert not (root / f"step-{step}").exists()
    assert not [p for p in root.iterdir() if ".tmp-" in p.name]

    code, _, err = run_main(monkeypatch, capfd, "train", str(recipe))  # the same command again
    assert code == 0, err
    assert_same_as_reference(fault_run, root)


@fault(
    stage="export",
    fault="disk full (RLIMIT_FSIZE) while `specctl export` writes model.safetensors, into a new "
    "directory and over a previous good export",
    result="exit 1, one line `OUTPUT: disk full writing the export, nothing was written` / `the export "
    "already there is unchanged; free space and rerun`; no partial or temporary directory; the rerun "
    "succeeds",
)
def test_disk_full_during_export_leaves_no_partial_export(monkeypatch, capfd, tmp_path, fault_run):
    """vLLM and `export --check` take any directory with config.json and model.safetensors for an
    export: a truncated model.safetensors must never sit at OUTPUT, and a good export there must
    survive a failed re-export."""
    checkpoint = fault_run.reference / "checkpoints" / f"step-{LAST}"
    output = tmp_path / "export"
    limit = 50_000  # config.json fits; the bfloat16 model.safetensors (~100 kB) does not

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    def export_under_limit(*args: str) -> str:
        proc = start_specctl(tmp_path, "export", str(checkpoint), "--output", str(output), *args, preexec=cap)
        assert proc.wait(timeout=240) == 1
        err = (tmp_path / "stderr.txt").read_text()
        assert "Traceback" not in err and err.strip().count("\n") == 0, err
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")]
        return err.strip()

    assert export_under_limit() == (
        f"error: {output}: disk full writing the export, nothing was written; free space and rerun"
    )
    assert not output.exists()

    assert run_main(monkeypatch, capfd, "export", str(checkpoint), "--output", str(output))[0] == 0
    good = {p.name: p.read_bytes() for p in output.iterdir()}
    assert export_under_limit("--dtype", "float32") == (
        f"error: {output}: disk full writing the export, the export already there is unchanged; "
        "free space and rerun"
    )
    assert {p.name: p.read_bytes() for p in output.iterdir()} == good
    assert run_main(monkeypatch, capfd, "export", str(output))[0] == 0  # `export DIR`: the check

    code, _, err = run_main(
        monkeypatch, capfd, "export", str(checkpoint), "--output", str(output), "--dtype", "float32"
    )
    assert code == 0, err
    headers = validate_export(output).headers
    assert {dtype for _, dtype in headers.values() if dtype.is_floating_point} == {torch.float32}


# the model card's provenance line, to the minute (specctl.export.card._provenance)
EXPORTED_AT = rb"- exported \d{4}-\d\d-\d\d \d\d:\d\d UTC"

# `python -m specctl ARGS` that SIGKILLs itself at one instant of the export's directory swap.
# kill -9 runs no cleanup, so neither can this: os.kill, not an exception.
KILL_EXPORT_AT = """
import os, runpy, shutil, signal, sys
import specctl.durable as durable, specctl.speculators.io as files_io
where, sys.argv = sys.argv[1], ["specctl", *sys.argv[2:]]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
real_save, real_fsync, real_rename, real_rmtree = (
    files_io.save_file, durable.fsync_files, os.rename, shutil.rmtree)
renames = []

def save_file(state, filename, metadata=None):  # half of model.safetensors on disk
    real_save(state, filename, metadata=metadata)
    if where == "mid-write":
        os.truncate(filename, os.path.getsize(filename) // 2)
        die()

def fsync_files(path):
    real_fsync(path)
    if where == "written":
        die()

def rename(src, dst):
    renames.append(src)
    if where == "between-renames" and len(renames) == 2:
        die()
    real_rename(src, dst)

def rmtree(path, *args, **kwargs):
    if where == "after-swap" and ".old-" in str(path):
        die()
    real_rmtree(path, *args, **kwargs)

files_io.save_file, durable.fsync_files, os.rename, shutil.rmtree = save_file, fsync_files, rename, rmtree
runpy.run_module("specctl", run_name="__main__")
"""


@fault(
    stage="export",
    fault="kill -9 of `specctl export` over a previous good export: mid-write of model.safetensors, "
    "once the new directory is written, between the two renames of the swap, after the swap",
    result="OUTPUT always holds one whole export (the previous one; the new one after the swap); "
    "the rerun's export is byte-identical to an uninterrupted one and leaves no .export.tmp/.old dirs",
)
@pytest.mark.parametrize("where", ["mid-write", "written", "between-renames", "after-swap"])
def test_kill_9_during_export_then_rerun_matches_uninterrupted(
    monkeypatch, capfd, tmp_path, fault_run, where
):
    """A killed export must never leave vLLM a directory that looks like an export and is not one,
    nor lose the export that was there: at every instant of the swap OUTPUT is old or new, whole,
    and the one gap between the renames is repaired by the next export."""
    checkpoint = fault_run.reference / "checkpoints" / f"step-{LAST}"
    output, reference = tmp_path / "export", tmp_path / "reference"

    def files(out: Path) -> dict[str, bytes]:
        """The export's files, its own path in the model card's serve line written as OUT and the
        card's export minute as WHEN (two exports a minute boundary apart differ there only)."""
        return {
            p.name: re.sub(EXPORTED_AT, b"- exported WHEN", p.read_bytes().replace(str(out).encode(), b"OUT"))
            for p in out.iterdir()
        }

    def export(out: Path, *args: str) -> dict[str, bytes]:
        code, _, err = run_main(monkeypatch, capfd, "export", str(checkpoint), "--output", str(out), *args)
        assert code == 0, err
        return files(out)

    old = export(output)  # bfloat16
    new = export(reference, "--dtype", "float32")
    assert old != new
    with open(tmp_path / "stderr.txt", "w") as stderr:
        code = subprocess.run(
            [sys.executable, "-c", KILL_EXPORT_AT, where, "export", str(checkpoint), "--output", str(output)]
            + ["--dtype", "float32"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=CHILD_ENV,
            timeout=240,
        ).returncode
    assert code == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-2000:]
    if where == "between-renames":  # the one instant OUTPUT is missing: the old export waits beside it
        assert not output.exists() and [p.name for p in tmp_path.glob(".export.old-*")]
    else:
        assert files(output) == (new if where == "after-swap" else old)
        validate_export(output)

    assert export(output, "--dtype", "float32") == new
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
