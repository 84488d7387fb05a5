"""`specctl bench`: compare drafters against plain decoding and the EAGLE-3 baseline.

Four parts: plan.py decides what to measure (pure functions), backends.py registers the backends
(embedded.py, server.py, offline.py, remote.py for `--base-url`, each exporting its `BackendSpec`
(spec.py) as `SPEC`; vllm.py is what the vLLM ones share on the bench's side, specctl.vllm what
talks to vLLM; client.py the streamed requests every server-backed one sends) and opens one, with
one `measure(method, prompts)` interface, report.py is the model of the figures, render.py shows
them (rich, markdown, PNG). run.py puts them together, settings.py checks the run's settings
against its backend's spec; prompts.py builds the prompt sets.
Submodules are imported on use: `from specctl.bench.run import run_bench`.
"""
