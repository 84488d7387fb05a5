"""A requeued job reruns the same command: train continues where it stopped, `--restart` starts
over leaving nothing stale, and no two processes write the same part of a run (run locks)."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from reliability_matrix import fault
from safetensors.torch import load_file
from test_collect import write_conversations

from specctl import runlock
from specctl.durable import host_name
from specctl.errors import SpecctlError
from specctl.optim import lr_at
from specctl.runlock import LEASE_ENV, Holder, RunLocked, heartbeat_age, holder_stale, lock_path, run_lock
from specctl.train import run_training

ROOT = Path(__file__).resolve().parents[1]

# enough steps that a SIGTERM after the first checkpoints lands mid-run (about 10 ms a step here)
TRAIN = {
    "max_steps": 150,
    "lr": 3e-3,
    "warmup_steps": 5,
    "batch_tokens": 256,
    "val_fraction": 0.25,
    "eval_every": 50,
    "save_every": 5,
    "log_every": 1,
    "keep_checkpoints": 2,
    "precision": "float32",
}


def write_recipe(tmp_path: Path, verifier_dir: Path, name: str, **train) -> Path:
    recipe = {
        "name": name,
        "output_dir": str(tmp_path / "runs"),
        "verifier": {"name_or_path": str(verifier_dir)},
        "data": {"source": str(write_conversations(tmp_path / "chats.jsonl")), "max_length": 256},
        "features": {"aux_layer_ids": [1, 2, 3], "shard_tokens": 600, "batch_tokens": 512},
        "drafter": {"algo": "dflash", "dflash": {"num_layers": 1, "block_size": 4, "max_anchors": 8}},
        "train": {**TRAIN, **train},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "specctl", *args]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def collected(tmp_path_factory, tiny_verifier_dir) -> tuple[Path, Path]:
    """(working dir, recipe) with the features collected once; the training tests copy it."""
    tmp = tmp_path_factory.mktemp("rerun")
    recipe = write_recipe(tmp, tiny_verifier_dir, "r")
    done = run("collect-hidden-states", str(recipe))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp, recipe


def drafter_dir(tmp: Path) -> Path:
    return tmp / "runs" / "r" / "drafters" / "dflash"


def final_weights(tmp: Path) -> dict:
    root = drafter_dir(tmp) / "checkpoints"
    return load_file(root / (root / "latest").read_text().strip() / "drafter.safetensors")


def metric_steps(tmp: Path) -> list[int]:
    lines = (drafter_dir(tmp) / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "loss" in r]


def fresh_copy(collected, dest: Path) -> Path:
    """A copy of the collected run (features, data), no training in it."""
    import shutil

    tmp, _ = collected
    shutil.copytree(tmp / "runs", dest / "runs")
    shutil.copy(tmp / "r.yaml", dest / "r.yaml")
    recipe = yaml.safe_load((dest / "r.yaml").read_text())
    # the data source stays the collected one's: the features record which data they came from
    # (specctl.origin), and a copy of the source elsewhere is, by its path, other data
    recipe["output_dir"] = str(dest / "runs")
    (dest / "r.yaml").write_text(yaml.safe_dump(recipe))
    return dest / "r.yaml"


def sigterm_after_checkpoint(recipe: Path, ckpt_root: Path) -> subprocess.CompletedProcess:
    """Start `specctl train RECIPE`, SIGTERM it once its second checkpoint is saved."""
    proc = subprocess.Popen(
        cli("train", str(recipe)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        pointer = ckpt_root / "latest"
        if pointer.is_file() and pointer.read_text().strip() not in ("", "step-5"):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@fault(
    stage="train",
    fault="SIGTERM mid-run (a SLURM time limit), then the identical command again",
    result="exit 130 naming the checkpoint a rerun continues from; the rerun says `resuming at step N` "
    "and ends with weights bitwise equal to an uninterrupted run's, metrics steps 1..N once each",
)
def test_sigterm_then_the_same_command_equals_an_uninterrupted_run(collected, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    straight.mkdir(), stopped.mkdir()
    done = run("train", str(fresh_copy(collected, straight)))
    assert done.returncode == 0, done.stderr[-3000:]

    recipe = fresh_copy(collected, stopped)
    killed = sigterm_after_checkpoint(recipe, drafter_dir(stopped) / "checkpoints")
    assert killed.returncode == 130, killed.stderr[-3000:]
    last = (drafter_dir(stopped) / "checkpoints" / "latest").read_text().strip()
    assert last != f"step-{TRAIN['max_steps']}", "the run finished before the SIGTERM: nothing tested"
    assert killed.stderr.strip().splitlines()[-1] == (
        f"error: interrupted (SIGTERM); rerunning the same command continues from "
        f"{drafter_dir(stopped) / 'checkpoints' / last}"
    )
    again = run("train", str(recipe))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming at step {last.removeprefix('step-')} of {TRAIN['max_steps']}" in again.stderr
    # float32 on CPU, the RNG reseeded per micro-batch, optimizer and data cursor restored: the same
    # arithmetic in the same order, so equal to the bit (docs/training.md "Reproducibility")
    a, b = final_weights(straight), final_weights(stopped)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert metric_steps(stopped) == list(range(1, TRAIN["max_steps"] + 1)) == metric_steps(straight)


@fault(
    stage="train",
    fault="the same command rerun with other training settings (`--set train.lr=...`)",
    result="exit 1, one line naming the settings that differ and `--resume` / `--restart`; nothing written",
)
def test_a_rerun_with_other_settings_is_refused_naming_them(collected, tmp_path):
    recipe = fresh_copy(collected, tmp_path)
    assert run("train", str(recipe), "--set", "train.max_steps=10").returncode == 0
    before = {p: p.stat().st_mtime_ns for p in drafter_dir(tmp_path).rglob("*")}
    done = run("train", str(recipe), "--set", "train.max_steps=10", "--set", "train.lr=1e-3")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "trained to step 10 with other training settings (train.lr: 0.003 -> 0.001)" in lines[0]
    )
    assert "--resume" in lines[0] and "--restart" in lines[0]
    assert {p: p.stat().st_mtime_ns for p in drafter_dir(tmp_path).rglob("*")} == before


@fault(
    stage="train",
    fault="`--restart` with 12 steps over an earlier 30-step run (its step-25, step-30 and metrics)",
    result="the earlier checkpoints and metrics are removed first: only the new run's step dirs and "
    "metrics steps remain",
)
def test_restart_leaves_nothing_of_the_earlier_run(collected, tmp_path):
    recipe = fresh_copy(collected, tmp_path)
    assert run("train", str(recipe), "--set", "train.max_steps=30").returncode == 0
    done = run("train", str(recipe), "--set", "train.max_steps=12", "--restart")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "earlier run's checkpoints and metrics removed" in done.stderr
    root = drafter_dir(tmp_path) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-10", "step-12"]
    assert metric_steps(tmp_path) == list(range(1, 13))


@fault(
    stage="train",
    fault="`--restart` cut short (its marker left), then the plain command",
    result="the rerun finishes the removal before training; it does not resume the half-removed run",
)
def test_an_interrupted_restart_is_finished_by_the_next_run(collected, tmp_path):
    recipe = fresh_copy(collected, tmp_path)
    assert run("train", str(recipe), "--set", "train.max_steps=10").returncode == 0
    (drafter_dir(tmp_path) / ".restarting").write_text("")  # cut short after writing its marker
    done = run("train", str(recipe), "--set", "train.max_steps=10", "--set", "train.lr=1e-3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finishing an interrupted --restart" in done.stderr
    assert metric_steps(tmp_path) == list(range(1, 11))
    assert not (drafter_dir(tmp_path) / ".restarting").exists()


# ---------------------------------------------------------------- the LR schedule after a resume


@fault(
    stage="train",
    fault="`--resume` with a larger train.max_steps (cosine schedule)",
    result="steps after the resume get the new length's schedule (lr_at with the new max_steps), "
    "decaying to the floor at the new last step; never the old curve climbing back up",
)
def test_resume_with_more_steps_follows_the_new_length(tmp_path, monkeypatch):
    import test_train

    from specctl.drafters import DRAFTERS
    from specctl.train import loop as train_mod

    source = test_train.tiny_source()
    monkeypatch.setattr(train_mod, "open_source", lambda recipe, ctx, progress: source)
    for name, spec in test_train.use_toy_drafter().items():
        monkeypatch.setitem(DRAFTERS, name, spec)
    short = test_train.tiny_recipe(tmp_path, max_steps=6)
    run_training(short, progress=False)
    longer = test_train.tiny_recipe(tmp_path, max_steps=12)
    with pytest.raises(SpecctlError, match=r"train\.max_steps: 6 -> 12\); pass --resume"):
        run_training(longer, progress=False)  # a plain rerun with other settings is refused
    run_training(longer, resume=True, progress=False)
    lrs = {r["step"]: r["lr"] for r in test_train.read_metrics(longer) if "lr" in r}
    cfg = longer.train
    expected = {
        s + 1: lr_at(s, cfg.lr, cfg.warmup_steps, 6 if s < 6 else 12, cfg.schedule, cfg.min_lr_ratio)
        for s in range(12)
    }
    assert lrs == pytest.approx(expected, rel=1e-9)
    after = [lrs[s] for s in range(7, 13)]
    assert all(a >= b for a, b in zip(after, after[1:], strict=False))


# ---------------------------------------------------------------- run locks


HOLD = """
import sys, time
from pathlib import Path
from specctl.runlock import run_lock
with run_lock(Path(sys.argv[1]), "train dflash"):
    print("held", flush=True)
    time.sleep(60)
"""


@fault(
    stage="train",
    fault="two `train` processes of one drafter on one run directory at once",
    result="the second exits 1 with one line naming the holder (pid, host, since when, command) and "
    "writes nothing; another drafter of the same run trains meanwhile",
)
def test_a_second_train_of_the_same_drafter_exits_naming_the_holder(collected, tmp_path):
    recipe = fresh_copy(collected, tmp_path)
    out = drafter_dir(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = run("train", str(recipe), "--set", "train.max_steps=5")
        assert done.returncode == 1, done.stderr[-3000:]
        lines = done.stderr.strip().splitlines()
        prefix = f"error: {lock_path(out)}: train dflash already running as pid {holder.pid} on {host_name()}"
        assert len(lines) == 1 and lines[0].startswith(prefix + ", since "), done.stderr
        assert f"-c {out}; wait for it to finish, or delete the lock if that process is dead" in lines[0]
        assert not (out / "checkpoints").exists()
        other = run("train", str(recipe), "--algo", "eagle3", "--set", "train.max_steps=5")
        assert other.returncode == 0, other.stderr[-3000:]  # per drafter: eagle3 trains meanwhile
    finally:
        holder.kill()
        holder.wait()


@fault(
    stage="train",
    fault="a run lock left by a killed process (kill -9) of this host",
    result="the next process takes it over, saying so in one line, and releases it when done",
)
def test_a_stale_lock_of_a_dead_local_process_is_taken_over(tmp_path):
    target = tmp_path / "drafters" / "dflash"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    said = []
    with run_lock(target, "train dflash", said.append) as mine:
        assert Holder.decode(lock_path(target).read_bytes()) == mine
    assert len(said) == 1 and f"taking over a stale lock of pid {holder.pid} on {host_name()}" in said[0]
    assert "(that process is gone)" in said[0]
    assert not lock_path(target).exists()  # released


@fault(
    stage="export",
    fault="a run lock held by a process of another host (shared filesystem) whose lease is fresh",
    result="exit 1 with one line naming the holder and its host, and when its lease lapses unless "
    "renewed; not taken over",
)
def test_a_live_lock_of_another_host_is_reported_not_taken(tmp_path):
    target = tmp_path / "export"
    other = Holder("gpu-node-7", os.getpid() + 10**6, 1, "specctl export runs/x", time.time(), "t", 300.0)
    lock_path(target).write_bytes(other.encode())
    with pytest.raises(RunLocked) as e, run_lock(target, "export"):
        pass
    message = str(e.value)
    assert message.startswith(f"{lock_path(target)}: export already running as pid {other.pid} on gpu-node-7")
    assert "(another host: cannot check it from here; its lease of 300 s lapses in " in message
    assert re.search(r"lapses in (29\d|300) s \(at \d\d:\d\d:\d\d UTC\) unless it renews it", message)
    assert "specctl export runs/x" in message and "delete the lock if that process is dead" in message
    assert "\n" not in message and lock_path(target).read_bytes() == other.encode()


def test_holder_stale_judges_this_hosts_processes_and_other_hosts_leases():
    """The pure rule, against a brute-force table: this host's holder is stale iff gone; another
    host's iff its heartbeat is known and older than its lease (its own, else the reader's)."""
    me = socket.gethostname()
    for host, alive, age, lease in itertools.product(
        (me, "elsewhere"), (True, False), (None, 10.0, 299.0, 301.0), (None, 20.0)
    ):
        held = Holder(host, 12345, None, "c", 0.0, "t", lease)
        old = age is not None and age > (300.0 if lease is None else lease)
        expected = not alive if host == me else old
        assert holder_stale(held, me, lambda h, a=alive: a, age) == expected


HOLD_AS = """
import sys, time
from pathlib import Path
from specctl import runlock
runlock.host_name = lambda: sys.argv[2]  # this process plays another host
with runlock.run_lock(Path(sys.argv[1]), "train dflash"):
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
"""


def hold_as(target: Path, host: str, lease: float, hold_s: float = 60) -> subprocess.Popen:
    """A process that holds `target`'s lock as `host` with a lease of `lease` seconds, once held."""
    env = {**os.environ, LEASE_ENV: str(lease)}
    args = [sys.executable, "-c", HOLD_AS, str(target), host, str(hold_s)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


@fault(
    stage="train",
    fault="a job SIGKILLed on one node (its run lock left), requeued onto another node",
    result="refused while the dead holder's lease is fresh, naming when it lapses; once it has lapsed "
    "the rerun takes the lock over, saying so in one line",
)
def test_a_killed_jobs_lock_is_taken_over_from_another_host_once_its_lease_lapses(tmp_path, monkeypatch):
    target = tmp_path / "drafters" / "dflash"
    holder = hold_as(target, "node-a", lease=2.0)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    monkeypatch.setattr(runlock, "host_name", lambda: "node-b")
    with pytest.raises(RunLocked) as e, run_lock(target, "train dflash"):
        pass  # renewed moments ago: still fresh
    assert f"as pid {holder.pid} on node-a" in str(e.value) and "its lease of 2 s lapses in" in str(e.value)
    time.sleep(2.3)
    said = []
    with run_lock(target, "train dflash", said.append) as mine:
        assert Holder.decode(lock_path(target).read_bytes()) == mine and mine.host == "node-b"
    assert len(said) == 1 and f"taking over a stale lock of pid {holder.pid} on node-a" in said[0]
    assert "past its lease of 2 s)" in said[0]
    assert not lock_path(target).exists()  # released
    assert sorted(p.name for p in target.parent.iterdir()) == []  # no claim or probe left behind


@fault(
    stage="train",
    fault="a run lock of another host held longer than its lease (the holder alive, renewing it)",
    result="refused every time: the holder's thread touches the lock every quarter lease",
)
def test_a_live_holder_renews_its_lease(tmp_path, monkeypatch):
    target = tmp_path / "drafters" / "dflash"
    holder = hold_as(target, "node-a", lease=1.5)
    try:
        monkeypatch.setattr(runlock, "host_name", lambda: "node-b")
        for _ in range(3):  # 3.6 s in all: past two leases
            time.sleep(1.2)
            assert heartbeat_age(lock_path(target)) < 1.5
            with pytest.raises(RunLocked, match="on node-a"), run_lock(target, "train dflash"):
                pass
    finally:
        holder.kill()
        holder.wait()


@fault(
    stage="train",
    fault="a run lock written before leases (no `lease_s`) by another host, untouched for two hours",
    result="taken over (its mtime is its heartbeat, judged by this process's lease), saying so in "
    "one line; the same lock touched just now is refused",
)
def test_an_old_format_lock_of_another_host_two_hours_old_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv(LEASE_ENV, raising=False)
    target, path = tmp_path / "drafters" / "dflash", lock_path(tmp_path / "drafters" / "dflash")
    path.parent.mkdir(parents=True)
    old = {"host": "gpu-node-7", "pid": 4242, "pid_start": 1, "command": "specctl train r.yaml"}
    path.write_text(json.dumps({**old, "started": time.time() - 7300, "token": "0f" * 16}) + "\n")
    with pytest.raises(RunLocked, match="its lease of 300 s lapses in"), run_lock(target, "train dflash"):
        pass  # fresh mtime: judged alive
    two_hours_ago = time.time() - 7200
    os.utime(path, (two_hours_ago, two_hours_ago))
    said = []
    with run_lock(target, "train dflash", said.append):
        pass
    assert len(said) == 1 and "taking over a stale lock of pid 4242 on gpu-node-7" in said[0]
    assert re.search(r"\(no heartbeat for 720\d s, past its lease of 300 s\)$", said[0])


def test_a_takeover_never_removes_a_lock_it_did_not_judge(tmp_path):
    """The check-then-remove of a stale lock, serialised across hosts by a claim: a taker-over that
    finds the claim held (another's takeover under way) or the lock replaced meanwhile leaves it."""
    path = lock_path(tmp_path / "x")
    stale = Holder("node-a", 1, None, "c", 0.0, "a" * 32, 1.0)
    fresh = Holder("node-c", 2, None, "c", 0.0, "c" * 32, 300.0)
    path.write_bytes(stale.encode())
    claim = path.with_name(f"{path.name}.takeover-{stale.token}")
    claim.write_bytes(b"")  # node-c is taking it over
    runlock._take_over(path, stale.encode(), stale, "test", pytest.fail)
    assert path.read_bytes() == stale.encode() and claim.exists()
    claim.unlink()
    path.write_bytes(fresh.encode())  # node-c took it over; this one read the stale bytes before
    runlock._take_over(path, stale.encode(), stale, "test", pytest.fail)
    assert path.read_bytes() == fresh.encode() and not claim.exists()


RACE = """
import sys, time
from pathlib import Path
from specctl import runlock
runlock.host_name = lambda: sys.argv[2]
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
try:
    with runlock.run_lock(Path(sys.argv[1]), "train dflash", lambda _: None):
        print("won", flush=True)
        time.sleep(3)
except runlock.RunLocked:
    print("refused", flush=True)
"""


def test_of_hosts_racing_to_take_over_a_lapsed_lock_exactly_one_wins(tmp_path):
    target = tmp_path / "drafters" / "dflash"
    lock_path(target).parent.mkdir(parents=True)
    dead = Holder("node-a", 1, None, "c", 0.0, "d" * 32, 1.0)
    lock_path(target).write_bytes(dead.encode())
    os.utime(lock_path(target), (time.time() - 60, time.time() - 60))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(target), f"node-{i}", str(go)], stdout=subprocess.PIPE, text=True
        )
        for i in range(3)
    ]
    time.sleep(1.5)  # all three started and waiting
    go.write_text("")
    results = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert results == ["refused", "refused", "won"]


def test_threads_of_one_process_wait_for_each_other(tmp_path):
    """The data stage's waiting form: a second holder in the same process (a thread) waits, it
    does not take over the first's lock as if its pid were gone."""
    import threading

    target, order = tmp_path / "data", []

    def worker(i: int) -> None:
        with run_lock(target, "data stage", lambda _: None, wait=True):
            order.append(("in", i))
            time.sleep(0.3)
            order.append(("out", i))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [kind for kind, _ in order] == ["in", "out", "in", "out"]
    assert not runlock._HELD and not lock_path(target).exists()


def test_the_lease_setting_and_a_damaged_lease_field(monkeypatch):
    """SPECCTL_LOCK_LEASE: seconds above 0, else one line naming it (a typo must not silently give
    another lease); a lock whose lease_s is not a positive number is unreadable, never stale."""
    monkeypatch.setenv(LEASE_ENV, "2.5")
    assert runlock.lease_s() == 2.5 and Holder.me().lease_s == 2.5
    for bad in ("abc", "0", "-3", "nan", "inf"):
        monkeypatch.setenv(LEASE_ENV, bad)
        with pytest.raises(SpecctlError, match=f"^{LEASE_ENV}={bad}: not a number of seconds above 0"):
            runlock.lease_s()
    monkeypatch.delenv(LEASE_ENV)
    assert runlock.lease_s() == runlock.DEFAULT_LEASE_S == 300.0
    held = Holder("h", 1, None, "c", 0.0, "t", 60.0)
    assert Holder.decode(held.encode()) == held
    for bad in ("60", -1, 0, None):
        damaged = json.dumps({**json.loads(held.encode()), "lease_s": bad}).encode()
        assert (Holder.decode(damaged) is None) == (bad is not None)
