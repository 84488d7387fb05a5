"""A process tree recorded while it runs, for tests that kill specctl and check what it left.

Read from /proc directly (not through the code under test): every process below the root, with
its start time, so a pid the kernel hands to a new process later is not mistaken for one that
survived. After a kill the survivors are reparented (to init or a subreaper), so the tree is
scanned repeatedly while the root lives and afterwards followed by parent pid from what it had.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field


def _stat(pid: int) -> tuple[str, str, int, int] | None:
    """(comm, state, ppid, start time) of a live or zombie process; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, fields[0], int(fields[1]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class ProcessTree:
    root: int
    started: dict[int, int] = field(default_factory=dict)  # pid -> start time
    names: dict[int, str] = field(default_factory=dict)  # pid -> comm (VLLM::EngineCore, python, ...)
    commands: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        stat = _stat(self.root)
        assert stat is not None, f"pid {self.root} is not running"
        self.started[self.root] = stat[3]
        self.names[self.root] = stat[0]

    def scan(self) -> None:
        """Record every process whose parent is recorded (repeated until nothing new is found), and
        read the command line of the recorded ones again: a process first seen between fork and exec
        (or mid-exec, when /proc reads an empty command line) shows its real command only later."""
        table = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                stat = _stat(int(name))
                if stat is not None:
                    table[int(name)] = stat
        for pid, (_, _, _, start) in table.items():
            # a recorded child (the root has no entry), not a later process that took its pid
            if pid in self.commands and self.started.get(pid) == start:
                self.commands[pid] = _cmdline(pid) or self.commands[pid]
        grew = True
        while grew:
            grew = False
            for pid, (comm, _, ppid, start) in table.items():
                if pid not in self.started and ppid in self.started and start >= self.started[ppid]:
                    self.started[pid], self.names[pid] = start, comm
                    self.commands[pid] = _cmdline(pid)
                    grew = True

    def living(self, include_root: bool = True) -> dict[int, str]:
        """pid -> comm (at most 15 characters: VLLM::EngineCor) of the recorded processes still
        running; a zombie is dead, a pid now held by a later process is not the recorded one."""
        out = {}
        for pid, start in self.started.items():
            if pid == self.root and not include_root:
                continue
            stat = _stat(pid)
            if stat is not None and stat[3] == start and stat[1] != "Z":
                out[pid] = stat[0]
        return out

    def alive(self, include_root: bool = True) -> list[str]:
        """The recorded processes still running, as 'pid comm: command'."""
        living = self.living(include_root)
        return [f"{pid} {comm}: {self.commands.get(pid, '')[:120]}" for pid, comm in living.items()]

    def wait_gone(self, timeout_s: float, include_root: bool = True) -> float:
        """Seconds until every recorded process is gone (scanning on, for children started late);
        the timeout if some are still alive then."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            self.scan()
            if not self.living(include_root):
                return time.monotonic() - start
            time.sleep(0.1)
        return timeout_s
