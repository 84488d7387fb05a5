"""An OpenAI-compatible vLLM server specctl starts: launched on 127.0.0.1 in its own process group
(vLLM spawns EngineCore and Worker children; specctl.procs), `/health` polled until ready, the
whole group stopped afterwards, on error and on Ctrl-C too. The server's log stays where the
caller put it; its tail is part of every failure message. What is sent to it is the caller's
(specctl.bench.server measures; its command line comes from specctl.vllm.args.server_argv).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from specctl.procs import HOST, log_tail, port_holder, port_in_use, process_group
from specctl.vllm import VllmError


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    name: str

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def failure(self, reason: str) -> VllmError:
        return VllmError(f"{reason}; log {self.log_path}, last lines:\n{log_tail(self.log_path)}")


def wait_ready(server: Server, timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll /health until it answers 200; fail at once if the process exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        code = server.proc.poll()
        if code is not None:
            raise server.failure(f"vLLM server for {server.name} exited with code {code} before it was ready")
        try:
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return
        except (httpx.HTTPError, OSError):
            pass
        if time.monotonic() > deadline:
            raise server.failure(f"vLLM server for {server.name} not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)


@contextmanager
def serve(
    command: Sequence[str],
    port: int,
    log_path: Path,
    name: str,
    env: dict[str, str] | None,
    ready_timeout_s: float,
) -> Iterator[Server]:
    """Start a server, wait until /health is ready, yield it, stop its process group afterwards."""
    if port_in_use(port):
        raise port_taken(port)
    with process_group(command, log_path, env) as proc:
        server = Server(proc, port, log_path, name)
        wait_ready(server, ready_timeout_s)
        yield server


def port_taken(port: int) -> VllmError:
    """One line naming the port and, where it can be found, the process listening on it."""
    holder = port_holder(port)
    by = f" by {holder}" if holder else ""
    return VllmError(f"port {port} on {HOST} is already in use{by}; stop it or pick another port")


def requested_port(extra_args: Sequence[str]) -> int | None:
    """The --port the user's vLLM arguments set (they come last on the command line: vLLM takes it)."""
    port = None
    for i, arg in enumerate(extra_args):
        if arg == "--port" and i + 1 < len(extra_args):
            port = extra_args[i + 1]
        elif arg.startswith("--port="):
            port = arg.removeprefix("--port=")
    return int(port) if port is not None and port.isdigit() else None
