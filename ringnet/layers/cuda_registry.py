"""The registry of the fused CUDA kernels (:mod:`ringnet.layers.cuda_kernels`,
:mod:`ringnet.layers.cuda_pointwise`): each kernel declared once by :func:`declare_kernel`,
its parameter list (which also makes the CUDA signature) and its CUDA body; its CUDA source
per dtype (:func:`source`), compiled once per dtype and cached; and :func:`launch`, which
runs it on the GPU for CuPy arrays and, for NumPy arrays, checks every argument against the
declared C types and runs its NumPy emulation (testing code, in
:mod:`ringnet.testing.cuda_emulation`, imported there and only there).
"""
import numpy as np

from ringnet.backend import cupy

__all__ = ["KERNELS", "declare_kernel", "source", "launch"]

THREADS = 256                   # threads per block; blocks stride over larger sizes
MAX_BLOCKS = 32768
OPTIONS = ("--fmad=false",)
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}

# Shared by every kernel: T is typedef'd to float or double in front of this.
_PRELUDE = r"""
#define FOR_EACH(idx, n) \
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < (n); \
       idx += (long long)blockDim.x * gridDim.x)

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}
"""

KERNELS = {}                    # name -> (params [(name, C type)], CUDA body)


def declare_kernel(name, params, body):
    """Declare kernel ``name``: its parameters [(name, C type)] and its CUDA body."""
    if name in KERNELS:
        raise ValueError(f"kernel {name} is declared already")
    KERNELS[name] = (tuple(params), body)


def source(name, dtype):
    """Return the CUDA C source of kernel ``name`` for ``dtype`` (float32 or float64)."""
    params, body = KERNELS[name]
    decl = ", ".join(f"{ctype} {pname}" for pname, ctype in params)
    return (f"typedef {_CTYPES[np.dtype(dtype)]} T;\n{_PRELUDE}\n"
            f'extern "C" __global__ void {name}({decl})\n{{\n{body}}}\n')


_compiled = {}


def _compiled_kernel(name, dtype):
    key = (name, np.dtype(dtype).char)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = cupy.RawKernel(source(name, dtype), name, options=OPTIONS)
    return kernel


_SCALARS = {"int": np.int32, "long long": np.int64, "unsigned long long": np.uint64}
_POINTERS = {"unsigned char": np.uint8, "long long": np.int64, "unsigned long long": np.uint64}


def _check_args(name, dtype, args):
    """Raise TypeError unless ``args`` match kernel ``name``'s C parameter types exactly."""
    params = KERNELS[name][0]
    if len(args) != len(params):
        raise TypeError(f"{name}: {len(args)} arguments for {len(params)} parameters")
    for (pname, ctype), arg in zip(params, args):
        base = ctype.replace("const ", "").rstrip("*").strip()
        if ctype.endswith("*"):
            want = np.dtype(_POINTERS.get(base, dtype))
            ok = isinstance(arg, np.ndarray) and arg.dtype == want and arg.flags.c_contiguous \
                and (ctype.startswith("const ") or arg.flags.writeable)
        else:
            want = np.dtype(dtype).type if base == "T" else _SCALARS[base]
            ok = type(arg) is want
        if not ok:
            raise TypeError(f"{name}: argument {pname} ({ctype}) got {type(arg).__name__} "
                            f"{getattr(arg, 'dtype', '')}")


def launch(xp, name, dtype, n, args):
    """Run kernel ``name`` over ``n`` threads: on the GPU for CuPy, emulated for NumPy (the
    emulation, testing code, is imported here and only here)."""
    if xp is np:
        _check_args(name, dtype, args)
        from ringnet.testing import cuda_emulation
        cuda_emulation.run(name, args)
        return
    if n > 0:
        blocks = min(-(-n // THREADS), MAX_BLOCKS)
        _compiled_kernel(name, dtype)((blocks,), (THREADS,), args)
