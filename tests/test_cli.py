"""The CLI surface: help, version, and one-line errors with the right exit codes."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_matrix import fault

from specctl import __version__
from specctl.cli import main


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["specctl", *args])
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_commands(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "--help")
    assert code == 0
    for command in ("collect-hidden-states", "train"):
        assert command in out


def test_version(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "--version")
    assert code == 0 and __version__ in out


CLI_LIBRARIES = ("typer", "click")


def private_cli_names(source: str) -> list[str]:
    """Each `_name` (not a dunder) that a module imports from typer or click or reads off them
    (`typer.main._get_params_name_from_function`): their private API, which any release may change."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in CLI_LIBRARIES:
            names = [*node.module.split("."), *(a.name for a in node.names)]
        elif isinstance(node, ast.Attribute):
            parts = [node.attr]
            while isinstance(node := node.value, ast.Attribute):
                parts.append(node.attr)
            names = [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []
            names = names if names[:1] and names[0] in CLI_LIBRARIES else []
        else:
            continue
        found |= {f"{node.lineno}: {n}" for n in names if n.startswith("_") and not n.startswith("__")}
    return sorted(found)


def test_the_cli_uses_typer_and_click_through_their_public_api():
    root = Path(__file__).resolve().parents[1] / "specctl"
    found = [
        f"{p.relative_to(root.parent)}:{hit}"
        for p in sorted(root.rglob("*.py"))
        for hit in private_cli_names(p.read_text())
    ]
    assert found == []
    # the check finds both forms (cli_schema.py's until 2026-12-05) and passes public names and dunders
    synthetic = (
        "from typer.main import _get_params_name_from_function, get_callback\n"
        "import typer\n"
        "params = typer.main._get_params_name_from_function(f)\n"
        "from click._compat import term_len\n"
        "typer.main.get_command(app).callback.__wrapped__\n"
        "self._section_options = True\n"
    )
    assert private_cli_names(synthetic) == [
        "1: _get_params_name_from_function",
        "3: _get_params_name_from_function",
        "4: _compat",
    ]


def test_collect_help_has_example(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "collect-hidden-states", "--help")
    assert code == 0 and "Example:" in out and "--shard" in out


@fault(
    stage="recipe",
    fault="through the CLI: missing recipe, broken YAML, unknown key, out-of-range value",
    result="exit 2 and one line on stderr naming the file and the field",
)
@pytest.mark.parametrize(
    "recipe_text, needle",
    [
        (None, "recipe not found"),
        ("name: [oops\n", "not valid YAML"),
        ("name: a\nfeatures:\n  batch_tokenz: 3\n", "features.batch_tokenz: unknown key"),
        ("name: a\nfeatures:\n  batch_tokens: -3\n", "features.batch_tokens"),
    ],
)
def test_bad_recipe_is_one_line_exit_2(monkeypatch, capsys, tmp_path, recipe_text, needle):
    path = tmp_path / "r.yaml"
    if recipe_text is not None:
        path.write_text(recipe_text)
    code, _, err = run_main(monkeypatch, capsys, "collect-hidden-states", str(path))
    assert code == 2
    assert needle in err and str(path) in err
    assert err.strip().count("\n") == 0


def _recipe(tmp_path: Path, verifier_dir: Path, source: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(
        json.dumps(
            {
                "name": "cli",
                "output_dir": str(tmp_path / "runs"),
                "verifier": {"name_or_path": str(verifier_dir)},
                "data": {"source": source},
                "features": {"aux_layer_ids": [1, 2, 3]},
            }
        )
    )
    return path


@fault(
    stage="data",
    fault="through the CLI: data.source missing, empty, or without any assistant turn",
    result="one line on stderr naming the file; exit 2 for a file that is not there, 1 for its content",
)
@pytest.mark.parametrize(
    "make_source, needle",
    [
        (lambda d: str(d / "missing.jsonl"), "missing.jsonl"),
        (
            lambda d: (d / "empty.jsonl").write_text("") and str(d / "empty.jsonl") or str(d / "empty.jsonl"),
            "empty",
        ),
        (
            lambda d: (
                (d / "users.jsonl").write_text(
                    json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                )
                and str(d / "users.jsonl")
            ),
            "assistant",
        ),
    ],
)
def test_bad_data_is_one_line(monkeypatch, capsys, tmp_path, tiny_verifier_dir, make_source, needle):
    path = _recipe(tmp_path, tiny_verifier_dir, make_source(tmp_path))
    code, _, err = run_main(monkeypatch, capsys, "collect-hidden-states", str(path))
    assert code == (2 if needle == "missing.jsonl" else 1), err
    assert needle in err.lower() or needle in err
    assert err.strip().count("\n") == 0


@fault(
    stage="data",
    fault="an unknown hub dataset while offline",
    result="exit 1 and one line naming the id and suggesting a local .jsonl",
)
def test_unknown_hub_dataset_offline(monkeypatch, capsys, tmp_path, tiny_verifier_dir):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = _recipe(tmp_path, tiny_verifier_dir, "someorg/no-such-dataset-xyz")
    code, _, err = run_main(monkeypatch, capsys, "collect-hidden-states", str(path))
    assert code == 1
    assert "no-such-dataset-xyz" in err and ".jsonl" in err
    assert err.strip().count("\n") == 0


@fault(stage="collect", fault="`--shard 3/2`", result="exit 2, the message names --shard")
def test_bad_shard_spec(monkeypatch, capsys, tmp_path, tiny_verifier_dir):
    path = _recipe(tmp_path, tiny_verifier_dir, "x.jsonl")
    code, _, err = run_main(monkeypatch, capsys, "collect-hidden-states", str(path), "--shard", "3/2")
    assert code == 2 and "--shard" in err


# ---------------------------------------------------------------- exit codes (docs/troubleshooting.md)

# (argv with {drafter}/{recipe}/{verifier}/... placeholders, exit code, text the one-line error holds)
EXIT_CASES = [
    # usage and bad input: exit 2
    (["bench", "--drafter", "{drafter}", "--num-prompts", "0"], 2, "--num-prompts 0: Input should be"),
    (["bench", "--drafter", "{drafter}", "--backend", "tgi"], 2, "--backend 'tgi': choose one of"),
    (["bench", "--drafter", "{drafter}", "--sweep-k", "0"], 2, "--sweep-k '0'"),
    (["bench", "--drafter", "{drafter}", "--concurrency", "1,4"], 2, "the embedded backend decodes one"),
    (["bench", "--drafter", "{drafter}", "--require", "dflash.tau>=2"], 2, "unknown figure 'tau'"),
    (["bench", "--drafter", "{missing}"], 2, "no such directory"),
    (["bench", "--num-prompts", "many"], 2, "Invalid value for '--num-prompts'"),
    (
        ["bench", "--base-url", "http://127.0.0.1:9", "--drafter", "{drafter}"],
        2,
        "--base-url benches the server",
    ),
    (["bench", "--base-url", "localhost:8000"], 2, "expected the server's address"),
    (["collect-hidden-states", "{recipe}", "--shard", "9/8"], 2, "--shard '9/8': need 0 <= I < N"),
    (["train", "{recipe}", "--set", "features.aux_layer_ids=[0,99]"], 2, "features.aux_layer_ids [0, 99]"),
    (["train", "{recipe}", "--set", "drafter.mask_token_id=99999"], 2, "drafter.mask_token_id 99999"),
    (["train", "{recipe}", "--set", "train.learning_rate=1e-3"], 2, "--set train.learning_rate=1e-3: "),
    (["train", "quickstrat"], 2, "did you mean quickstart?"),
    (["train", "{duplicate}"], 2, "duplicate key 'lr' (first at line 3)"),
    (["recipe", "show", "{recipe}", "--set", "train.max_stepz=3"], 2, "did you mean train.max_steps?"),
    (["export", "{drafter}", "--push-to-hub", "badrepo"], 2, "expected a repo id like user/my-drafter"),
    (["export", "{drafter}", "--dry-run"], 2, "--dry-run and --private go with --push-to-hub"),
    # runtime failures: exit 1
    (
        ["bench", "--base-url", "{nobody}", "--verifier", "{verifier}"],
        1,
        "no OpenAI-compatible server answers",
    ),
    (["bench", "--drafter", "{truncated}"], 1, "not a readable safetensors file"),
    (["export", "{corrupt}", "--check"], 1, "config.json: not valid JSON"),
]


@fault(
    stage="hygiene",
    fault="bad input (flag values, recipe values, unknown names, flags that do not go together) and "
    "runtime failures, through the CLI",
    result="one line on stderr; exit 2 for every usage / bad-input case, 1 for runtime failures",
)
@pytest.mark.parametrize(("argv", "code", "needle"), EXIT_CASES, ids=[" ".join(c[0][:3]) for c in EXIT_CASES])
def test_exit_codes(monkeypatch, capsys, tmp_path, tiny_verifier_dir, argv, code, needle):
    from test_bench import _write_drafter

    from specctl.procs import free_port

    drafter = _write_drafter(tmp_path / "dflash", "dflash", 3, str(tiny_verifier_dir))
    truncated = _write_drafter(tmp_path / "cut", "dflash", 3, str(tiny_verifier_dir))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"speculators_model_type": "dflash",')
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("name: dup\ntrain:\n  lr: 1.0e-3\n  max_steps: 5\n  lr: 2.0e-3\n")
    places = {
        "drafter": drafter,
        "truncated": truncated,
        "corrupt": corrupt,
        "duplicate": duplicate,
        "missing": tmp_path / "no-such-dir",
        "recipe": _recipe(tmp_path, tiny_verifier_dir, "x.jsonl"),
        "verifier": tiny_verifier_dir,
        "nobody": f"http://127.0.0.1:{free_port()}",
    }
    monkeypatch.chdir(tmp_path)
    got, _, err = run_main(monkeypatch, capsys, *(a.format(**places) for a in argv))
    assert got == code, err
    assert needle in err, err
    if code == 1 or "Invalid value" not in needle:  # ours: one line (click draws its usage box)
        assert err.strip().count("\n") == 0, err


def test_debug_env_shows_traceback(monkeypatch, capsys, tmp_path):
    from specctl.errors import RecipeError

    monkeypatch.setenv("SPECCTL_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", ["specctl", "collect-hidden-states", str(tmp_path / "none.yaml")])
    with pytest.raises(RecipeError):
        main()


SLEEPER = """
import sys, time
from specctl import cli

@cli.app.command("sleep-for-test")
def sleep_for_test() -> None:
    print("up", flush=True)
    time.sleep(60)

sys.argv = ["specctl", "sleep-for-test"]
cli.main()
"""


@fault(
    stage="recipe",
    fault="SIGTERM or SIGINT (Ctrl-C) to a running command",
    result="exit 130 and one line `interrupted (SIGTERM)` / `(SIGINT)` on stderr, no traceback",
)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_one_line_and_exit_130(sig):
    """Typer turns a KeyboardInterrupt into a silent exit 130 and SIGTERM kills Python silently:
    both must end in one line, through the one error handler."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [
        f"error: interrupted ({signal.Signals(sig).name}); rerun the same command to resume"
    ], err


SWALLOWER = """
import sys, time
from specctl import cli

@cli.app.command("swallow-for-test")
def swallow_for_test() -> None:
    print("up", flush=True)
    try:
        time.sleep(60)
    except KeyboardInterrupt:  # what safetensors' slicing made of a SIGTERM in train
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

sys.argv = ["specctl", "swallow-for-test"]
cli.main()
"""


def test_an_error_raised_after_a_signal_is_the_interruption():
    """A signal handled inside native code comes out as that code's error (a ValueError from a
    safetensors read in train): still exit 130 and the one interrupted line, no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SWALLOWER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["error: interrupted (SIGTERM); rerun the same command to resume"], err


@pytest.mark.parametrize("command", ["train", "plan"])
def test_algo_help_lists_the_registered_algorithms(monkeypatch, capsys, command):
    """From the registry when help is shown, not a hard-coded list: a newly registered one appears."""
    import specctl.drafters as drafters

    monkeypatch.setitem(drafters.DRAFTERS, "zzalgo", drafters.DRAFTERS["dflash"])
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = run_main(monkeypatch, capsys, command, "--help")
    line = next(line for line in out.splitlines() if "--algo " in line and "registered" in line)
    assert code == 0 and f"A registered algorithm: {', '.join(drafters.DRAFTERS)} (default" in line
    assert "zzalgo" in line


def test_push_dry_run_prints_the_model_card(monkeypatch, capsys, tmp_path, tiny_verifier_dir):
    """`export DIR --push-to-hub REPO --dry-run` shows the card that would be uploaded (the repo as
    the served model), not only the file list; nothing is uploaded and the directory is unchanged."""
    from test_bench import _write_drafter

    drafter = _write_drafter(tmp_path / "dflash", "dflash", 3, str(tiny_verifier_dir))
    before = sorted(p.name for p in drafter.iterdir())
    code, out, err = run_main(
        monkeypatch, capsys, "export", str(drafter), "--push-to-hub", "me/tiny-dflash", "--dry-run"
    )
    assert code == 0, err
    card = out.split("as uploaded ---\n", 1)[1]
    assert card.startswith("---\n") and "# tiny-dflash" in card
    assert '"model": "me/tiny-dflash"' in card and "mean acceptance length (tau)" in card
    assert "dry run: nothing uploaded" in out and sorted(p.name for p in drafter.iterdir()) == before
