"""A recording stand-in for CuPy: an array module that is NumPy underneath (so every value
is computed, and checked, as on the CPU) but whose arrays are "device arrays", so the
layers take their GPU branches. It counts each operation that would launch work on a GPU,
each new device buffer and each host wait, models device memory (a pool's buffers die
with the pool, ``runtime.malloc`` memory with ``runtime.free``; a launch or GEMM on freed
memory raises :class:`FreedMemoryError`) and replays recorded launches as CUDA graphs do.
``python -m ringnet.bench budget`` counts a training step with it; the tests of the GPU
path (CUDA graphs, the NCCL stand-in) run on it. It checks the library, as
``numpy.testing`` checks NumPy: no training job runs it.
"""
import collections
import contextlib
import sys
import types
import weakref

import numpy as np

from ringnet.layers import activation, conv, cuda_kernels, linear, loss, pool
from ringnet.testing import cuda_emulation
from ringnet import models, optim

__all__ = ["DeviceArray", "Recorder", "CaptureError", "FreedMemoryError", "DeviceMemory",
           "MemoryPool", "LAUNCHES", "recording"]

LAUNCHES = ("kernel", "ufunc", "reduction", "gemm", "copy")
_ACTIVE = []                   # the recorder counting now (innermost last)


def _plain(value):
    """``value`` with device arrays as plain NumPy views (one level into tuples and lists)."""
    if isinstance(value, DeviceArray):
        return value.view(np.ndarray)
    if isinstance(value, (tuple, list)):
        return type(value)(_plain(v) for v in value)
    return value


def _device(value):
    if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray):
        return value.view(DeviceArray)
    return value


def _record(kind, name, alloc=0, again=None, operands=(), result=None):
    """Count one operation on the recorder in use. ``again``: re-runs it on the same memory
    (what a CUDA graph's replay does); ``operands``: what it reads and writes (the
    capture-safety signature); ``result``: the buffer it made (``alloc``)."""
    if _ACTIVE:
        _ACTIVE[-1].record(kind, name, alloc, again, operands, result)


def _into(target, compute):
    """An ``again`` that recomputes a result and writes it where the first run put it."""
    def again():
        np.copyto(target, compute())
    return again


def _shares(result, inputs):
    return any(isinstance(a, np.ndarray) and np.may_share_memory(result, a) for a in inputs)


class CaptureError(RuntimeError):
    """Work that a CUDA graph cannot capture ran while the stand-in was capturing."""


class FreedMemoryError(RuntimeError):
    """Device memory was used after it went back to CUDA (its pool gone, or freed)."""


class DeviceMemory:
    """Who owns the stand-in's device memory, and when it goes back to CUDA.

    As in CuPy, a buffer made under ``cuda.using_allocator(pool.malloc)`` belongs to that
    :class:`MemoryPool` and holds it only weakly: when the pool is collected, every buffer
    it gave out is freed, whoever still holds the array. ``cuda.runtime.malloc`` memory is
    freed by ``cuda.runtime.free`` only. Freed bytes read as poison (0xFF: NaN), and any
    launch, GEMM or :meth:`check` that touches them raises :class:`FreedMemoryError`.
    """

    def __init__(self):
        self.allocators = []      # the using_allocator stack: the pool of each, or None
        self.freed = []           # (lo, hi, why, ref to the array still holding the bytes)
        self.raw = {}             # runtime.malloc pointer -> its array

    # -- allocation
    def made(self, array):
        """Note a new buffer: it belongs to the pool of the allocator in use, if any, and,
        where the NCCL stand-in is in use, to the device current on this thread."""
        pool = self.allocators[-1] if self.allocators else None
        if pool is not None:
            pool._blocks.append(weakref.ref(array))
        devices = sys.modules.get("ringnet.testing.nccl_standin.devices")
        if devices is not None:
            from ringnet.testing.nccl_standin import memory
            memory.note_made(array, devices.current_device())

    def release(self, arrays, why):
        """Give ``arrays``' memory back to CUDA: poison it, and refuse every later use."""
        for array in arrays:
            lo = array.__array_interface__["data"][0]
            if array.flags.writeable and array.flags.c_contiguous:
                array.reshape(-1).view(np.uint8)[...] = 0xFF
            self.freed.append((lo, lo + max(array.nbytes, 1), why, weakref.ref(array)))

    # -- use
    def check(self, ptr, nbytes=1, what="an operation"):
        """Raise :class:`FreedMemoryError` when [ptr, ptr + nbytes) lies in freed memory
        (while the freed bytes are still held: otherwise NumPy may have reused the address)."""
        if not self.freed:
            return
        live = []
        for entry in self.freed:
            lo, hi, why, ref = entry
            if ref() is None:
                continue
            live.append(entry)
            if lo < ptr + max(nbytes, 1) and ptr < hi:
                self.freed = live + [e for e in self.freed[len(live):] if e[3]() is not None]
                raise FreedMemoryError(f"{what} uses device memory at {ptr:#x} that {why}: "
                                       f"on a GPU it may hold anything by now")
        self.freed = live

    def check_operands(self, operands, what):
        for operand in operands:
            if isinstance(operand, np.ndarray):
                self.check(operand.__array_interface__["data"][0], operand.nbytes, what)
            elif isinstance(operand, (tuple, list)):
                self.check_operands(operand, what)


class MemoryPool:
    """``cupy.cuda.MemoryPool`` on the stand-in: what it gives out dies with it."""

    def __init__(self, memory):
        self._memory = memory
        self._blocks = []                          # weak references to its buffers
        weakref.finalize(self, MemoryPool._gone, memory, self._blocks)

    @staticmethod
    def _gone(memory, blocks):
        memory.release([a for a in (ref() for ref in blocks) if a is not None],
                       "belonged to a memory pool that was collected")

    def malloc(self, nbytes):
        """A block of ``nbytes`` from this pool (``.ptr``), as CuPy's ``MemoryPointer``."""
        block = np.empty(max(int(nbytes), 1), np.uint8)
        self._blocks.append(weakref.ref(block))
        return _Pointer(block)

    def used_blocks(self):
        """How many of its buffers are still held."""
        return sum(ref() is not None for ref in self._blocks)

    def free_all_blocks(self):
        """Return the blocks nobody holds to CUDA (the held ones stay, as in CuPy)."""
        self._blocks[:] = [ref for ref in self._blocks if ref() is not None]

    def total_bytes(self):
        return sum(a.nbytes for a in (ref() for ref in self._blocks) if a is not None)


class _Pointer:
    """A ``MemoryPointer``: ``.ptr``; the block lives while the pointer does."""

    def __init__(self, block):
        self.mem, self.ptr = block, block.__array_interface__["data"][0]


def _cuda_standin(recorder):
    """The part of ``cupy.cuda`` the graph step and the cuBLAS handle use, on the stand-in."""
    memory = recorder.memory

    @contextlib.contextmanager
    def using_allocator(allocator=None):
        pool = getattr(allocator, "__self__", None)
        memory.allocators.append(pool if isinstance(pool, MemoryPool) else None)
        try:
            yield
        finally:
            memory.allocators.pop()

    def alloc(nbytes):                            # the current allocator's block
        pool = memory.allocators[-1] if memory.allocators else None
        if pool is not None:
            return pool.malloc(nbytes)
        return _Pointer(np.empty(max(int(nbytes), 1), np.uint8))

    def malloc(nbytes):
        block = np.empty(max(int(nbytes), 1), np.uint8)
        ptr = block.__array_interface__["data"][0]
        memory.raw[ptr] = block
        return ptr

    def free(ptr):
        block = memory.raw.pop(int(ptr), None)
        if block is None:
            raise FreedMemoryError(f"runtime.free({int(ptr):#x}): not a runtime.malloc pointer "
                                   "still allocated")
        memory.release([block], "was freed with runtime.free")
        memory.graveyard.append(block)            # keep the address from being reused

    stream = types.SimpleNamespace(ptr=0)
    runtime = types.SimpleNamespace(malloc=malloc, free=free, getDevice=lambda: 0,
                                    deviceSynchronize=lambda: None,
                                    runtimeGetVersion=lambda: 12040)
    memory.graveyard = []
    return types.SimpleNamespace(
        MemoryPool=lambda: MemoryPool(memory), using_allocator=using_allocator,
        memory=types.SimpleNamespace(alloc=alloc), runtime=runtime,
        get_current_stream=lambda: stream)


class DeviceArray(np.ndarray):
    """A NumPy array that stands for a CuPy array: what a GPU would launch on it is recorded."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if out is not None:
            kwargs["out"] = _plain(out)
        plain = _plain(inputs)
        result = getattr(ufunc, method)(*plain, **kwargs)
        kind = "gemm" if ufunc is np.matmul else "ufunc" if method == "__call__" else \
            "copy" if method == "at" else "reduction"
        if out is not None:
            def again():
                getattr(ufunc, method)(*plain, **kwargs)
        elif isinstance(result, tuple):
            def again():
                for target, value in zip(result, getattr(ufunc, method)(*plain, **kwargs)):
                    np.copyto(target, value)
        else:
            again = _into(result, lambda: getattr(ufunc, method)(*plain, **kwargs))
        _record(kind, f"{ufunc.__name__}" + ("" if method == "__call__" else f".{method}"),
                alloc=0 if out is not None else 1, again=again,
                operands=plain + tuple(kwargs.values()), result=None if out is not None else result)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _device(np.asarray(result)) if not isinstance(result, tuple) else \
            tuple(_device(np.asarray(r)) for r in result)

    # -- operations NumPy runs as methods (the reductions are added below the class)
    def copy(self, order="C"):
        base = self.view(np.ndarray)
        result = base.copy(order)
        _record("copy", "copy", alloc=1, again=_into(result, base.copy), operands=(base,),
                result=result)
        return _device(result)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        base = self.view(np.ndarray)
        result = base.astype(dtype, order, casting)
        _record("copy", "astype", alloc=1, again=_into(result, lambda: base.astype(dtype)),
                operands=(base, np.dtype(dtype)), result=result)
        return _device(result)

    def fill(self, value):
        base = self.view(np.ndarray)
        _record("copy", "fill", again=lambda: base.fill(value), operands=(base, value))
        base.fill(value)

    def _maybe_view(self, name, *args, **kwargs):
        base = self.view(np.ndarray)
        result = getattr(base, name)(*args, **kwargs)
        if not np.may_share_memory(result, base):
            _record("copy", name, alloc=1,
                    again=_into(result, lambda: getattr(base, name)(*args, **kwargs)),
                    operands=(base,) + args, result=result)
        return _device(result)

    def reshape(self, *a, **k):
        return self._maybe_view("reshape", *a, **k)

    def ravel(self, *a, **k):
        return self._maybe_view("ravel", *a, **k)

    def __getitem__(self, key):
        base = self.view(np.ndarray)
        key = _plain(key)
        result = base[key]
        if not isinstance(result, np.ndarray):           # one element: CuPy returns 0-d
            result = np.asarray(result)
            _record("copy", "getitem", alloc=1, again=_into(result, lambda: base[key]),
                    operands=(base, key), result=result)
        elif not np.may_share_memory(result, base):
            _record("copy", "getitem (gather)", alloc=1, again=_into(result, lambda: base[key]),
                    operands=(base, key), result=result)
        return _device(result)

    def __setitem__(self, key, value):
        base, key, value = self.view(np.ndarray), _plain(key), _plain(value)

        def again():
            base[key] = value
        _record("copy", "setitem", again=again, operands=(base, key, value))
        again()

    # -- reads on the host: each one waits for the device
    def _read(self, name):
        _record("host_wait", name)
        return self.view(np.ndarray)

    def __float__(self):
        return float(self._read("float"))

    def __int__(self):
        return int(self._read("int"))

    def __index__(self):
        return self._read("index").__index__()

    def __bool__(self):
        return bool(self._read("bool"))

    def item(self, *args):
        return self._read("item").item(*args)

    def tolist(self):
        return self._read("tolist").tolist()

    def get(self, stream=None):
        """CuPy's device-to-host copy."""
        return self._read("get").copy()


def _reduction(name):
    def reduce(self, *args, out=None, **kwargs):
        base, target = self.view(np.ndarray), _plain(out)
        result = getattr(base, name)(*args, out=target, **kwargs)
        if out is not None:
            def again():
                getattr(base, name)(*args, out=target, **kwargs)
        else:
            result = np.asarray(result)
            again = _into(result, lambda: getattr(base, name)(*args, **kwargs))
        _record("reduction", name, alloc=0 if out is not None else 1, again=again,
                operands=(base, target) + args + tuple(kwargs.values()),
                result=None if out is not None else result)
        return out if out is not None else _device(result)
    reduce.__name__ = name
    return reduce


for _name in ("sum", "max", "min", "mean", "argmax", "argmin", "any", "all"):
    setattr(DeviceArray, _name, _reduction(_name))

_FILLS = {"zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "arange", "eye"}
_EMPTY = {"empty", "empty_like"}
_CONVERT = {"asarray", "array", "ascontiguousarray", "asanyarray"}
_GEMM = {"matmul", "dot", "tensordot"}
_REDUCE = {"sum", "max", "amax", "min", "amin", "mean", "argmax", "argmin", "any", "all"}


class _ElementwiseKernel:
    """CuPy's ElementwiseKernel for plain arithmetic statements (``a = expr; b = expr;``):
    one launch; the statements run in order over whole arrays, as each thread runs them."""

    def __init__(self, in_params, out_params, operation, name, **_):
        self.names = [p.split()[-1] for p in (in_params + ", " + out_params).split(",")]
        self.statements = [s.strip() for s in operation.split(";") if s.strip()]
        self.name = name

    def __call__(self, *args):
        plain = tuple(_plain(a) for a in args)
        self._run(plain)
        _record("kernel", self.name, again=lambda: self._run(plain), operands=plain)

    def _run(self, plain):
        values = dict(zip(self.names, plain))
        dtype = next(v.dtype for v in values.values() if isinstance(v, np.ndarray))
        space = {k: v if isinstance(v, np.ndarray) else dtype.type(v) for k, v in values.items()}
        for statement in self.statements:
            target, expr = (s.strip() for s in statement.split("=", 1))
            space[target][...] = eval(expr, {}, space)        # noqa: S307 - our own kernel text


class Recorder:
    """The stand-in array module: NumPy's names; arrays it makes are :class:`DeviceArray`."""

    ndarray = DeviceArray
    ElementwiseKernel = _ElementwiseKernel
    launch_kinds = LAUNCHES

    def __init__(self):
        self.events = []       # (kind, name, allocations, where)
        self.where = "setup"
        self.captured = None   # while capturing: the again() of each launch, in order
        self.signatures = []   # (kind, name, operands described) of each event
        self._fresh = []       # (first byte, end byte) of each buffer made since begin_step
        self.memory = DeviceMemory()
        self.cuda = _cuda_standin(self)

    def record(self, kind, name, alloc=0, again=None, operands=(), result=None):
        self.memory.check_operands(operands, f"{name} in {self.where}")
        if alloc and isinstance(result, np.ndarray):
            self.memory.made(result)
        self.events.append((kind, name, alloc, self.where))
        if self.captured is not None:
            if kind in ("host_wait", "transfer"):
                raise CaptureError(f"{name} in {self.where}: a {kind.replace('_', ' ')} inside "
                                   f"captured work (a CUDA graph can hold neither)")
            if kind in LAUNCHES:
                if again is None:
                    raise CaptureError(f"{name} in {self.where}: not replayable")
                self.captured.append(again)
        self.signatures.append((kind, name, tuple(self.describe(o) for o in operands)))
        if alloc and isinstance(result, np.ndarray):
            lo = result.__array_interface__["data"][0]
            self._fresh.append((lo, lo + max(result.nbytes, 1)))

    # -- what a CUDA graph would see: capture, replay, the per-step signature
    def begin_step(self):
        """Forget the signatures and the buffers made so far: what follows is one step."""
        self.signatures, self._fresh = [], []

    def describe(self, operand):
        """An operand as a graph would hold it: an array by its memory (a buffer made in this
        step by its order of making, any other by its address) with shape, strides and dtype;
        a number by its value; anything else by its text."""
        if isinstance(operand, np.ndarray):
            ptr = operand.__array_interface__["data"][0]
            where = ("held", ptr)
            for k in range(len(self._fresh) - 1, -1, -1):
                lo, hi = self._fresh[k]
                if lo <= ptr < hi or (ptr == lo and not operand.nbytes):
                    where = ("made", k, ptr - lo)
                    break
            return ("array",) + where + (operand.shape, operand.strides, operand.dtype.str)
        if isinstance(operand, (tuple, list)):
            return tuple(self.describe(o) for o in operand)
        if isinstance(operand, (bool, int, float, complex, np.generic)):
            return ("value", type(operand).__name__, repr(operand))
        return ("other", repr(operand))

    @contextlib.contextmanager
    def capturing(self):
        """Collect every launch instead of only running it: yields the list, a "graph" that
        :meth:`replay` runs again on the same memory. A host wait or a transfer inside
        raises :class:`CaptureError`, as it would inside a CUDA stream capture."""
        self.captured = graph = []
        try:
            yield graph
        finally:
            self.captured = None

    def replay(self, graph):
        """Run a captured graph: every launch again, with the arguments it had, in order."""
        for again in graph:
            again()

    def gemm_call(self, steps, c):
        """One GEMM of :mod:`ringnet.layers.gemm`'s plan ``steps`` into ``c``, emulated on NumPy
        memory (:func:`ringnet.testing.cuda_emulation.gemm`)."""
        transa, transb, m, n, k, first, lda, second, ldb, ldc = steps
        plain = tuple(_plain(a) for a in (transa, transb, m, n, k, first, lda, second, ldb, c, ldc))
        fn = cuda_emulation.gemm
        fn(*plain)
        _record("gemm", "cublas gemm", again=lambda: fn(*plain), operands=plain)

    def asnumpy(self, a):
        if isinstance(a, DeviceArray):
            return a._read("asnumpy").copy()
        return np.asarray(a)

    def __getattr__(self, name):
        obj = getattr(np, name)
        if isinstance(obj, (np.ufunc, type)) or not callable(obj):
            return obj                # ufuncs dispatch to DeviceArray; dtypes; submodules
        return self._wrapped(name, obj)

    def _wrapped(self, name, fn):
        def call(*args, **kwargs):
            inputs = list(args) + list(kwargs.values())
            device_in = [a for a in inputs if isinstance(a, DeviceArray)]
            pargs, pkwargs = _plain(args), {k: _plain(v) for k, v in kwargs.items()}
            result = fn(*pargs, **pkwargs)
            operands = tuple(pargs) + tuple(pkwargs.values())

            def again():
                fn(*pargs, **pkwargs)
            if name == "copyto":
                _record("copy" if isinstance(args[1], DeviceArray) or np.isscalar(args[1])
                        else "transfer", name, again=again, operands=operands)
            elif name in _EMPTY:
                _record("alloc", name, alloc=1, result=result)
            elif name in _FILLS:
                _record("copy", name, alloc=1, again=_into(result, lambda: fn(*pargs, **pkwargs)),
                        operands=operands, result=result)
            elif name in _CONVERT and not device_in:
                _record("transfer", name, alloc=1, result=result)
            elif kwargs.get("out") is not None:
                _record("gemm" if name in _GEMM else "reduction" if name in _REDUCE else "copy",
                        name, again=again, operands=operands)
            elif isinstance(result, np.ndarray):
                if not _shares(result, [a.view(np.ndarray) for a in device_in]):
                    _record("gemm" if name in _GEMM else "reduction" if name in _REDUCE
                            else "copy", name, alloc=1,
                            again=_into(result, lambda: fn(*pargs, **pkwargs)),
                            operands=operands, result=result)
            elif result is None:
                _record("copy", name, again=again, operands=operands)
            if kwargs.get("out") is not None:
                return kwargs["out"]
            return _device(result) if isinstance(result, np.ndarray) else result
        return call

    # -- totals
    def totals(self, events=None):
        events = self.events if events is None else events
        kinds = collections.Counter(kind for kind, *_ in events)
        out = {"launches": sum(kinds[k] for k in LAUNCHES),
               "allocations": sum(a for _, _, a, _ in events),
               "host_waits": kinds["host_wait"], "transfers": kinds["transfer"]}
        out.update({k: kinds[k] for k in LAUNCHES})
        return out


@contextlib.contextmanager
def recording(recorder):
    """Route the layers, the model and the optimizer through ``recorder`` (their GPU
    branches, on NumPy); everything is put back at the end."""
    def get_array_module(*arrays):
        return recorder if any(isinstance(a, DeviceArray) for a in arrays) else np

    def is_gpu_array(a):
        return isinstance(a, DeviceArray)

    raw_launch = cuda_kernels.launch

    def launch(xp, name, dtype, n, args):
        plain = _plain(tuple(args))
        raw_launch(np, name, dtype, n, plain)
        _record("kernel", name, again=lambda: raw_launch(np, name, dtype, n, plain),
                operands=(n,) + plain)

    patches = [(cuda_kernels, "launch", launch), (optim, "_FUSED", {})]
    for module in (activation, conv, linear, loss, pool, models, optim):
        for attr, value in (("get_array_module", get_array_module),
                            ("is_gpu_array", is_gpu_array), ("to_numpy", recorder.asnumpy)):
            if hasattr(module, attr):
                patches.append((module, attr, value))
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    for module, attr, value in patches:
        setattr(module, attr, value)
    _ACTIVE.append(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.remove(recorder)
        for module, attr, value in saved:
            setattr(module, attr, value)


