"""Pin BLAS/OpenMP threads per MPI rank (and OpenBLAS's kernels) before NumPy is imported."""
import os

__all__ = ["local_ranks_on_node", "blas_threads_for_rank", "configure_blas_threads",
           "openblas_coretype", "configure_blas_kernels"]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

# Environment variables launchers set to the number of ranks on this node.
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS",              # MPICH / Hydra
                    "OMPI_COMM_WORLD_LOCAL_SIZE",   # Open MPI
                    "MV2_COMM_WORLD_LOCAL_SIZE",    # MVAPICH2
                    "PMI_LOCAL_SIZE",
                    "SLURM_NTASKS_PER_NODE")        # srun


def local_ranks_on_node():
    """Return the number of ranks the launcher put on this node (1 when unknown)."""
    for var in _LOCAL_SIZE_VARS:
        value = os.environ.get(var, "")
        # SLURM_NTASKS_PER_NODE may read "4" or "4(x2)"
        digits = value.split("(")[0].split(",")[0]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    return 1


def blas_threads_for_rank():
    """Return the BLAS thread count for this rank.

    ``RINGNET_BLAS_THREADS`` wins; otherwise the usable cores of this node divided
    evenly among its ranks (at least 1).
    """
    forced = os.environ.get("RINGNET_BLAS_THREADS", "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // local_ranks_on_node())


def configure_blas_threads():
    """Set the thread variables unless the user already set ``OMP_NUM_THREADS``, and
    OpenBLAS's kernels (:func:`configure_blas_kernels`).

    Only effective before NumPy (or CuPy) is first imported in this process.
    """
    if "OMP_NUM_THREADS" in os.environ and "RINGNET_BLAS_THREADS" not in os.environ:
        n = os.environ["OMP_NUM_THREADS"]
    else:
        n = str(blas_threads_for_rank())
    for var in _THREAD_VARS:
        if var == "OMP_NUM_THREADS" or var not in os.environ or "RINGNET_BLAS_THREADS" in os.environ:
            os.environ[var] = n
    configure_blas_kernels()
    return int(n)


def _cpuinfo():
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def openblas_coretype(cpuinfo=None):
    """Return the OpenBLAS core type to ask for on this CPU, or None to keep OpenBLAS's own.

    On AMD family 25 with AVX-512 (Zen 4) OpenBLAS picks its SkylakeX (AVX-512) kernels;
    its Haswell (AVX2) kernels ran the GEMM shapes of ringnet's convolutions up to 10%
    faster there, and the cifar10_quick training step about 8% faster against the same
    PyTorch step (``python -m ringnet.bench layers --vs torch``). Elsewhere (Intel,
    Zen 1-3, which OpenBLAS already gives AVX2 kernels, Zen 5 with full-width AVX-512,
    other architectures) nothing is measured, so nothing is changed. ``cpuinfo``: the
    text of /proc/cpuinfo (read when None).
    """
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            if fields:
                break                                # the first processor's block only
            continue
        fields.setdefault(key.strip(), value.strip())
    if (fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25"
            and "avx512f" in fields.get("flags", "").split()):
        return "Haswell"
    return None


def configure_blas_kernels():
    """Set ``OPENBLAS_CORETYPE`` to :func:`openblas_coretype`'s choice unless the user set it.

    Only effective before NumPy is first imported (OpenBLAS reads it when it loads); other
    BLAS libraries (MKL, which PyTorch links) ignore it. Returns the value now in effect
    (None: OpenBLAS's own choice).
    """
    if "OPENBLAS_CORETYPE" not in os.environ:
        choice = openblas_coretype()
        if choice is not None:
            os.environ["OPENBLAS_CORETYPE"] = choice
    return os.environ.get("OPENBLAS_CORETYPE") or None
