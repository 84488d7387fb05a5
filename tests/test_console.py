"""Output that survives a log file (specctl.console): tables at the width their cells need when
stdout is not a terminal, so no path is cut and no value wrapped."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table

from specctl.console import LOG_WIDTH, FittedConsole

LONG = "/scratch/" + "a-project-directory/" * 8 + "runs/probe/drafters/dflash/checkpoints/step-2"


def summary(console: FittedConsole) -> str:
    table = Table(title="train dflash", show_header=False, title_justify="left")
    table.add_column()
    table.add_column()
    table.add_row("checkpoint", LONG)
    table.add_row("val acc per position", " ".join(f"{a:.2f}" for a in [0.81, 0.62, 0.47, 0.33] * 4))
    console.print(table)
    return console.file.getvalue()


def test_a_file_gets_whole_cells_a_terminal_keeps_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = summary(FittedConsole(file=io.StringIO()))
    assert LONG in text and "…" not in text
    assert "0.81 0.62 0.47 0.33 0.81" in text  # per-position values on one line
    assert max(len(line) for line in text.splitlines()) < LOG_WIDTH
    terminal = FittedConsole(file=io.StringIO(), force_terminal=True)
    assert terminal.size.width == 80
    assert "…" in summary(terminal)  # on an 80-column terminal rich still fits the screen


def run_to_file(cwd: Path, log: Path, *args: str, columns: str | None) -> str:
    """`specctl ARGS` with stdout to a file, as a SLURM or CI job has it; returns that file."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "specctl", *args],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=600,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return log.read_text()


@pytest.mark.slow
def test_every_command_summary_piped_to_a_file_has_no_cut_cell(tmp_path, tiny_verifier_dir):
    """Each command's summary with stdout to a file, at COLUMNS=80 (rich honours it; what a CI
    runner sets) and with COLUMNS unset: before, train cut its checkpoint path and bench its
    headers, per-position values and intervals. Measured: about 60 s on 2 cores."""
    from test_reliability import write_recipe

    recipe = str(write_recipe(tmp_path, tiny_verifier_dir))
    run = tmp_path / "runs" / "tiny"
    algo_dir = run / "drafters" / "dflash"
    commands = [
        (["collect-hidden-states", recipe], "80", [run / "features"]),
        (["train", recipe], "80", [algo_dir / "checkpoints" / "step-2", algo_dir / "metrics.jsonl"]),
        (["export", str(run)], "80", [algo_dir / "export"]),
        (["export", str(algo_dir / "export")], None, [algo_dir / "export"]),  # the check's summary
        (["plan", recipe, "--gpus", "1"], "80", []),
        (["bench", recipe, "--num-prompts", "2", "--max-new-tokens", "8", "--repeat", "1"], "80", []),
        (["recipe", "list"], None, []),
    ]
    for i, (args, columns, paths) in enumerate(commands):
        text = run_to_file(tmp_path, tmp_path / f"{i}.log", *args, columns=columns)
        name = " ".join(args[:1])
        assert text.strip(), name
        assert "…" not in text, f"{name}: a cell was cut:\n{text}"
        for path in paths:  # each whole, on one line
            assert str(path) in text, f"{name}: {path} not printed whole:\n{text}"
    bench = (tmp_path / "5.log").read_text()
    row = next(line for line in bench.splitlines() if line.startswith("│ dflash"))
    assert "acceptance per position" in bench  # the header whole
    assert re.search(r"│ \d\.\d\d \d\.\d\d \d\.\d\d +│", row), row  # K=3 values on the dflash row
