"""Array backend: CuPy on a GPU, NumPy otherwise; device binding by node-local rank."""
import numpy as np

__all__ = ["cupy", "gpu_available", "get_xp", "get_array_module", "to_numpy",
           "resolve_dtype", "make_rng", "bind_device", "is_gpu_array"]

try:  # CuPy imports without a GPU; it is only *usable* when a device answers.
    import cupy  # type: ignore
except Exception:  # pragma: no cover - depends on the machine
    cupy = None


def gpu_available():
    """Return True when CuPy is installed and at least one CUDA device is usable."""
    if cupy is None:
        return False
    try:
        return bool(cupy.is_available())
    except Exception:
        return False


def get_xp(device="auto"):
    """Return the array module for ``device`` in {"auto", "cpu", "gpu"}."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device {device!r}: choose auto, cpu or gpu")
    if device == "cpu":
        return np
    if gpu_available():
        return cupy
    if device == "gpu":
        raise RuntimeError("--device gpu asked for, but no usable CUDA GPU "
                           "(CuPy missing or cupy.is_available() is False)")
    return np


def get_array_module(*arrays):
    """Return cupy if any argument is a CuPy array, else numpy."""
    if cupy is not None:
        return cupy.get_array_module(*arrays)
    return np


def is_gpu_array(array):
    """Return True for a CuPy ndarray."""
    return cupy is not None and isinstance(array, cupy.ndarray)


def to_numpy(array):
    """Return a host NumPy copy (or the array itself when it already is NumPy)."""
    if is_gpu_array(array):
        return cupy.asnumpy(array)
    return np.asarray(array)


def resolve_dtype(name):
    """Map "float32"/"float64" (or a dtype) to a NumPy dtype; anything else is refused."""
    dtype = np.dtype(name)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"unsupported dtype {name!r}: choose float32 or float64")
    return dtype


def make_rng(seed):
    """Return a seeded host RNG (parameters are always initialised on the host)."""
    return np.random.default_rng(seed)


def bind_device(local_rank):
    """Make GPU ``local_rank % device_count`` current; return its id (None on CPU)."""
    if not gpu_available():
        return None
    count = cupy.cuda.runtime.getDeviceCount()
    device_id = local_rank % count
    cupy.cuda.Device(device_id).use()
    return device_id
