"""Progress ETAs (specctl.progress): measured rates only, never a climb for lack of data."""

from __future__ import annotations

import io
import random
import re

from rich.console import Console
from rich.progress import Progress

from specctl.progress import EtaColumn, LogProgress, Pace, duration, eta_text


class Clock:
    """A fake monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def seconds(text: str) -> float:
    """`duration`'s output read back: 12s, 4m05s, 3h02m."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert m and text, text
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return 3600 * h + 60 * mi + s


def eta_of(line: str) -> str:
    """The ETA part of a plain progress line."""
    m = re.search(r"ETA ([^,]+(?:, no progress for \S+)?)", line)
    assert m, line
    return m.group(1)


def test_the_observed_small_collect_counts_down_then_says_overdue_instead_of_climbing():
    """The bug: a 4-conversation HF collect sat at 186/1,024 tok for three minutes while its ETA
    climbed from 6m46s to 20m17s. Replayed: the first lump after 41 s, then four silent minutes."""
    clock, out = Clock(), io.StringIO()
    bar = LogProgress("tok", [], interval=30, out=out, clock=clock)
    task = bar.add_task("generating conversations", total=1024)
    etas = []
    for t in range(0, 41, 10):  # nothing measured yet
        clock.now = t
        assert eta_of(bar.line(bar._tasks[task], clock.now)) == "measuring"
    clock.now = 41.0
    bar.update(task, completed=186)  # 186 tok in 41 s: 4.54 tok/s, 838 left: 184.7 s
    for t in range(41, 300, 15):  # then four silent minutes
        clock.now = float(t)
        etas.append(eta_of(bar.line(bar._tasks[task], clock.now)))
    counting = [seconds(e) for e in etas if not e.startswith("overdue")]
    assert counting[0] == 185 and counting == sorted(counting, reverse=True)  # counts down
    assert etas[-1] == "overdue, no progress for 4m15s"  # at 296 s, past the 226 s projected
    line = bar.line(bar._tasks[task], clock.now)
    assert "4.54 tok/s" in line  # the measured rate, not 186 tok over all the silent time
    clock.now = 230.0
    bar.update(task, completed=700)  # new data: a new projection (700 tok in 230 s)
    assert eta_of(bar.line(bar._tasks[task], clock.now)) == duration(324 / (700 / 230))


def reference_eta(history: list[tuple[float, float]], total: float, now: float) -> str:
    """Brute force from the whole history of (time, count) observations up to `now`: the rate is
    the count gained by the last change divided by the time it took, the ETA what is left at it
    minus the time since that change."""
    seen = [(t, c) for t, c in history if t <= now]
    t0, c0 = seen[0]
    changes = [(t, c) for i, (t, c) in enumerate(seen) if i > 0 and c != seen[i - 1][1]]
    if not changes:
        return "ETA measuring"
    t1, c1 = changes[-1]
    if c1 - c0 <= 0 or t1 - t0 <= 0:
        return "ETA measuring"
    left = (total - c1) / ((c1 - c0) / (t1 - t0)) - (now - t1)
    return f"ETA {duration(left)}" if left >= 0 else f"ETA overdue, no progress for {duration(now - t1)}"


def test_eta_matches_a_brute_force_replay_and_never_climbs_between_counts():
    rng = random.Random(0)
    for _ in range(200):
        total = rng.choice([10, 1024, 50_000])
        clock = Clock()
        clock.now = rng.uniform(0, 5)
        start = rng.choice([0, total // 3])  # a resumed stage starts part-way
        pace = Pace.begin(start, clock.now)
        history, count, previous = [(clock.now, start)], start, None
        for _ in range(rng.randint(1, 30)):
            clock.now += rng.expovariate(0.1)
            if rng.random() < 0.4:  # a lump of work arrives (or a repeated count: no news)
                count = min(total, count + rng.choice([0, rng.randint(1, max(1, total // 8))]))
                pace.observe(count, clock.now)
                history.append((clock.now, count))
                previous = None
            text = eta_text(pace, total, clock.now)
            assert text == ("" if count >= total else reference_eta(history, total, clock.now))
            if previous is not None and text.startswith("ETA ") and previous.startswith("ETA "):
                a, b = (p[4:] for p in (previous, text))
                if not a.startswith(("measuring", "overdue")) and not b.startswith(("measuring", "overdue")):
                    assert seconds(b) <= seconds(a)  # no new count: the ETA cannot grow
            previous = text


def test_no_total_no_eta_and_a_reset_measures_again():
    clock, out = Clock(), io.StringIO()
    bar = LogProgress("prompt", [], interval=30, out=out, clock=clock)
    task = bar.add_task("bench", total=None)
    clock.now = 5
    bar.advance(task, 3)
    assert "ETA" not in bar.line(bar._tasks[task], clock.now)  # no total: nothing to estimate
    bar.reset(task, total=12)
    assert eta_of(bar.line(bar._tasks[task], clock.now)) == "measuring"
    clock.now = 9
    bar.advance(task, 4)  # 4 prompts in 4 s, 8 left
    assert eta_of(bar.line(bar._tasks[task], clock.now)) == "8s"
    bar.update(task, completed=12)
    assert "ETA" not in bar.line(bar._tasks[task], clock.now)  # done: nothing left to estimate
    done = LogProgress("step", [], interval=30, out=out, clock=clock)
    resumed = done.add_task("train", total=2, completed=2)  # a resumed run with no step left
    assert "ETA" not in done.line(done._tasks[resumed], clock.now)
    bar.update(task, completed=4)
    bar.print_lines()
    assert out.getvalue().startswith("[") and "bench: 4/12 prompt (33.3%), 1.00 prompt/s" in out.getvalue()


def test_the_rich_bar_eta_uses_the_same_measurement():
    """On a terminal the bar's ETA column: measuring, then a countdown that holds through silence."""
    clock = Clock()
    column = EtaColumn()
    progress = Progress(column, console=Console(file=io.StringIO()), get_time=clock, auto_refresh=False)
    task_id = progress.add_task("collect", total=100)
    task = progress.tasks[0]
    assert column.render(task).plain == "ETA measuring"
    clock.now = 10
    progress.advance(task_id, 20)  # 2 units/s, 80 left
    assert column.render(task).plain == "ETA 40s"
    clock.now = 30  # twenty silent seconds
    assert column.render(task).plain == "ETA 20s"
    clock.now = 60
    assert column.render(task).plain == "ETA overdue, no progress for 50s"
    progress.reset(task_id)  # a new measurement
    assert column.render(progress.tasks[0]).plain == "ETA measuring"
