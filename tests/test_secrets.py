"""Secrets (issue 45, item 7): a URL's credentials are written nowhere, the API key is not sent in
clear to another host, no dataset loading script runs, and push publishes nothing outside the
export directory. Traffic goes to 127.0.0.1 only: refusals are checked with name resolution
patched to fail the test, so they provably happen before any connection."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import socket
from pathlib import Path

import pytest
import yaml
from reliability_matrix import fault
from test_bench_vllm import FAKE_SERVER, _running_fake
from test_data import CONVS, write_jsonl
from test_generate import fake_openai  # noqa: F401  (a fixture: the in-process OpenAI server)
from test_reliability import run_main, write_recipe

from specctl.data import prepare_data
from specctl.errors import DataError, UsageError
from specctl.recipe import DataSection, VerifierSection, dump_recipe, load_recipe
from specctl.redact import check_key_destination, is_loopback, redact_text, redact_tree, redact_url

SECRET = "s3cr3t-Zq9"  # in URLs: user info and query values
KEY = "sk-test-Zq9-key"  # OPENAI_API_KEY


def _files_with(root: Path, needle: str) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


@pytest.fixture
def no_dns(monkeypatch):
    """Fail on any name resolution (every connection starts with one): a refusal came first."""
    looked_up = []

    def refuse(host, *args, **kwargs):
        looked_up.append(host.decode() if isinstance(host, bytes) else host)
        raise OSError(f"test: no network ({host})")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return looked_up


# ---------------------------------------------------------------- the pure functions


@pytest.mark.parametrize(
    "url, want",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("https://user:pw@host:8000/v1", "https://***@host:8000/v1"),
        ("https://tok@host", "https://***@host"),
        ("http://a:b@[::1]:9/x?model=m", "http://***@[::1]:9/x?model=m"),
        ("https://h/p?api_key=abc&model=m&token=t#f", "https://h/p?api_key=***&model=m&token=***#f"),
        ("https://h/?X-Api-Key=abc&page=2", "https://h/?X-Api-Key=***&page=2"),
        ("https://h/?page=2&limit=5", "https://h/?page=2&limit=5"),
        ("not a url", "not a url"),
        ("/local/path/with@sign", "/local/path/with@sign"),
    ],
)
def test_redact_url_cases(url, want):
    assert redact_url(url) == want
    assert redact_url(want) == want  # idempotent


def test_redact_url_against_brute_force():
    """Every URL built from parts: the redacted one is the URL built from the masked parts."""
    rng = random.Random(0)
    secret_names = ["token", "api_key", "API-KEY", "access_token", "password", "sig", "key", "client_secret"]
    plain_names = ["page", "model", "limit", "stream", "format"]
    hosts = ["host", "gpu-7.cluster.example", "10.0.0.2", "[::1]", "localhost"]

    def build(scheme, userinfo, host, port, path, query):
        netloc = (f"{userinfo}@" if userinfo else "") + host + (f":{port}" if port else "")
        q = "&".join(f"{k}={v}" for k, v in query)
        return f"{scheme}://{netloc}{path}" + (f"?{q}" if q else "")

    for scheme, userinfo, host, port, path in itertools.product(
        ["http", "https"], [None, "u", f"u:{SECRET}"], hosts, [None, 8000], ["", "/v1", "/a/b"]
    ):
        for _ in range(4):
            names = rng.sample(secret_names + plain_names, rng.randint(0, 4))
            query = [(n, f"{SECRET}{i}") for i, n in enumerate(names)]
            url = build(scheme, userinfo, host, port, path if query or path else path, query)
            masked = [(n, "***" if n in secret_names else v) for n, v in query]
            want = build(scheme, "***" if userinfo else None, host, port, path, masked)
            assert redact_url(url) == want, url
            leaked = SECRET in redact_url(url)
            assert leaked == any(n in plain_names for n in names)  # only the plain values remain


def test_redact_text_and_tree():
    text = f"error: http://u:{SECRET}@h:1/v1 failed; see https://h/docs?token={SECRET} and ftp://x"
    assert SECRET not in redact_text(text) and "http://***@h:1/v1 failed;" in redact_text(text)
    assert redact_text("no url here") == "no url here"
    tree = {"a": [f"http://u:{SECRET}@h", 3, None], "b": {"c": f"x https://h/?key={SECRET}"}, "d": True}
    assert redact_tree(tree) == {
        "a": ["http://***@h", 3, None],
        "b": {"c": "x https://h/?key=***"},
        "d": True,
    }


def test_loopback_and_key_destination():
    assert all(
        is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost", "LOCALHOST", "a.localhost")
    )
    assert not any(is_loopback(h) for h in ("10.0.0.1", "example.com", "localhost.example.com", "", None))
    ok = [
        ("http://127.0.0.1:8000", KEY, False),  # loopback
        ("http://[::1]:8000", KEY, False),
        ("https://gpu.example:8000", KEY, False),  # encrypted
        (f"https://u:{SECRET}@gpu.example", None, False),
        ("http://gpu.example:8000", None, False),  # nothing secret to send
        ("http://gpu.example:8000", KEY, True),  # the user opted in
        (f"http://u:{SECRET}@gpu.example", None, True),
    ]
    for url, key, allow in ok:
        check_key_destination(url, key, "data.server_url", allow)
    for url, key, what in [
        ("http://gpu.example:8000", KEY, "OPENAI_API_KEY is set"),
        (f"http://u:{SECRET}@10.0.0.2:8000", None, "the URL carries credentials"),
        (f"http://gpu.example/?token={SECRET}", None, "the URL carries credentials"),
    ]:
        with pytest.raises(UsageError) as e:
            check_key_destination(url, key, "data.server_url", False)
        line = str(e.value)
        assert "\n" not in line and SECRET not in line and KEY not in line
        assert line.startswith("data.server_url http://") and what in line
        assert "data.allow_key_over_http: true" in line


def test_dump_recipe_masks_and_the_recipe_keeps_the_credentials(tmp_path):
    url = f"http://me:{SECRET}@127.0.0.1:8000"
    recipe = load_recipe("quickstart", [f"data.server_url={url}", f"bench.base_url={url}/?api_key={SECRET}"])
    text = dump_recipe(recipe)
    assert SECRET not in text
    saved = yaml.safe_load(text)
    assert saved["data"]["server_url"] == "http://***@127.0.0.1:8000"
    assert saved["bench"]["base_url"] == "http://***@127.0.0.1:8000/?api_key=***"
    assert recipe.data.server_url == url  # requests still carry them


# ---------------------------------------------------------------- written files


@fault(
    stage="hygiene",
    fault="bench --base-url http://user:password@host (a server URL with credentials)",
    result="the run uses them; report.json, report.md and every other file written, and the output, "
    "show the URL as http://***@host",
)
def test_bench_base_url_credentials_are_not_written(monkeypatch, capfd, tmp_path, tiny_verifier_dir):
    from conftest import bench_with_flags

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    out = tmp_path / "bench"
    with _running_fake(script, tmp_path, "--k", "2") as (url, requests, proc):
        with_creds = url.replace("http://", f"http://me:{SECRET}@")
        report = bench_with_flags(
            base_url=with_creds,
            verifier=str(tiny_verifier_dir),
            num_prompts=2,
            max_new_tokens=6,
            output=out,
            progress=False,
        )
    assert report.ok, report.errors
    d = json.loads((out / "report.json").read_text())
    assert d["provenance"]["server"]["base_url"] == url.replace("http://", "http://***@")
    assert "http://***@127.0.0.1" in (out / "report.md").read_text()
    assert requests.read_text()  # the server was asked, through the URL with its credentials
    assert _files_with(tmp_path, SECRET) == []
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err


@fault(
    stage="hygiene",
    fault="data.server_url http://user:password@host (credentials in the generation server's URL)",
    result="the server is asked; data/manifest.json, the journal and the stage's output show http://***@host",
)
def test_data_server_url_credentials_are_not_written(
    capfd,
    tmp_path,
    tiny_tokenizer,
    tiny_verifier_dir,
    fake_openai,  # noqa: F811
):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    url = fake_openai.replace("http://", f"http://me:{SECRET}@")
    cfg = DataSection(source=str(path), shuffle=False, regenerate=True, engine="server", server_url=url)
    verifier = VerifierSection(name_or_path=str(tiny_verifier_dir))
    s = prepare_data(cfg, tiny_tokenizer, tmp_path / "data", verifier=verifier)
    assert s.engine == "server" and s.conversations_generated == len(CONVS)
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["data"]["server_url"] == fake_openai.replace("http://", "http://***@")
    err = capfd.readouterr().err
    assert "http://***@127.0.0.1" in err and SECRET not in err  # the log line names the server, masked
    assert _files_with(tmp_path / "data", SECRET) == []
    assert cfg.server_url == url


@fault(
    stage="hygiene",
    fault="credentials in data.server_url and bench.base_url of a recipe that collect, train "
    "(report_to tensorboard) and export run",
    result="no file of the run holds them: checkpoints' recipe.yaml, the tensorboard hparams, the export",
)
def test_recipe_credentials_are_not_written_by_train(monkeypatch, capfd, tmp_path, tiny_verifier_dir):
    recipe = write_recipe(tmp_path, tiny_verifier_dir)
    tree = yaml.safe_load(recipe.read_text())
    tree["data"]["server_url"] = f"http://me:{SECRET}@127.0.0.1:9"  # not used: the data is local
    tree["bench"] = {"base_url": f"https://gpu.example/?token={SECRET}"}
    tree["train"]["report_to"] = "tensorboard"
    recipe.write_text(yaml.safe_dump(tree))
    for args in (("collect-hidden-states", str(recipe)), ("train", str(recipe))):
        code, out, err = run_main(monkeypatch, capfd, *args)
        assert code == 0, err
        assert SECRET not in out + err
    run = tmp_path / "runs" / "tiny"
    saved = sorted(run.rglob("recipe.yaml"))
    assert saved and all("http://***@127.0.0.1:9" in p.read_text() for p in saved)
    assert any("tensorboard" in p.parts for p in run.rglob("*") if p.is_file())  # the tracker wrote
    code, out, err = run_main(monkeypatch, capfd, "export", str(run))
    assert code == 0, err
    assert _files_with(run, SECRET) == []


# ---------------------------------------------------------------- where the key goes


@fault(
    stage="hygiene",
    fault="OPENAI_API_KEY set (or credentials in the URL) and a plain-http server URL that is not "
    "loopback: bench --base-url, data.server_url",
    result="exit 2 with one line naming the setting and allow_key_over_http, before any name lookup "
    "or connection; the opt-in lets the run go on",
)
def test_key_is_not_sent_over_plain_http_to_another_host(
    monkeypatch, capfd, tmp_path, tiny_tokenizer, tiny_verifier_dir, no_dns
):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    remote = "http://gpu-node.example:8000"
    code, out, err = run_main(
        monkeypatch, capfd, "bench", "--base-url", remote, "--verifier", str(tiny_verifier_dir)
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "bench.base_url http://gpu-node.example:8000: OPENAI_API_KEY is set" in err
    assert "bench.allow_key_over_http: true" in err and KEY not in out + err
    assert no_dns == []

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in CONVS])
    verifier = VerifierSection(name_or_path=str(tiny_verifier_dir))

    def generate(url: str, **kw):
        cfg = DataSection(source=str(path), regenerate=True, engine="server", server_url=url, **kw)
        prepare_data(cfg, tiny_tokenizer, tmp_path / "data", verifier=verifier, progress=False)

    with pytest.raises(UsageError, match=r"^data\.server_url http://gpu-node\.example:8000: OPENAI_API_KEY"):
        generate(remote)
    monkeypatch.delenv("OPENAI_API_KEY")
    with pytest.raises(
        UsageError, match=r"^data\.server_url http://\*\*\*@10\.1\.2\.3:8000: the URL carries"
    ):
        generate(f"http://me:{SECRET}@10.1.2.3:8000")
    assert no_dns == []
    # opted in: the request is attempted (and meets the patched resolver)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with pytest.raises(Exception, match="no OpenAI-compatible server answers") as e:
        generate(remote, allow_key_over_http=True)
    assert not isinstance(e.value, UsageError) and "gpu-node.example" in no_dns


# ---------------------------------------------------------------- dataset loading scripts


@fault(
    stage="hygiene",
    fault="a hub dataset with a loading script (data.source, bench --dataset ID, a named prompt set)",
    result="every datasets.load_dataset call passes trust_remote_code=False: the script is not run",
)
def test_load_dataset_never_trusts_remote_code(monkeypatch, tmp_path):
    import datasets

    from specctl.bench import prompts
    from specctl.data import sources

    calls = []

    def record(*args, **kwargs):
        calls.append(kwargs)
        row = {"messages": CONVS[0], "prompt": "p", "question": "q", "turns": ["t"], "category": "c"}
        return datasets.Dataset.from_list([row])

    monkeypatch.setattr(datasets, "load_dataset", record)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    sources.open_source("someorg/chat-with-a-script")
    csv = tmp_path / "chats.csv"
    csv.write_text("prompt\nhello\n")
    sources.open_source(str(csv))
    prompts.load_hub_dataset("someorg/prompts-with-a-script", None, None, "prompt")
    for name in prompts.HUB_PROMPT_SETS:
        with contextlib.suppress(DataError):  # the recorded row may lack a set's fields: it was asked
            prompts.load_hub_rows(name)
    assert len(calls) == 3 + len(prompts.HUB_PROMPT_SETS)
    assert [c.get("trust_remote_code", "missing") for c in calls] == [False] * len(calls)


# ---------------------------------------------------------------- push


@fault(
    stage="hygiene",
    fault="an export directory holding a symlink to a file outside it (push --dry-run and push)",
    result="UsageError (exit 2), one line naming the link and its target, before any upload; a link inside "
    "the directory is pushed as its file",
)
def test_push_refuses_a_symlink_leaving_the_export(monkeypatch, tmp_path):
    import huggingface_hub

    from specctl.export.hub import push_to_hub

    class NoNetwork:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a refused push must not reach the hub")

    monkeypatch.setattr(huggingface_hub, "HfApi", NoNetwork)
    export = _tiny_export(tmp_path / "export")
    outside = tmp_path / "id_ed25519"
    outside.write_text("PRIVATE KEY\n")
    (export / "notes.txt").symlink_to(export / "config.json")  # inside: fine
    plan = push_to_hub(export, "me/tiny", dry_run=True)
    assert "notes.txt" in dict(plan.files)
    (export / "extra").mkdir()
    (export / "extra" / "key.txt").symlink_to(outside)
    for dry_run in (True, False):
        with pytest.raises(UsageError) as e:
            push_to_hub(export, "me/tiny", dry_run=dry_run)
        line = str(e.value)
        assert "\n" not in line and f"extra/key.txt: a symlink to {outside}, outside the export" in line
    (export / "extra" / "key.txt").unlink()
    (export / "extra").rmdir()
    (export / "extra").symlink_to(outside.parent)  # a directory link that leaves
    with pytest.raises(UsageError, match="extra: a symlink to"):
        push_to_hub(export, "me/tiny", dry_run=True)


def _tiny_export(path: Path) -> Path:
    """A float32 DFlash export of the tiny verifier (the test_export helpers)."""
    from conftest import make_tiny_tokenizer
    from test_export import (
        AUX,
        MASK_ID,
        borrowed,
        build_drafter,
        save_drafter,
        spec_from_config,
        tiny_verifier_model,
    )

    model = tiny_verifier_model()
    vdir = path.parent / "verifier"
    model.save_pretrained(vdir)
    make_tiny_tokenizer().save_pretrained(vdir)
    verifier = {"model": model, "path": vdir, "spec": spec_from_config(model.config, str(vdir), AUX, MASK_ID)}
    verifier["weights"] = borrowed(model)
    drafter = build_drafter(verifier, "dflash", False)
    return Path(save_drafter(drafter, path, "float32"))
