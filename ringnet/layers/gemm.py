"""The GPU path's GEMMs through cuBLAS directly, so that a CUDA graph can capture them.

CuPy's ``matmul`` sets its cuBLAS handle's stream on every call, and CuPy refuses to set
one while the stream is capturing (``NotImplementedError``), so a step that multiplies
with ``matmul`` cannot be captured. Here each device has a cuBLAS handle of its own,
called through ``ctypes`` on the library CuPy loaded: :func:`bind` points it at a stream
(and gives it a workspace of its own, which cuBLAS needs to run inside a graph) before a
capture begins, so no call made while capturing changes the handle.

:func:`plan` maps a row-major product ``C = A @ B`` onto one column-major ``gemm`` without
copying operands that are row-major or transposed views (cuBLAS takes either orientation):
it is a pure function of shapes and strides, checked on the CPU against NumPy through an
emulated column-major GEMM (testing code: :func:`ringnet.testing.cuda_emulation.gemm`, which
the recording CuPy runs for a planned GEMM). :func:`matmul` runs the plan: through cuBLAS
for CuPy arrays inside :func:`routed` (a CUDA-graph step) or after :func:`enable`,
``xp.matmul`` otherwise. The route is scoped: a run with graphs off after one with graphs
on in the same process multiplies with CuPy's ``matmul`` again.

The handle's workspace is raw device memory the handle owns (``cudaMalloc``, freed by
:func:`release` with the handle), never an array of a CuPy memory pool: the first GEMM
runs while a graph step allocates from its private pool, and a pool array holds its pool
only weakly, so the bytes would go back to CUDA when that pool is collected while the
handle still hands the address to cuBLAS.
"""
import contextlib
import ctypes
import importlib
import threading

import numpy as np

__all__ = ["plan", "matmul", "enable", "enabled", "routed", "bind", "release",
           "CublasError"]

WORKSPACE_BYTES = 32 << 20       # per device: what cuBLAS asks for on Hopper, with room
_STATE = {"on": False}
_ROUTED = threading.local()      # depth of routed() blocks on this thread
_LOCK = threading.Lock()
_HANDLES = {}                    # device id -> _Handle


class CublasError(RuntimeError):
    """A cuBLAS call returned an error status."""


def _layout(rows, cols, s0, s1):
    """Return (transposed, ld) such that the matrix X (rows x cols) with element strides
    (s0, s1) is M (transposed False) or M^T (True) for a column-major M of leading
    dimension ld; None when it is neither (a copy is needed)."""
    if rows == 1 or s0 == 1:
        ld = s1 if cols > 1 else max(1, rows)
        if ld >= max(1, rows):
            return False, ld
    if cols == 1 or s1 == 1:
        ld = s0 if rows > 1 else max(1, cols)
        if ld >= max(1, cols):
            return True, ld
    return None


def _strides(x):
    item = x.dtype.itemsize
    return tuple(s // item for s in x.strides)


def plan(a, b, c):
    """Return the column-major gemm computing ``c = a @ b`` (2-D arrays, ``c`` written) as
    (transa, transb, m, n, k, first, lda, second, ldb, ldc): ``first`` and ``second`` are
    ``a`` and ``b`` in the order cuBLAS takes them. None when an operand's memory is neither
    row- nor column-major (the caller copies it first)."""
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or c.shape != (m, n):
        raise ValueError(f"gemm shapes {a.shape} @ {b.shape} -> {c.shape}")
    la, lb, lc = (_layout(*x.shape, *_strides(x)) for x in (a, b, c))
    if la is None or lb is None or lc is None:
        return None
    (ta, lda), (tb, ldb), (tc, ldc) = la, lb, lc
    if not tc:                                   # C column-major: C = op(A) op(B)
        return ta, tb, m, n, k, a, lda, b, ldb, ldc
    # C row-major: C^T = B^T A^T; B = M_B^T gives B^T = M_B (no transpose), and so on
    return not tb, not ta, n, m, k, b, ldb, a, lda, ldc


def enable(on=True):
    """Route every thread's GPU GEMMs through :func:`matmul`'s own cuBLAS handle until
    ``enable(False)`` (tests; a run uses :func:`routed`)."""
    _STATE["on"] = bool(on)


def enabled():
    """Whether this thread's GEMMs take the cuBLAS route now."""
    return _STATE["on"] or getattr(_ROUTED, "depth", 0) > 0


@contextlib.contextmanager
def routed():
    """The GEMMs of this thread inside the block take the cuBLAS route (a CUDA-graph step,
    its eager steps included); after it, CuPy's ``matmul`` again."""
    _ROUTED.depth = getattr(_ROUTED, "depth", 0) + 1
    try:
        yield
    finally:
        _ROUTED.depth -= 1


def matmul(xp, a, b, out=None):
    """``a @ b`` of 2-D arrays into ``out`` (made when None); returns it. NumPy and, until
    :func:`enable`, CuPy: ``xp.matmul``; CuPy after it: one cuBLAS gemm on the current
    stream (operands neither row- nor column-major are copied first)."""
    if xp is np or not enabled():
        return xp.matmul(a, b, out=out)
    if out is None:
        out = xp.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if a.dtype != out.dtype or b.dtype != out.dtype:
        raise TypeError(f"gemm of {a.dtype} @ {b.dtype} -> {out.dtype}")
    target = out if _layout(*out.shape, *_strides(out)) is not None else \
        xp.empty(out.shape, dtype=out.dtype)
    steps = plan(a, b, target) or plan(xp.ascontiguousarray(a), xp.ascontiguousarray(b), target)
    _run(xp, steps, target)
    if target is not out:
        out[...] = target
    return out


def _run(module, steps, c):
    if hasattr(module, "gemm_call"):              # a stand-in array module: it emulates the gemm
        module.gemm_call(steps, c)
    else:                                         # CuPy
        _handle().gemm(steps, c)


# --- cuBLAS through ctypes -------------------------------------------------------

def _library(cupy):
    """The libcublas CuPy loaded (found in this process's memory map); else the one of the
    CUDA major version CuPy runs on (``libcublas.so.<major>``: pip's and the runtime-only
    installs have no unversioned ``libcublas.so``)."""
    importlib.import_module("cupy_backends.cuda.libs.cublas")     # loads libcublas
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = path.rsplit("/", 1)[-1]
            if name.startswith("libcublas.so"):
                return ctypes.CDLL(path)
    return ctypes.CDLL(library_name(cupy.cuda.runtime.runtimeGetVersion()))


def library_name(runtime_version):
    """``libcublas.so.<major>`` of a CUDA runtime version as CUDA reports it (12040: 12)."""
    return f"libcublas.so.{int(runtime_version) // 1000}"


class _Handle:
    """A cuBLAS handle of one device with a workspace of its own: ``WORKSPACE_BYTES`` of raw
    device memory (``runtime.malloc``, outside every memory pool), freed by :meth:`close`."""

    def __init__(self, cupy, lib=None):
        self.cupy = cupy
        self.lib = _library(cupy) if lib is None else lib
        self.ptr = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.ptr)), "cublasCreate")
        try:
            self.workspace = cupy.cuda.runtime.malloc(WORKSPACE_BYTES)
        except BaseException:
            self.lib.cublasDestroy_v2(self.ptr)
            raise
        self.stream = None
        self.one = {np.dtype(np.float32): ctypes.c_float(1.0), np.dtype(np.float64): ctypes.c_double(1.0)}
        self.zero = {np.dtype(np.float32): ctypes.c_float(0.0), np.dtype(np.float64): ctypes.c_double(0.0)}
        self.fn = {np.dtype(np.float32): self.lib.cublasSgemm_v2,
                   np.dtype(np.float64): self.lib.cublasDgemm_v2}

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise CublasError(f"{what} failed with cuBLAS status {status}")

    def bind(self, stream_ptr):
        """Point the handle at ``stream_ptr``; setting a stream resets cuBLAS's workspace to
        its own pool, so ours is set again after it."""
        if stream_ptr == self.stream:
            return
        self._check(self.lib.cublasSetStream_v2(self.ptr, ctypes.c_void_p(stream_ptr)),
                    "cublasSetStream")
        set_workspace = getattr(self.lib, "cublasSetWorkspace_v2", None)   # cuBLAS >= 11.4
        if set_workspace is not None:
            self._check(set_workspace(self.ptr, ctypes.c_void_p(self.workspace),
                                      ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")
        self.stream = stream_ptr

    def gemm(self, steps, c):
        transa, transb, m, n, k, first, lda, second, ldb, ldc = steps
        self.bind(self.cupy.cuda.get_current_stream().ptr)
        dtype = c.dtype
        self._check(self.fn[dtype](self.ptr, int(transa), int(transb), m, n, k,
                                   ctypes.byref(self.one[dtype]), ctypes.c_void_p(first.data.ptr), lda,
                                   ctypes.c_void_p(second.data.ptr), ldb,
                                   ctypes.byref(self.zero[dtype]), ctypes.c_void_p(c.data.ptr), ldc),
                    "cublas gemm")

    def close(self):
        """Destroy the handle, then free its workspace (the device synchronised first: a
        GEMM still queued may use it)."""
        if self.workspace is None:
            return
        self.cupy.cuda.runtime.deviceSynchronize()
        self._check(self.lib.cublasDestroy_v2(self.ptr), "cublasDestroy")
        self.cupy.cuda.runtime.free(self.workspace)
        self.workspace, self.stream = None, None


def _handle():
    import cupy
    device = cupy.cuda.runtime.getDevice()
    with _LOCK:
        handle = _HANDLES.get(device)
        if handle is None:
            handle = _HANDLES[device] = _Handle(cupy)
    return handle


def release():
    """Destroy every device's handle and free its workspace (each on its own device); the
    next routed GEMM makes a new one."""
    import cupy
    with _LOCK:
        handles = list(_HANDLES.items())
        _HANDLES.clear()
    for device, handle in handles:
        with cupy.cuda.Device(device):
            handle.close()


def bind(stream_ptr=None):
    """Point this device's handle at ``stream_ptr`` (default: the current stream) before a
    capture on it begins, so that no cuBLAS call changes the handle while capturing."""
    import cupy
    _handle().bind(cupy.cuda.get_current_stream().ptr if stream_ptr is None else stream_ptr)
