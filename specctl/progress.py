"""Progress for long stages: a rich bar on a terminal, plain lines at a steady interval otherwise.

A rich bar redraws itself in place; written to a file (SLURM, nohup, CI, a pipe) it shows nothing
until the stage ends. So when stderr is not a terminal `progress_bar` returns a `LogProgress`
instead: same calls (`add_task`, `update`, `advance`, `reset`, `with bar:`), and while it runs a
background thread prints one line per task every SPECCTL_PROGRESS_INTERVAL seconds (default 30):

    [12:04:31] collect hidden states: 19,664/72,832 tok (27.0%), 655 tok/s, 30s elapsed, ETA 1m21s

The ETA (both displays) comes from `Pace`: the rate measured up to the last time the count moved,
never from the time since then. Work that arrives in lumps (an HF generate call, a whole
conversation) otherwise makes a silent stretch look like a slowing rate, and the ETA climbs for
lack of data; here it says "measuring" until a rate exists, then counts down, then says it is
overdue.

Every stage (data, collect, train's live view, bench) goes through this one function.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from specctl.console import make_console

console = make_console(stderr=True)
DEFAULT_INTERVAL_S = 30.0


class RateColumn(ProgressColumn):
    """Units per second, e.g. '1,234 tok/s'."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} {self.unit}/s", style="progress.data.speed")


class EtaColumn(ProgressColumn):
    """The rich bar's ETA, from the same `Pace` as the plain lines (rich's own climbs with no data).

    Each render sees the task's count; a change is an observation at the task's clock. A reset
    (rich restarts `start_time`) starts a new measurement.
    """

    def __init__(self):
        super().__init__()
        self._paces: dict[int, tuple[float | None, Pace]] = {}

    def render(self, task: Task) -> Text:
        now = task.get_time()
        seen = self._paces.get(task.id)
        if seen is None or seen[0] != task.start_time:
            seen = (task.start_time, Pace.begin(task.completed, now))
            self._paces[task.id] = seen
        pace = seen[1]
        pace.observe(task.completed, now)
        return Text(eta_text(pace, task.total, now), style="progress.remaining")


def interval_s() -> float:
    """Seconds between two plain progress lines (SPECCTL_PROGRESS_INTERVAL, default 30)."""
    try:
        value = float(os.environ.get("SPECCTL_PROGRESS_INTERVAL", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value > 0 else DEFAULT_INTERVAL_S


def progress_bar(
    unit: str = "tok", enabled: bool = True, fields: Sequence[tuple[str, str]] = ()
) -> Progress | LogProgress:
    """A progress display for one stage. `fields` are (label, key) pairs of extra per-task values
    (train: loss, lr, ...) passed to add_task/update as keyword arguments and shown after the rate.

    On a terminal: a rich bar. Otherwise (a log file, a pipe): `LogProgress`, plain lines at a
    steady interval. Disabled: a rich Progress that shows nothing.
    """
    if enabled and not console.is_terminal:
        return LogProgress(unit, fields, interval_s())
    columns: list[ProgressColumn] = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(unit),
    ]
    columns += [TextColumn(f"{label} {{task.fields[{key}]}}") for label, key in fields]
    columns += [TimeElapsedColumn(), EtaColumn()]
    return Progress(*columns, console=console, disable=not enabled, transient=False)


def note(message: str, enabled: bool = True) -> None:
    """One line on stderr beside the progress (a plan, an estimate, why work is redone)."""
    if enabled:
        console.print(message, markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------- plain lines


def duration(seconds: float) -> str:
    """12s, 4m05s, 3h02m."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


@dataclass
class Pace:
    """What is measured of one task's speed: its count when the measurement began (`start`, at
    `started`) and its count when it last moved (`last`, at `moved`). Time after `moved` holds no
    information about the rate, so nothing here divides by it."""

    started: float
    start: float
    moved: float
    last: float

    @classmethod
    def begin(cls, completed: float, now: float) -> Pace:
        return cls(now, completed, now, completed)

    def observe(self, completed: float, now: float) -> None:
        """The count read at `now`; only a change is news."""
        if completed != self.last:
            self.moved, self.last = now, completed

    def rate(self) -> float | None:
        """Units per second from the start of the measurement to the last move; None before one."""
        done, span = self.last - self.start, self.moved - self.started
        return done / span if done > 0 and span > 0 else None


def eta_text(pace: Pace, total: float | None, now: float) -> str:
    """`ETA 1m21s`, `ETA measuring` (no rate yet), or `ETA overdue, no progress for 3m02s`; empty
    without a total. The finish is projected from the last move at the measured rate, so between
    moves the ETA counts down and never climbs; only a new count can raise it."""
    if not total or pace.last >= total:  # nothing to estimate, or nothing left (a finished resume)
        return ""
    rate = pace.rate()
    if rate is None:
        return "ETA measuring"
    left = max(0.0, total - pace.last) / rate - (now - pace.moved)
    if left >= 0:
        return f"ETA {duration(left)}"
    return f"ETA overdue, no progress for {duration(now - pace.moved)}"


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    fields: dict[str, Any]
    pace: Pace
    started: float


class LogProgress:
    """rich.Progress's interface, printing plain lines (see the module docstring).

    The rate is measured since the task was added (or reset), so a resumed stage whose task
    starts at `completed=N` reports the speed of this run, and the ETA is what is left at it.
    `clock` is injectable so tests can replay a stage's timing.
    """

    def __init__(
        self,
        unit: str,
        fields: Sequence[tuple[str, str]],
        interval: float,
        out=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.unit, self.fields, self.interval = unit, list(fields), interval
        self.out, self.clock = out, clock
        self._tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- rich.Progress's calls
    def add_task(self, description: str, total: float | None = 100.0, completed: float = 0, **fields) -> int:
        with self._lock:
            task_id, now = len(self._tasks), self.clock()
            self._tasks[task_id] = _Task(
                description, total, completed, dict(fields), Pace.begin(completed, now), now
            )
            return task_id

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **fields,
    ) -> None:
        with self._lock:
            task = self._tasks[task_id]
            if total is not None:
                task.total = total
            if completed is not None:
                task.completed = completed
            if advance is not None:
                task.completed += advance
            if description is not None:
                task.description = description
            task.fields.update({k: v for k, v in fields.items() if k not in ("visible", "refresh")})
            task.pace.observe(task.completed, self.clock())

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, *, total: float | None = None, completed: float = 0, **fields) -> None:
        with self._lock:
            task = self._tasks[task_id]
            task.completed, task.started = completed, self.clock()
            task.pace = Pace.begin(completed, task.started)
            if total is not None:
                task.total = total
            description = fields.pop("description", None)
            if description is not None:
                task.description = description
            task.fields.update(fields)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="specctl-progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.print_lines()  # the final state

    def __enter__(self) -> LogProgress:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the lines
    def _run(self) -> None:
        self.print_lines()
        while not self._stop.wait(self.interval):
            self.print_lines()

    def line(self, task: _Task, now: float) -> str:
        """`description: done/total unit (pct), rate, elapsed, ETA, fields`."""
        elapsed = now - task.started
        parts = [f"{task.description}: {_count(task.completed)}"]
        if task.total:
            parts[0] += f"/{_count(task.total)} {self.unit} ({100 * task.completed / task.total:.1f}%)"
        else:
            parts[0] += f" {self.unit}"
        rate = task.pace.rate()
        if rate is not None:
            parts.append(f"{rate:,.2f} {self.unit}/s" if rate < 10 else f"{rate:,.0f} {self.unit}/s")
        parts.append(f"{duration(elapsed)} elapsed")
        eta = eta_text(task.pace, task.total, now)
        if eta:
            parts.append(eta)
        extra = " ".join(f"{label} {task.fields.get(key, '-')}" for label, key in self.fields)
        return ", ".join(parts) + (f", {extra}" if extra else "")

    def print_lines(self) -> None:
        now = self.clock()
        with self._lock:
            lines = [self.line(t, now) for t in self._tasks.values()]
        stamp = time.strftime("%H:%M:%S")
        out = self.out or sys.stderr
        for text in lines:
            out.write(f"[{stamp}] {text}\n")
        out.flush()
