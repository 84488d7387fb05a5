"""Secrets stay where they belong: no credential is written, and the API key is not sent in clear.

Users give specctl server URLs (`data.server_url`, `bench.base_url`, `--base-url`) that may carry
credentials (`https://user:key@host`, `...?api_key=...`). The recipe object keeps them -- requests
need them -- but every file specctl writes (report.json, report.md, data/manifest.json, the
generation journal, checkpoints' recipe.yaml, tracker hyperparameters) and every error line goes
through `redact_url` / `redact_text` / `redact_tree` first, so a shared run directory or a job log
holds no secret.

The API key (OPENAI_API_KEY) and URL credentials are sent only to a loopback host or over https
(`check_key_destination`), unless the recipe opts in with `allow_key_over_http`: on plain http to
another host anyone on the path reads them.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from specctl.errors import UsageError

MASK = "***"
# query parameter names whose values are credentials (compared lower-case, `-` read as `_`)
SECRET_PARAM = re.compile(r"(token|key|secret|password|passwd|pwd|auth|signature|sig|credential)", re.I)
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]+")
KEY_ENV = "OPENAI_API_KEY"


def _secret_param(name: str) -> bool:
    return bool(SECRET_PARAM.search(name.replace("-", "_")))


def redact_url(url: str) -> str:
    """`url` without credentials: `user:password@` (or a bare `token@`) becomes `***@` and the
    value of each query parameter named like a credential (token, key, api_key, password, ...)
    becomes `***`. Anything else -- scheme, host, port, path, other parameters -- is kept, so the
    written URL still says which server was used. Text that is not a URL comes back unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ in the host: not a URL we can read, mask its userinfo by hand
        return re.sub(r"//[^/@]*@", f"//{MASK}@", url)
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{MASK}@{netloc.rsplit('@', 1)[1]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_param(k) for k, _ in pairs):
            query = urlencode([(k, MASK if _secret_param(k) else v) for k, v in pairs], safe="*")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # byte-identical when there is nothing to hide
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Every URL inside free text (an error line, a log line, a YAML or JSON document) redacted."""
    if "://" not in text:
        return text
    return URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def redact_tree(value: Any) -> Any:
    """A JSON-like tree (dicts, lists, scalars) with every string passed through `redact_text`:
    what a recipe's or a report's model_dump becomes before it is written."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_tree(v) for v in value]
    return value


def has_credentials(url: str) -> bool:
    return redact_url(url) != url


def is_loopback(host: str | None) -> bool:
    """localhost, 127.0.0.0/8 or ::1 (no name is resolved: a refusal must not touch the network)."""
    if not host:
        return False
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_key_destination(url: str, key: str | None, setting: str, allow_over_http: bool) -> None:
    """Refuse (UsageError, before any request) to send `key` or the URL's own credentials over
    plain http to a host that is not loopback, unless `allow_over_http`. `setting` names the
    recipe field or flag that gave the URL, and the opt-in is `<section>.allow_key_over_http`."""
    parts = urlsplit(url)
    if allow_over_http or parts.scheme != "http" or is_loopback(parts.hostname):
        return
    what = f"{KEY_ENV} is set" if key else ("the URL carries credentials" if has_credentials(url) else "")
    if not what:
        return
    section = setting.split(".", 1)[0] if "." in setting else "bench"
    raise UsageError(
        f"{setting} {redact_url(url)}: {what} and would be sent over plain http to a host that is not "
        f"loopback; use https, unset it, or set {section}.allow_key_over_http: true"
    )
