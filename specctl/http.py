"""Plain HTTP reads of a server's pages (/metrics, /v1/models, /version): for the servers specctl
starts (specctl.vllm.server) and the ones someone else runs (specctl.bench.remote) alike."""

from __future__ import annotations


def get_text(url: str, timeout_s: float = 30.0, api_key: str | None = None) -> str:
    """GET a page: its text, or httpx's error (an HTTP error status too)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    r = httpx.get(url, timeout=timeout_s, headers=headers)
    r.raise_for_status()
    return r.text
