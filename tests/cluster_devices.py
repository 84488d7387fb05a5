"""The simulated GPU on this CPU-only build, part of the simulated cluster: which tensors of a step
would live on the rank's GPU, what mixes them with host tensors, and what makes the host wait.

FakeTensorMode makes `cuda:N` tensors here but cannot run the step: on this build a cuda tensor
cannot be indexed (`x[:, 1:]` needs a CUDA device guard, which a CPU-only torch never registers:
"PyTorch is not linked with support for cuda devices"), and fake tensors have no values for the
step's data-dependent control flow. So the step runs on real CPU tensors and `OnGPU`, a torch
function mode, keeps the CUDA path's bookkeeping beside it:

- on the GPU: the batch and the parameters as the loop moved them, whatever a factory makes with
  an explicit `device=` (the loop's `ctx.device`, or another tensor's device), and every result of
  an op on GPU tensors;
- mixing: an op that takes a GPU tensor and a host tensor (other than a 0-dim scalar) raises
  `DeviceMismatch`, as CUDA would (a mask built without `device=` would fail on the first GPU run);
- host synchronisations, counted with the line of specctl code that asked: reading a GPU value
  (`.item()`, `int()`, `bool()`, `float()`, `.tolist()`), copying it to the host (`.cpu()`,
  `.to("cpu")`, `.numpy()`), and ops whose output size depends on GPU values (`nonzero`, boolean
  indexing, `masked_select`, `unique`, `repeat_interleave` without `output_size`).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.numpy, T.cpu}
SIZED_BY_VALUES = {torch.nonzero, T.nonzero, torch.masked_select, T.masked_select, torch.unique, T.unique}
SIZED_BY_VALUES |= {torch.argwhere, T.argwhere, torch.unique_consecutive, T.unique_consecutive}
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor}
FACTORIES |= {torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye, torch.linspace}
FACTORIES |= {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like}
FACTORIES |= {torch.randn_like, torch.randint_like}
# ops CUDA runs with a host tensor beside a device one: an index copied to the device, a copy
MIXING_ALLOWED = {T.__getitem__, T.__setitem__, T.copy_, T.to, T.index_select, torch.index_select}


class DeviceMismatch(RuntimeError):
    """What CUDA raises where the CPU run goes on: a host tensor in a GPU op."""


def on_gpu(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_simulated_gpu", False)


def put_on_gpu(t: torch.Tensor) -> torch.Tensor:
    """Mark `t` (a parameter, a batch tensor) as living on the rank's GPU; returns it."""
    t._simulated_gpu = True
    return t


def _caller_is(path: str) -> bool:
    """Whether the op was called from a file whose path holds `path` (the frame below the mode)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename == __file__ or "/torch/overrides.py" in frame.filename:
            continue
        return path in frame.filename
    return False


def _called_from_specctl() -> bool:
    """Whether the op was called by specctl's code itself. torch's own helpers move tensors to a
    device they read from C++ (clip_grad's grouping by device), which this CPU run reports as the
    CPU: such a `.to()` stays on the GPU on the CUDA path, so it is no copy to the host."""
    return _caller_is("/specctl/")


def specctl_line() -> str:
    """The innermost frame of specctl's own code: who asked for it."""
    for frame in reversed(traceback.extract_stack()):
        if "/specctl/" in frame.filename:
            return f"{frame.filename.split('/specctl/')[-1]}:{frame.lineno} {frame.line}"
    return "outside specctl"


class OnGPU(TorchFunctionMode):
    """The rank's GPU is cuda:`local_rank`: a device argument naming it runs on the CPU and marks
    what it makes; another GPU's raises. A GPU tensor's `.device` reads cuda:`local_rank`, so code
    that makes tensors "where x is" makes them there. Counts host synchronisations in
    `syncs[(what, where)]`; raises DeviceMismatch on mixing."""

    def __init__(self, local_rank: int) -> None:
        super().__init__()
        self.device = torch.device("cuda", local_rank)
        self.syncs: Counter = Counter()
        self.uploads: Counter = Counter()  # host -> GPU copies: [where] (pageable ones block the host)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.device, torch._C._nn._parse_to):  # naming a device is not using it
            return func(*args, **kwargs)
        if func in (T.device.__get__, T.is_cuda.__get__) and on_gpu(args[0]):
            return self.device if func == T.device.__get__ else True
        if func == T.grad.__get__:  # autograd made it, unseen: it lives where its parameter does
            grad = func(*args)
            return put_on_gpu(grad) if grad is not None and on_gpu(args[0]) else grad
        asked = [a for a in tree_flatten((args, kwargs))[0] if _is_device(a)]
        to_gpu = any(self._gpu(a) for a in asked)  # raises for another rank's GPU
        args, kwargs = tree_map(_as_cpu, (args, kwargs))
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        gpu = any(on_gpu(t) for t in tensors)
        to_host = gpu and (
            func == T.cpu or (func == T.to and asked and not to_gpu and _called_from_specctl())
        )
        if to_gpu and func == T.to and not on_gpu(args[0]):
            self.uploads[specctl_line()] += 1
        if gpu and (func in READS or func in SIZED_BY_VALUES or to_host or _data_sized(func, args, kwargs)):
            self.syncs[(getattr(func, "__name__", str(func)), specctl_line())] += 1
        if gpu and func not in MIXING_ALLOWED and func not in FACTORIES:
            _check_mixing(func, tensors)
        out = func(*args, **kwargs)
        # the CPU run's move returned self: a new tensor for the other side (an alias: gradients
        # flow), but for module.to(), which moves the module's own parameters and buffers
        if (to_host or (to_gpu and not _caller_is("/torch/nn/modules/module.py"))) and any(
            out is t for t in tensors
        ):
            out = out.view_as(out)
        if to_host or func in READS:
            return out
        if to_gpu or (gpu and not (asked and func in FACTORIES)) or _like_on_gpu(func, args):
            tree_map(lambda t: put_on_gpu(t) if isinstance(t, torch.Tensor) else t, out)
        return out

    def _gpu(self, device) -> bool:
        """Whether a device argument names a GPU; one not this rank's raises."""
        device = torch.device(device)
        if device.type != "cuda":
            return False
        if device.index not in (None, self.device.index):
            raise DeviceMismatch(f"{specctl_line()}: {device} asked for on the rank of {self.device}")
        return True


def _is_device(a) -> bool:
    return isinstance(a, torch.device) or (isinstance(a, str) and a.split(":")[0] in ("cuda", "cpu"))


def _as_cpu(a):
    return torch.device("cpu") if _is_device(a) and torch.device(a).type == "cuda" else a


def _like_on_gpu(func, args) -> bool:
    """A `*_like` factory follows its input."""
    return func in FACTORIES and func.__name__.endswith("_like") and bool(args) and on_gpu(args[0])


def _data_sized(func, args, kwargs) -> bool:
    """x[mask] with a boolean GPU mask, repeat_interleave without output_size, torch.where(cond)."""
    if func in (T.__getitem__,):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in index)
    if func in (torch.repeat_interleave, T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return func == torch.where and len(args) == 1


def _check_mixing(func, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if not on_gpu(t) and t.dim() > 0:
            raise DeviceMismatch(
                f"{specctl_line()}: {getattr(func, '__name__', func)} mixes the GPU with a host tensor "
                f"of shape {tuple(t.shape)}"
            )
