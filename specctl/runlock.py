"""Run locks: one process at a time writes a given part of a run directory.

Each stage that writes into a run directory holds the lock of what it writes, for as long as it
writes: a drafter's training (`drafters/<algo>`: checkpoints, metrics), an export directory, a
bench output directory, the data stage's `data/`. Two algorithms train in one run at once; two
trainings of one drafter do not (the second would wipe the first's metrics, flip `latest` between
them and prune the other's checkpoints).

The lock is a file beside what it guards, `.NAME.lock`, created atomically (`durable.create_once`:
of racing processes, on one host or several sharing the filesystem, exactly one wins), holding who
holds it: host, pid, the pid's start time (a pid is reused, a (pid, start time) pair is not), the
command line, when it started and its lease. It is advisory: only specctl reads it.

A lock left by a process of this host that is gone is stale: the next process takes it over and
says so. A holder on another host cannot be checked from here, so it holds a lease instead: a
thread of the holder touches the lock file every quarter lease, and the file's mtime is its
heartbeat. A lock of another host whose heartbeat is older than its lease is stale too (its host
died, or SIGKILL took the process: a SLURM requeue onto another node then goes on). The age is
read by the filesystem's clock, never by comparing two hosts' clocks. The lease is
SPECCTL_LOCK_LEASE seconds (default 300), recorded in the lock so every reader judges it by its
holder's promise; a lock written before leases (no `lease_s`) is judged by the reader's.

Not flock(2): a lock on a shared filesystem must name its holder to the user of another machine,
and NFS's byte-range locks vanish or linger with the lock daemon's mood.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from specctl.durable import create_once, host_name, pid_alive, temp_path
from specctl.errors import SpecctlError
from specctl.progress import note
from specctl.watchdog import start_time

POLL_S = 0.5  # how often a waiting process (the data stage's) looks at the lock again
LEASE_ENV = "SPECCTL_LOCK_LEASE"
# a SLURM requeue takes minutes anyway; long enough that a stalled filesystem or a busy holder
# (renewing every quarter of it) is never taken for dead
DEFAULT_LEASE_S = 300.0


class RunLocked(SpecctlError):
    """Another process holds the lock of what this stage would write. Exit code 1: nothing is wrong
    with the command; it is the wrong moment."""


def lease_s() -> float:
    """The lease this process gives its locks, in seconds: SPECCTL_LOCK_LEASE, default 300. An
    environment setting, not a recipe field: export, bench and the data stage lock too, and the
    lease suits the cluster (how long a dead node's lock may block a requeue), not the run."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SpecctlError(
            f"{LEASE_ENV}={raw}: not a number of seconds above 0 (the run locks' lease; "
            f"unset it for the default, {DEFAULT_LEASE_S:g})"
        )
    return value


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: which process (host, pid, its start time in clock ticks since boot: None
    off Linux), running what, since when (seconds since the epoch); token tells two holds apart.
    lease_s: the seconds within which it renews the lock's heartbeat (None: written before leases)."""

    host: str
    pid: int
    pid_start: int | None
    command: str
    started: float
    token: str
    lease_s: float | None = None

    @classmethod
    def me(cls) -> Holder:
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python"
        pid = os.getpid()
        return cls(host_name(), pid, start_time(pid), command, time.time(), uuid.uuid4().hex, lease_s())

    def encode(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Holder | None:
        """The holder in a lock file's bytes; None for bytes that are not one."""
        try:
            held = cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None
        lease = held.lease_s
        if lease is not None and not (isinstance(lease, int | float) and lease > 0):
            return None
        return held

    def lease(self) -> float:
        """The lease it is judged by: its own, or this process's for a lock from before leases."""
        return lease_s() if self.lease_s is None else float(self.lease_s)

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"pid {self.pid} on {self.host}, since {since}: {self.command}"


def lock_path(target: Path) -> Path:
    """The lock of directory `target`: `.NAME.lock` beside it (the directory may not exist yet, and
    a stage that swaps `target` whole must not swap its lock away)."""
    return target.parent / f".{target.name}.lock"


_HELD: set[str] = set()  # tokens of the locks this process holds now (threads included)
_CREATING = threading.Lock()
_BEATS: dict[str, tuple[threading.Event, threading.Thread]] = {}  # token -> its renewal thread


def local_alive(held: Holder) -> bool:
    """Whether the holder, a process of this host, still holds its lock: this process holds it now
    (another thread's block), or the pid exists and, where both start times are known, is the same
    process (not a later one that got the pid)."""
    if held.pid == os.getpid():
        return held.token in _HELD
    if not pid_alive(held.pid):
        return False
    now = start_time(held.pid)
    return held.pid_start is None or now is None or now == held.pid_start


def holder_stale(held: Holder, host: str, alive: Callable[[Holder], bool], age_s: float | None) -> bool:
    """Whether a lock may be taken over. A holder on this `host` is judged by the process itself
    (`alive`), which is certain. Another host's cannot be seen from here, only its heartbeat: stale
    once that is older (`age_s`, None: unknown) than the holder's lease."""
    if held.host == host:
        return not alive(held)
    return age_s is not None and age_s > held.lease()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def heartbeat_age(path: Path) -> float | None:
    """Seconds since `path`'s mtime (its holder's last heartbeat), None if it is gone. Two hosts'
    clocks are never compared: "now" is the mtime of a probe file created beside it, stamped by
    the same clock (a shared filesystem's server) as the holder's touch. The mtime is read through
    an open file, which NFS revalidates (close-to-open), not from a cached stat."""
    probe = temp_path(path, "probe")
    with _CREATING:  # the probe's name is per process: one thread at a time uses it
        try:
            probe.write_bytes(b"")
            now = probe.stat().st_mtime
        finally:
            probe.unlink(missing_ok=True)
    try:
        with open(path, "rb") as f:
            return now - os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None


def _take_over(path: Path, raw: bytes, held: Holder, why: str, say: Callable[[str], None]) -> None:
    """Remove the stale lock `raw` unless it changed meanwhile; the caller then competes for the
    lock afresh. Of the processes (of any host) that judged this lock stale, one at a time does
    so: each first creates a claim named after the stale holder's token, atomically like the lock,
    so a slow one cannot remove the lock the first has just created. A claim left by a process
    killed mid-takeover is removed once it is older than the lease."""
    claim = path.with_name(f"{path.name}.takeover-{re.sub(r'[^A-Za-z0-9]', '_', held.token)}")
    with _CREATING:
        won = create_once(claim, b"", durable=False)
    if not won:
        age = heartbeat_age(claim)
        if age is not None and age > held.lease():
            claim.unlink(missing_ok=True)
        time.sleep(POLL_S / 10)  # another process is taking it over: look again in a moment
        return
    try:
        if _read(path) == raw:
            path.unlink()
            say(f"{path}: taking over a stale lock of {held.describe()} ({why})")
    finally:
        claim.unlink(missing_ok=True)


def _lapses(held: Holder, age_s: float | None) -> str:
    """When another host's holder's lease lapses, for a message: in how long (by the filesystem's
    clock) and at what time (by this host's)."""
    if age_s is None:
        return ""
    left = max(0.0, held.lease() - age_s)
    at = datetime.fromtimestamp(time.time() + left, UTC).strftime("%H:%M:%S UTC")
    return (
        f"; its lease of {held.lease():g} s lapses in {left:.0f} s (at {at}) unless it renews it, "
        "and a rerun then takes the lock over"
    )


def _held_by(path: Path, raw: bytes, stage: str, age_s: float | None) -> str:
    """What the lock at `path` says about its holder, as the start of a one-line message."""
    held = Holder.decode(raw)
    if held is None:
        return f"{path}: unreadable lock of another {stage} (not written by specctl, or damaged)"
    where = ""
    if held.host != host_name():
        where = f" (another host: cannot check it from here{_lapses(held, age_s)})"
    return f"{path}: {stage} already running as {held.describe()}{where}"


def _renew(path: Path, mine: Holder, stop: threading.Event, say: Callable[[str], None]) -> None:
    """Touch our lock every quarter lease while we hold it: its mtime is the heartbeat another host
    judges it by (utime without times: stamped by the filesystem's clock, as `heartbeat_age`
    reads it). Stops at release, or once the lock is no longer ours, saying so: this process
    stalled past its lease and was taken over, or someone deleted the lock."""
    while not stop.wait(mine.lease() / 4):
        with contextlib.suppress(OSError):
            if _read(path) == mine.encode():
                os.utime(path)
                continue
        if not stop.is_set():
            say(
                f"{path}: this process's lock was taken over or deleted (not renewed within its "
                f"{mine.lease():g} s lease, or removed by hand); another process may write here now"
            )
        return


def _hold(path: Path, mine: Holder, say: Callable[[str], None]) -> None:
    """Mark the lock ours and start renewing its lease (a daemon thread, stopped by `release`)."""
    _HELD.add(mine.token)
    stop = threading.Event()
    beat = threading.Thread(target=_renew, args=(path, mine, stop, say), name="runlock-lease", daemon=True)
    _BEATS[mine.token] = (stop, beat)
    beat.start()


def _why(held: Holder, age_s: float | None) -> str:
    """Why the stale lock of `held` is taken over, for the line saying so."""
    if held.host == host_name():
        return "that process is gone"
    return f"no heartbeat for {age_s:.0f} s, past its lease of {held.lease():g} s"


def acquire(path: Path, stage: str, say: Callable[[str], None] = note, wait: bool = False) -> Holder:
    """Create the lock at `path` for this process and renew its lease while held; a stale one is
    taken over (saying so). A live holder: RunLocked naming it (and, on another host, when its
    lease lapses), or with `wait` one line naming it, then poll until free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine, waiting = Holder.me(), False
    while True:
        with _CREATING:  # create_once's temp name is per process: one thread at a time uses it
            created = create_once(path, mine.encode(), durable=False)
        if created:
            _hold(path, mine, say)
            return mine
        raw = _read(path)
        if raw is None:  # released meanwhile
            continue
        held = Holder.decode(raw)
        age = None if held is None or held.host == host_name() else heartbeat_age(path)
        if held is not None and holder_stale(held, host_name(), local_alive, age):
            _take_over(path, raw, held, _why(held, age), say)
            continue
        if not wait:
            raise RunLocked(
                f"{_held_by(path, raw, stage, age)}; wait for it to finish, or delete the lock if "
                "that process is dead"
            )
        if not waiting:
            say(f"{_held_by(path, raw, stage, age)}; waiting for it")
            waiting = True
        time.sleep(POLL_S)


def release(path: Path, mine: Holder) -> None:
    """Stop renewing our lock, then remove it; one that is no longer ours (deleted by hand, or
    taken over, and retaken) is left alone."""
    stop, beat = _BEATS.pop(mine.token, (None, None))
    if stop is not None:
        stop.set()
        beat.join()  # no touch of a lock after it is gone (it could be another process's by then)
    if _read(path) == mine.encode():
        path.unlink(missing_ok=True)
    _HELD.discard(mine.token)


@contextlib.contextmanager
def run_lock(
    target: Path, stage: str, say: Callable[[str], None] = note, wait: bool = False
) -> Iterator[Holder]:
    """Hold the lock of directory `target` (`lock_path`) for the block; see `acquire`."""
    path = lock_path(Path(target))
    mine = acquire(path, stage, say, wait)
    try:
        yield mine
    finally:
        release(path, mine)
