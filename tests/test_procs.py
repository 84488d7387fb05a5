"""specctl.procs and specctl/watchdog.py without vLLM: what a killed specctl leaves, in seconds.

A stand-in for specctl (a Python process that starts a group through `process_group`, as every
vLLM start does) is killed while the group runs; its processes are followed by pid from /proc
(tests/proctree.py). The real thing, on vLLM and SmolLM2, is tests/test_kill.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proctree import ProcessTree
from reliability_matrix import fault

from specctl.procs import MONITOR_POLL_S
from specctl.watchdog import GRACE_S

ROOT = Path(__file__).resolve().parents[1]

# The group: a leader that ignores SIGTERM (as vLLM's EngineCore can, busy shutting down) with a
# child of its own that does too, and shared memory registered with multiprocessing's resource
# tracker (vLLM's message queues are such segments): the tracker must outlive the others to unlink it.
GROUP = textwrap.dedent(
    """
    import multiprocessing.shared_memory as sm, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seg = sm.SharedMemory(create=True, size=1 << 20)
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print("up", seg.name, flush=True)
    time.sleep(600)
    """
)

STAND_IN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from specctl.procs import process_group
    with process_group([sys.executable, "-c", sys.argv[1]], Path(sys.argv[2])):
        time.sleep(600)
    """
)


@pytest.fixture
def temp_dir() -> Iterator[Path]:
    """A temp dir of the test's own, with a space in its name as a user's may have, and short: in
    a longer one the group's socket directory would go to /tmp (`socket_dir`)."""
    path = Path(tempfile.mkdtemp(prefix="specctl test ", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stand_in_env(temp: Path) -> dict[str, str]:
    """specctl importable; its temp dir (where the group's socket directory goes) `temp`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return env | {"TMPDIR": str(temp)}


def start_stand_in(tmp_path: Path, temp: Path) -> tuple[subprocess.Popen, ProcessTree, str]:
    """The stand-in specctl with GROUP running below it; its tree and the segment's name."""
    log = tmp_path / "group.log"
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, GROUP, str(log)], env=_stand_in_env(temp))
    tree = ProcessTree(proc.pid)
    deadline = time.monotonic() + 60
    while "up" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not start its group"
        tree.scan()
        time.sleep(0.05)
    time.sleep(0.3)  # the group's own child
    tree.scan()
    return proc, tree, log.read_text().split()[1]


def _cleanup(proc: subprocess.Popen, tree: ProcessTree) -> None:
    for pid in tree.living():
        os.kill(pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
@fault(
    stage="bench",
    fault="kill -9 of specctl while a group it started ignores SIGTERM (child, grandchild, shared memory)",
    result="the watchdog kills the group after its grace period: nothing alive, the /dev/shm segment "
    "and the group's socket directory gone",
)
def test_kill_9_leaves_no_process_and_no_shared_memory(tmp_path, temp_dir):
    proc, tree, segment = start_stand_in(tmp_path, temp_dir)
    try:
        names = tree.living(include_root=False)
        assert len(names) >= 4, tree.alive()  # leader, its child, the resource tracker, the watchdog
        assert Path("/dev/shm", segment).exists()
        (sockets,) = temp_dir.glob("specctl-ipc-*")
        proc.send_signal(signal.SIGKILL)
        seconds = tree.wait_gone(15.0)
        assert not tree.living(), tree.alive()
        assert GRACE_S <= seconds < 15.0  # SIGTERM was ignored: SIGKILL after the grace period
        assert not Path("/dev/shm", segment).exists()  # the tracker outlived the rest and unlinked it
        assert not sockets.exists()  # removed by the watchdog once the group was gone
    finally:
        _cleanup(proc, tree)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
@fault(
    stage="bench",
    fault="the watchdog killed first, then specctl (kill -9 of both)",
    result="the group leader still gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and exits",
)
def test_leader_dies_with_specctl_even_without_the_watchdog(tmp_path, temp_dir):
    code = "import time; print('up', 'x', flush=True); time.sleep(600)"  # SIGTERM ends it
    log = tmp_path / "group.log"
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, code, str(log)], env=_stand_in_env(temp_dir))
    tree = ProcessTree(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while "up" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            tree.scan()
            time.sleep(0.05)
        tree.scan()
        watchdog = [pid for pid, cmd in tree.commands.items() if "watchdog.py watch" in cmd]
        leader = [pid for pid, cmd in tree.commands.items() if "time.sleep(600)" in cmd]
        assert len(watchdog) == 1 and len(leader) == 1, tree.alive()
        os.kill(watchdog[0], signal.SIGKILL)
        proc.send_signal(signal.SIGKILL)
        assert tree.wait_gone(5.0) < 5.0, tree.alive()
    finally:
        _cleanup(proc, tree)


def test_the_level_quiet_vllm_import_sets_is_not_passed_to_children(monkeypatch):
    """Importing vLLM in-process sets VLLM_LOGGING_LEVEL=WARNING for specctl's stderr; a child's
    own log file keeps vLLM's default level (readiness checks and error tails read its INFO lines)."""
    from specctl import procs

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(procs, "_QUIETED_LEVEL", None)
    procs.quiet_vllm_import()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "VLLM_LOGGING_LEVEL" not in procs.vllm_env(cpu=True)
    assert procs.vllm_env(cpu=True, base={"VLLM_LOGGING_LEVEL": "DEBUG"})["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_a_logging_level_the_user_set_reaches_process_and_children(monkeypatch):
    from specctl import procs

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    monkeypatch.setattr(procs, "_QUIETED_LEVEL", None)
    procs.quiet_vllm_import()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert procs.vllm_env(cpu=False)["VLLM_LOGGING_LEVEL"] == "WARNING"


@fault(
    stage="bench",
    fault="a group stopped at once (every normal end) holding a unix socket vLLM unlinks only at shutdown",
    result="the socket and its directory (the group's own) go with the group; one the user named stays",
)
def test_the_sockets_a_killed_group_leaves_go_with_it(tmp_path, monkeypatch):
    """vLLM unlinks its IPC socket files only in a graceful shutdown, which a group stopped at once
    never runs: they must live in a directory of the group's own, removed with it."""
    from specctl.procs import SOCKET_DIR_VAR, process_group

    child = textwrap.dedent(
        """
        import os, socket, sys, time
        path = os.path.join(os.environ[sys.argv[2]], "engine.sock")
        s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen()
        open(sys.argv[1], "w").write(path)
        time.sleep(60)
        """
    )
    said = tmp_path / "path"
    monkeypatch.delenv(SOCKET_DIR_VAR, raising=False)
    with process_group([sys.executable, "-c", child, str(said), SOCKET_DIR_VAR], tmp_path / "log"):
        deadline = time.monotonic() + 30
        while not (said.exists() and said.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        bound = Path(said.read_text())
        assert bound.is_socket() and bound.parent != Path(os.environ.get("TMPDIR", "/tmp"))
    assert not bound.exists() and not bound.parent.exists()

    mine = tmp_path / "mine"  # a directory the user named is theirs: used, and left alone
    mine.mkdir()
    said.unlink()
    monkeypatch.setenv(SOCKET_DIR_VAR, str(mine))
    with process_group([sys.executable, "-c", child, str(said), SOCKET_DIR_VAR], tmp_path / "log"):
        while not (said.exists() and said.read_text()) and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        assert Path(said.read_text()) == mine / "engine.sock"
    assert mine.is_dir()


@fault(
    stage="data",
    fault="a group whose caller made it a directory (the data worker's listening socket) is stopped",
    result="the directory goes with the group and holds vLLM's sockets; a socket directory the user "
    "named still gets them",
)
def test_a_directory_the_caller_made_for_a_group_goes_with_it(tmp_path, monkeypatch):
    """A worker's own listening socket lives in a directory its caller made (`group_dir`): it holds
    vLLM's sockets too, and is removed with the group; a socket directory the user named still
    gets vLLM's sockets, while the caller's directory still goes."""
    from specctl.procs import SOCKET_DIR_VAR, process_group

    child = "import os, sys; open(sys.argv[1], 'w').write(os.environ[sys.argv[2]])"
    said = tmp_path / "said"
    for user_dir in (None, tmp_path / "mine"):
        if user_dir is None:
            monkeypatch.delenv(SOCKET_DIR_VAR, raising=False)
        else:
            user_dir.mkdir()
            monkeypatch.setenv(SOCKET_DIR_VAR, str(user_dir))
        group_dir = tmp_path / f"group-{user_dir is None}"
        group_dir.mkdir()
        (group_dir / "worker.sock").touch()
        with process_group(
            [sys.executable, "-c", child, str(said), SOCKET_DIR_VAR], tmp_path / "log", group_dir=group_dir
        ) as proc:
            proc.wait(timeout=30)
        assert said.read_text() == str(user_dir or group_dir)
        assert not group_dir.exists()
        assert user_dir is None or user_dir.is_dir()


def test_socket_directories_stay_short_enough_for_vllms_sockets(monkeypatch, tmp_path):
    """In the temp dir while vLLM's <dir>/<uuid4> socket paths fit in AF_UNIX's 107 bytes there,
    else in /tmp: a deep TMPDIR must not fail the data worker or vLLM ("AF_UNIX path too long")."""
    from specctl.procs import SOCKET_PATH_MAX, VLLM_SOCKET_NAME, socket_dir

    short = Path(tempfile.mkdtemp(prefix="s", dir="/tmp"))
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    try:
        for base, inside in ((short, True), (deep, False)):
            monkeypatch.setattr(tempfile, "tempdir", str(base))
            made = socket_dir("specctl-ipc-")
            assert made.is_dir() and (made.parent == base) is inside
            assert made.parent == (base if inside else Path("/tmp"))
            assert len(os.fsencode(made)) + 1 + VLLM_SOCKET_NAME <= SOCKET_PATH_MAX
            made.rmdir()
    finally:
        shutil.rmtree(short)


SLEEPER = "import time; time.sleep(600)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@fault(
    stage="bench",
    fault="the watchdog cannot be started (fork/exec fails: process limit, no memory)",
    result="the child just started is stopped (no process of its group alive) and SpecctlError says "
    "why on one line",
)
def test_a_watchdog_that_cannot_start_stops_the_child(tmp_path, monkeypatch):
    from specctl import procs
    from specctl.errors import SpecctlError
    from specctl.watchdog import group_members

    assert procs._WATCHDOG._proc is None  # no group of another test holds one: this start spawns it
    started: list[subprocess.Popen] = []
    real_start = procs._start

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    def no_watchdog() -> subprocess.Popen:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(procs, "_start", start)
    monkeypatch.setattr(procs, "spawn_watchdog", no_watchdog)
    with (
        pytest.raises(SpecctlError, match="could not start specctl's watchdog") as failed,
        procs.process_group([sys.executable, "-c", SLEEPER], tmp_path / "log"),
    ):
        pytest.fail("the block ran without a watchdog")
    assert "\n" not in str(failed.value) and "Resource temporarily unavailable" in str(failed.value)
    (proc,) = started
    assert proc.poll() is not None and not group_members(proc.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG")
@fault(
    stage="bench",
    fault="the watchdog killed (kill -9) while a group runs, then specctl killed (kill -9) seconds later",
    result="specctl notices within a second, starts another watchdog told of the group (one line on "
    "stderr), and that one stops the group: nothing alive, the /dev/shm segment gone",
)
def test_a_killed_watchdog_is_replaced_and_the_group_still_stopped(tmp_path, temp_dir):
    log, err = tmp_path / "group.log", tmp_path / "stderr"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", STAND_IN, GROUP, str(log)], env=_stand_in_env(temp_dir), stderr=stderr
        )
    tree = ProcessTree(proc.pid)
    try:
        deadline = time.monotonic() + 60
        while "up" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in did not start its group"
            tree.scan()
            time.sleep(0.05)
        time.sleep(0.3)
        tree.scan()
        segment = log.read_text().split()[1]
        (first,) = [pid for pid, cmd in tree.commands.items() if "watchdog.py watch" in cmd]
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        while "started another" not in err.read_text() and time.monotonic() < killed + 10:
            time.sleep(0.05)
        assert time.monotonic() - killed < MONITOR_POLL_S + 2.0  # noticed at the next poll
        said = err.read_text().strip().splitlines()
        assert len(said) == 1 and "the watchdog died" in said[0] and "signal 9" in said[0], said
        tree.scan()
        second = [p for p, cmd in tree.commands.items() if "watchdog.py watch" in cmd and p != first]
        assert len(second) == 1 and second[0] in tree.living(), tree.alive()
        time.sleep(0.2)  # the new watchdog reads the group it was told of
        proc.send_signal(signal.SIGKILL)
        seconds = tree.wait_gone(15.0)
        assert not tree.living(), tree.alive()
        assert GRACE_S <= seconds < 15.0  # the leader ignores SIGTERM: only a watchdog kills it
        assert not Path("/dev/shm", segment).exists()
    finally:
        _cleanup(proc, tree)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@fault(
    stage="bench",
    fault="the watchdog dies while a group runs and no other can be started",
    result="the group is stopped at the next poll (fail closed), one line on stderr, and the block "
    "ends in SpecctlError naming the watchdog",
)
def test_a_dead_watchdog_that_cannot_be_replaced_stops_the_group(tmp_path, monkeypatch, capfd):
    from specctl import procs
    from specctl.errors import SpecctlError
    from specctl.watchdog import group_members

    def no_watchdog() -> subprocess.Popen:
        raise OSError(12, "Cannot allocate memory")

    with (
        pytest.raises(SpecctlError, match="watchdog died") as failed,
        procs.process_group([sys.executable, "-c", SLEEPER], tmp_path / "log") as child,
    ):
        monkeypatch.setattr(procs, "spawn_watchdog", no_watchdog)
        os.kill(procs._WATCHDOG._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 3 * procs.MONITOR_POLL_S + 5
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is not None and not group_members(child.pid)
    assert "Cannot allocate memory" in str(failed.value) and "\n" not in str(failed.value)
    said = [line for line in capfd.readouterr().err.splitlines() if "watchdog" in line]
    assert len(said) == 1 and "stopped the 1 process group(s)" in said[0], said
    assert not procs._WATCHDOG.stopped and procs._WATCHDOG._proc is None


def test_vllm_children_do_not_inherit_torchrun_variables(tmp_path, monkeypatch):
    """A vLLM engine or server started from a torchrun rank runs torch.distributed of its own: with
    the rank's RANK / WORLD_SIZE / MASTER_PORT it would join the rank's rendezvous. The group's
    environment has none of torchrun's variables, and keeps the GPUs the rank pinned it to."""
    import json

    from specctl.procs import process_group

    torchrun = {
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "8",
        "GROUP_RANK": "0",
        "ROLE_RANK": "3",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    dump = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"
    seen = []
    for i, env in enumerate([None, {**os.environ, "CUDA_VISIBLE_DEVICES": "6,7"}]):  # inherited, pinned
        out = tmp_path / f"env-{i}.json"
        with process_group([sys.executable, "-c", dump, str(out)], tmp_path / "log", env) as proc:
            proc.wait(timeout=60)
        seen.append(json.loads(out.read_text()))
    for env in seen:
        assert sorted(set(torchrun) & set(env)) == []  # only the names show when it fails
        assert env["PATH"] == os.environ["PATH"]
    assert seen[1]["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert os.environ["MASTER_PORT"] == "29500"  # this process's own environment is untouched
