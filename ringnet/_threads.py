"""Pin BLAS/OpenMP threads per MPI rank before NumPy is imported."""
import os

__all__ = ["local_ranks_on_node", "blas_threads_for_rank", "configure_blas_threads"]

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
    """Set the thread variables unless the user already set ``OMP_NUM_THREADS``.

    Only effective before NumPy (or CuPy) is first imported in this process.
    """
    if "OMP_NUM_THREADS" in os.environ and "RINGNET_BLAS_THREADS" not in os.environ:
        n = os.environ["OMP_NUM_THREADS"]
    else:
        n = str(blas_threads_for_rank())
    for var in _THREAD_VARS:
        if var == "OMP_NUM_THREADS" or var not in os.environ or "RINGNET_BLAS_THREADS" in os.environ:
            os.environ[var] = n
    return int(n)
