"""`specctl bench --base-url URL`: an OpenAI-compatible server someone else runs, benched as it runs.

Nothing is started or stopped: the server's configuration (its model, its speculative decoding)
is what is measured, as one method named `server`. Before any prompt is sent the server is asked
what it is: /v1/models gives the served model (and, on vLLM, its `root`: the directory or hub id it
loaded), /metrics whether it is vLLM (it names `vllm:` families) and its K (the per-position
acceptance counters it exports), /version vLLM's version.

- A vLLM server gets vLLM's request extensions (`stop_token_ids`, `return_token_ids`: output ids
  come back and are kept) and its spec-decode counters are read before and after each group of
  prompts, as for the servers specctl starts: tau and per-position acceptance.
- Any other server gets the standard request (token-id prompt, seed, sampling) and reports
  throughput and latency only; the acceptance columns read "-". A server that refuses token-id
  prompts (HTTP 400/422 on the first request) gets the rendered prompt text instead, and one that
  returns no ids is left out of the "= plain" comparison (nothing to compare).

The counters are server-wide: requests other clients send meanwhile count too. A run whose counter
grew by more tokens than its own answers says so in the report's errors.

Prompts are tokenized with --verifier, else the recipe's verifier, else the server's model `root`;
set OPENAI_API_KEY for a server started with --api-key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import urlparse

import httpx

from specctl.bench.client import RequestError, RequestSettings, complete_one
from specctl.bench.plan import Groups, Method, same_verifier
from specctl.bench.report import MethodResult, Point
from specctl.bench.server import measure_loads
from specctl.bench.spec import BackendSpec, Opening
from specctl.errors import SpecctlError, UsageError, first_line
from specctl.http import get_text
from specctl.recipe import BenchSection, VerifierSection
from specctl.redact import KEY_ENV, check_key_destination, redact_text, redact_url
from specctl.vllm.metrics import is_vllm_metrics, parse_spec_decode_metrics
from specctl.vllm.verifier import load_vllm_verifier


@dataclass(frozen=True)
class ServerInfo:
    """What a running server says about itself (report.json: provenance.server)."""

    base_url: str
    model: str  # the served model name requests carry
    root: str | None  # vLLM: the directory or hub id the model was loaded from
    vllm: bool
    vllm_version: str | None
    num_speculative_tokens: int  # vLLM: per-position acceptance counters it exports (0: none)
    prompt_format: str = "token ids"  # or "text": the server refused token-id prompts


def normalize_base_url(url: str) -> str:
    """`http://host:8000`, `.../v1` or with a trailing slash -> `http://host:8000` (bad: exit 2)."""
    text = url.strip().rstrip("/")
    text = text.removesuffix("/v1").rstrip("/")
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(f"--base-url {url!r}: expected the server's address, e.g. http://127.0.0.1:8000")
    return text


def _get_json(url: str, api_key: str | None) -> Any:
    return json.loads(get_text(url, timeout_s=30, api_key=api_key))


def choose_model(models: list[dict[str, Any]], verifier: str | None, base_url: str) -> dict[str, Any]:
    """The served model to bench: the only one, or the one --verifier names (id or root)."""
    if not models:
        raise SpecctlError(f"{redact_url(base_url)}/v1/models lists no model; is the server still loading?")
    if len(models) == 1:
        return models[0]
    if verifier is not None:
        for m in models:
            if verifier in (m.get("id"), m.get("root")):
                return m
    ids = ", ".join(str(m.get("id")) for m in models)
    raise UsageError(
        f"{redact_url(base_url)} serves several models ({ids}); pass --verifier with the one to bench"
    )


def probe_server(base_url: str, verifier: str | None, api_key: str | None) -> ServerInfo:
    """Ask the server what it serves and whether it is vLLM (no prompt sent)."""
    try:
        listed = _get_json(base_url + "/v1/models", api_key)
    except (httpx.HTTPError, OSError, ValueError) as e:
        why = redact_text(first_line(e, 160))
        raise SpecctlError(
            f"--base-url {redact_url(base_url)}: no OpenAI-compatible server answers /v1/models ({why}); "
            "start it first (e.g. python -m vllm.entrypoints.openai.api_server --model MODEL) or fix the URL"
        ) from None
    models = listed.get("data", []) if isinstance(listed, dict) else []
    model = choose_model([m for m in models if isinstance(m, dict)], verifier, base_url)
    try:
        text = get_text(base_url + "/metrics", api_key=api_key)
    except (httpx.HTTPError, OSError):
        text = ""
    vllm = is_vllm_metrics(text)
    k = len(parse_spec_decode_metrics(text).counters.accepted_per_position) if vllm else 0
    version = None
    if vllm:
        try:
            version = _get_json(base_url + "/version", api_key).get("version")
        except (httpx.HTTPError, OSError, ValueError, AttributeError):
            version = None
    return ServerInfo(base_url, str(model.get("id")), model.get("root"), vllm, version, k)


class RemoteBackend:
    """measure(method, prompts): every prompt at each concurrency level (or request rate) against the
    running server."""

    def __init__(
        self,
        base_url: str,
        section: VerifierSection | None,
        settings: BenchSection,
        levels: Sequence[int],
        on_done: Callable[[int], None] | None,
        warn: Callable[[str], None],
        rates: Sequence[float] = (),
    ):
        self.api_key = os.environ.get(KEY_ENV) or None
        check_key_destination(base_url, self.api_key, "bench.base_url", settings.allow_key_over_http)
        asked = section.name_or_path if section is not None else None
        self.info = probe_server(base_url, asked, self.api_key)
        source = asked or self.info.root or self.info.model
        base = section or VerifierSection()
        self.verifier = load_vllm_verifier(base.model_copy(update={"name_or_path": source}))
        if asked is not None and self.info.root and not same_verifier(asked, self.info.root):
            warn(
                f"warning: {redact_url(base_url)} serves {self.info.root}; the prompts are tokenized with "
                f"{asked}'s "
                "tokenizer (pass --verifier to change it)"
            )
        self.verifier_name, self.tokenizer = source, self.verifier.tokenizer
        self.levels, self.on_done, self.warn = tuple(levels), on_done, warn
        # bench --request-rate: one load per rate at the first level's cap, else one per level
        self.loads = [(self.levels[0], r) for r in rates] or [(level, None) for level in self.levels]
        self.format_checked = False
        self.passes = settings.repeats or 1  # bench.repeats: passes over the prompts at each level
        self.request = RequestSettings(
            model=self.info.model,
            sampling=settings.sampling,
            stop_token_ids=self.verifier.stop_token_ids if self.info.vllm else (),
            vllm=self.info.vllm,
            api_key=self.api_key,
        )

    @property
    def server_info(self) -> dict[str, Any]:
        """What report.json records about the server: its URL without credentials."""
        return asdict(replace(self.info, base_url=redact_url(self.info.base_url)))

    def _prompt_format(self, groups: Groups) -> None:
        """Token-id prompts unless the server refuses them (HTTP 400/422): then the prompt text."""
        index, prompt = next(p for g in groups.values() for p in g)
        try:
            complete_one(self.info.base_url, prompt, index, self.request, max_tokens=1)
            return
        except RequestError as e:
            if e.status not in (400, 422):
                raise
            refusal = str(e)
        as_text = replace(self.request, prompt_text=True)
        complete_one(self.info.base_url, prompt, index, as_text, max_tokens=1)
        self.request, self.info = as_text, replace(self.info, prompt_format="text")
        self.warn(
            f"warning: the server refused a token-id prompt ({refusal}); sending the rendered prompt "
            "text, which the server tokenizes itself"
        )

    def measure(self, method: Method, groups: Groups) -> list[Point]:
        if not self.info.vllm and not self.format_checked:  # vLLM takes token ids; others may not
            self.format_checked = True
            try:
                self._prompt_format(groups)
            except RequestError as e:
                raise SpecctlError(redact_text(f"{self.info.base_url}: {e}")) from None
        k = self.info.num_speculative_tokens
        measured = replace(method, num_speculative_tokens=k)
        try:
            url, vllm = self.info.base_url, self.info.vllm
            by_load = measure_loads(url, self.request, groups, self.loads, k, self.on_done, vllm, self.passes)
        except RequestError as e:
            raise SpecctlError(redact_text(f"{self.info.base_url}: {e}")) from None
        except (httpx.HTTPError, OSError) as e:
            url = self.info.base_url
            raise SpecctlError(redact_text(f"{url} stopped answering ({first_line(e)})")) from None
        return [Point(c, MethodResult(measured, m), rate) for (c, rate), m in by_load.items()]


def open_remote(o: Opening) -> RemoteBackend:
    """Nothing starts: the server is asked what it serves (`probe_server`)."""
    s = o.settings
    return RemoteBackend(s.base_url, o.section, s, o.levels, o.on_done, o.warn, s.request_rate)


SPEC = BackendSpec(
    name="remote",
    title="the server at --base-url",
    open=open_remote,
    interleave=False,  # one configuration: the server's
    counts_passes=True,  # measure_loads calls on_done for each prompt of each pass
    latency="streamed requests",
    base_url=True,
    levels=True,
    request_rates=True,
    why_no_engine_rounds="starts no engine",
    adaptive="server",
    as_it_runs=True,
)
