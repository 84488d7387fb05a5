"""Developer tooling, not shipped with the package: `make bench-perf` (perf), `make gpu-check`
(gpu_check) and `make results` (results). Run from the repository root: `python -m benchmarks.perf`."""
