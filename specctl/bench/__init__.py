"""`specctl bench`: compare drafters against plain decoding and the EAGLE-3 baseline.

run.py orchestrates a comparison, vllm.py runs vLLM (server lifecycle + /metrics),
prompts.py builds the prompt sets, report.py holds the figures and writes the report.
Submodules are imported on use: `from specctl.bench.run import run_bench`.
"""
