"""Array backend: CuPy on a GPU, NumPy otherwise; device binding by node-local rank."""
import numpy as np

__all__ = ["cupy", "gpu_available", "check_gpu", "get_xp", "get_array_module", "to_numpy",
           "resolve_dtype", "make_rng", "bind_device", "is_gpu_array", "pci_bus_id"]

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


def check_gpu():
    """Launch a kernel and a GEMM on the current GPU; raise RuntimeError in one line if either fails.

    Catches a CuPy that imports and sees a device but cannot run on it (a wheel for
    another CUDA major than the driver's, a missing cuBLAS or NVRTC).
    """
    try:
        a = cupy.arange(16, dtype=cupy.float32).reshape(4, 4)
        total = float((a * 2 + 1).sum())          # an elementwise kernel, a reduction
        product = float((a @ a).trace())          # cuBLAS
    except Exception as exc:  # noqa: BLE001 - any failure means the GPU path is unusable
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise RuntimeError(f"CuPy {cupy.__version__} sees a GPU but cannot run on it "
                           f"({type(exc).__name__}: {first}); install the extra for the CUDA "
                           "major version `nvidia-smi` shows (gpu-cuda12 or gpu-cuda13)") from None
    host = np.arange(16, dtype=np.float32).reshape(4, 4)
    want_total, want_product = float((host * 2 + 1).sum()), float((host @ host).trace())
    if total != want_total or product != want_product:
        raise RuntimeError(f"CuPy {cupy.__version__} computed wrong values on the GPU "
                           f"(sum {total}, trace {product}; expected {want_total:g} and "
                           f"{want_product:g})")


def get_xp(device="auto"):
    """Return the array module for ``device`` in {"auto", "cpu", "gpu"}.

    ``cpu`` never touches CUDA; the others only count devices (no CUDA context): bind the
    rank's GPU, then :func:`check_gpu` it.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown device {device!r}: choose auto, cpu or gpu")
    if device == "cpu":
        return np
    if gpu_available():
        return cupy
    if device == "gpu":
        raise RuntimeError("no usable CUDA GPU "
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


def pci_bus_id(device_id):
    """Return the PCI bus id of CUDA device ``device_id`` (e.g. ``0000:3b:00.0``), lower case."""
    return str(cupy.cuda.runtime.deviceGetPCIBusId(int(device_id))).lower()
