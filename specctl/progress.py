"""Progress for long stages: a rich bar on a terminal, plain lines at a steady interval otherwise.

A rich bar redraws itself in place; written to a file (SLURM, nohup, CI, a pipe) it shows nothing
until the stage ends. So when stderr is not a terminal `progress_bar` returns a `LogProgress`
instead: same calls (`add_task`, `update`, `advance`, `reset`, `with bar:`), and while it runs a
background thread prints one line per task every SPECCTL_PROGRESS_INTERVAL seconds (default 30):

    [12:04:31] collect hidden states: 19,664/72,832 tok (27.0%), 655 tok/s, 30s elapsed, ETA 1m21s

Every stage (data, collect, train's live view, bench) goes through this one function.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

console = Console(stderr=True)
DEFAULT_INTERVAL_S = 30.0


class RateColumn(ProgressColumn):
    """Units per second, e.g. '1,234 tok/s'."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} {self.unit}/s", style="progress.data.speed")


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
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
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
class _Task:
    description: str
    total: float | None
    completed: float
    fields: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    start_completed: float = 0.0


class LogProgress:
    """rich.Progress's interface, printing plain lines (see the module docstring).

    The rate is measured since the task was added (or reset), so a resumed stage whose task
    starts at `completed=N` reports the speed of this run, and the ETA is what is left at it.
    """

    def __init__(self, unit: str, fields: Sequence[tuple[str, str]], interval: float, out=None):
        self.unit, self.fields, self.interval = unit, list(fields), interval
        self.out = out
        self._tasks: dict[int, _Task] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- rich.Progress's calls
    def add_task(self, description: str, total: float | None = 100.0, completed: float = 0, **fields) -> int:
        with self._lock:
            task_id = len(self._tasks)
            self._tasks[task_id] = _Task(
                description, total, completed, dict(fields), start_completed=completed
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

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, *, total: float | None = None, completed: float = 0, **fields) -> None:
        with self._lock:
            task = self._tasks[task_id]
            task.completed, task.start_completed, task.started = completed, completed, time.monotonic()
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
        done = task.completed - task.start_completed
        parts = [f"{task.description}: {_count(task.completed)}"]
        if task.total:
            parts[0] += f"/{_count(task.total)} {self.unit} ({100 * task.completed / task.total:.1f}%)"
        else:
            parts[0] += f" {self.unit}"
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        if rate is not None:
            parts.append(f"{rate:,.2f} {self.unit}/s" if rate < 10 else f"{rate:,.0f} {self.unit}/s")
        parts.append(f"{duration(elapsed)} elapsed")
        if task.total and rate:
            parts.append(f"ETA {duration(max(0.0, task.total - task.completed) / rate)}")
        extra = " ".join(f"{label} {task.fields.get(key, '-')}" for label, key in self.fields)
        return ", ".join(parts) + (f", {extra}" if extra else "")

    def print_lines(self) -> None:
        now = time.monotonic()
        with self._lock:
            lines = [self.line(t, now) for t in self._tasks.values()]
        stamp = time.strftime("%H:%M:%S")
        out = self.out or sys.stderr
        for text in lines:
            out.write(f"[{stamp}] {text}\n")
        out.flush()
