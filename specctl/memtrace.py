"""Peak memory and FLOPs of a computation at real shapes, without the memory or the compute.

`specctl plan` has to say before a 3-day job whether a training step of a 5-layer DFlash drafter
over 32k tokens with a 128k vocabulary fits an 80 GB GPU. A table of per-algorithm guesses goes
stale with every change to a drafter; running the step needs the GPU it is asking about. So the
step runs for real on this machine's CPU, with every *heavy* tensor a fake one (PyTorch's
FakeTensorMode: shape, dtype and strides, no data), while the small integer/bool tensors that steer
it (token ids, loss masks, sampled anchors, gather indices) stay real. Data-dependent code then works
as in training (`mask.nonzero()` sees a real mask), and every heavy allocation is counted exactly,
views and in-place ops included, freed when its storage dies -- the live-bytes curve of the real step.

Rules that make the mix work (each one a place where a fake tensor meets real control flow):
- an op with a fake input runs in fake mode; its real inputs join as fakes of themselves (integer
  indices keep their shapes, which is all the output shape depends on), except real *bool* indices,
  which become their real `nonzero()` positions first (the output shape depends on their values);
- a factory op (no tensor input) larger than `FAKE_FACTORY_ELEMENTS` is made fake: a [rows, V]
  buffer filled with -inf is heavy, an `arange` over a batch's rows steers;
- a real tensor an op writes fake values into (`kept[rows, cols] = fake_logits`) is fake from then
  on (its fake twin stands in for it in every later op), its bytes counted once, as the real one;
- reading a value out of a fake tensor (`.item()`, `bool(t.all())`) gives 1 / True: the traced code
  takes its common branch (no NaN rows, every row valid). The figure is that branch's.

What this does not see: allocator fragmentation and caching (the CUDA caching allocator, glibc's
heap), CUDA context and NCCL buffers, and kernels that differ between the CPU the trace runs on and
the device the plan is for (resources.py adds those as named terms, and `make rehearse` checks the
traced figures against measured peaks). FLOPs come from torch.utils.flop_counter's formulas for the
ops it knows (matmuls, convolutions, SDPA on CUDA); ops it does not know count zero.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

FAKE_FACTORY_ELEMENTS = 1 << 22  # factory ops above this many elements make fake tensors

aten = torch.ops.aten
_INDEX_OPS = (
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
)


@dataclass(frozen=True)
class TracePoint:
    """Live bytes at one moment of a trace, and the largest they reached since the last mark."""

    live: int
    peak: int
    flops: int


class MemoryTrace(TorchDispatchMode):
    """Count the bytes of every tensor storage alive while code runs under this mode.

    with MemoryTrace() as t:
        with t.heavy():              # every tensor made here is fake: modules, inputs
            model = build(...)
            x = torch.randn(16, 2048, 4096)
        t.mark()                     # the peak from here on
        model(x).sum().backward()
    t.peak, t.live                   # bytes (tensors made before `with` are not counted)
    """

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.live = 0
        self.peak = 0
        self.flops = 0
        self._sizes: dict[int, int] = {}  # storage id -> bytes, for the storages alive now
        self._all_fake = False
        self._poisoned: set[int] = set()  # real storages an op wrote fake values into

    @contextlib.contextmanager
    def heavy(self) -> Iterator[None]:
        """Every floating-point factory op in this block makes a fake tensor, whatever its size
        (weights, features); integer and bool ones stay real below FAKE_FACTORY_ELEMENTS (a draft
        vocabulary's `arange` steers what is checked and gathered)."""
        self._all_fake, before = True, self._all_fake
        try:
            yield
        finally:
            self._all_fake = before

    def mark(self) -> TracePoint:
        """The figures so far; the peak restarts from what is live now."""
        point = TracePoint(self.live, self.peak, self.flops)
        self.peak = self.live
        return point

    def _track(self, t: object) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" and not isinstance(t, FakeTensor):
            return
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(a, FakeTensor) or self._poisoned_real(a) for a in flat):
            if func is aten._local_scalar_dense.default:  # .item() of a fake: the common branch
                return True if args[0].dtype == torch.bool else 1
            if func in _INDEX_OPS:
                args = (args[0], _bool_indices_as_positions(args[1]), *args[2:])
            written = [a for a in _written_args(func, args) if not isinstance(a, FakeTensor)]
            args, kwargs = tree_map(self._as_fake, (args, kwargs))
            with self.fake:
                out = func(*args, **kwargs)
            if written:  # a real tensor written with fake values: fake from now on, its bytes counted
                for a in written:
                    self._poison(a.untyped_storage())
                return out
        elif not any(isinstance(a, torch.Tensor) for a in flat) and (self._all_fake or _large_factory(args)):
            with self.fake:
                out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not out.is_floating_point() and not _large_factory(args):
                out = func(*args, **kwargs)  # heavy() fakes values (floats); ids and masks steer
        else:
            out = func(*args, **kwargs)
        self.flops += op_flops(func, args, kwargs, out)
        tree_map(self._track, out)
        return out

    def _poison(self, storage: Any) -> None:
        """Mark a real storage fake-valued until it dies (its address may then be reused)."""
        key = storage._cdata
        if key not in self._poisoned:
            self._poisoned.add(key)
            weakref.finalize(storage, self._poisoned.discard, key)

    def _poisoned_real(self, a: object) -> bool:
        return (
            isinstance(a, torch.Tensor)
            and not isinstance(a, FakeTensor)
            and a.untyped_storage()._cdata in self._poisoned
        )

    def _as_fake(self, a: object) -> object:
        if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor):
            return self.fake.from_tensor(a)
        return a


def _written_args(func, args: tuple) -> list:
    """The positional tensor arguments `func` writes in place (self of add_, index_put_, ...)."""
    schema = func._schema.arguments
    return [
        a
        for a, spec in zip(args, schema, strict=False)
        if isinstance(a, torch.Tensor) and spec.alias_info is not None and spec.alias_info.is_write
    ]


def op_flops(func, args: tuple, kwargs: dict, out: object) -> int:
    """FLOPs of one op: torch.utils.flop_counter's formula, or for the composite ops it leaves out
    (they reach a dispatch mode whole when autograd is off, as in the collect forward) the same
    count by hand: linear / matmul 2*M*N*K, scaled_dot_product_attention 4*B*h*Lq*Lk*d."""
    count = flop_registry.get(func.overloadpacket)
    if count is not None:
        return int(count(*args, **kwargs, out_val=out))
    if func.overloadpacket in (aten.linear, aten.matmul) and isinstance(out, torch.Tensor):
        return 2 * out.numel() * args[0].shape[-1]
    if func.overloadpacket is aten.scaled_dot_product_attention:
        q, k = args[0], args[1]
        return 4 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return 0


def _bool_indices_as_positions(indices: list) -> list:
    """aten.index's index list with each real bool mask replaced by its real nonzero() positions
    (one index tensor per mask dimension): the same selection, with a shape fake mode can follow."""
    out: list = []
    for index in indices:
        real = isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor)
        if real and index.dtype == torch.bool:
            out.extend(index.nonzero(as_tuple=True))
        else:
            out.append(index)
    return out


def _large_factory(args: tuple) -> bool:
    """Whether a factory op's size argument asks for more than FAKE_FACTORY_ELEMENTS elements."""
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, int) for x in a):
            return math.prod(a) > FAKE_FACTORY_ELEMENTS
        if isinstance(a, int) and not isinstance(a, bool) and a > FAKE_FACTORY_ELEMENTS:
            return True
    return False
