"""ringnet: multi-GPU CNN training with MPI and NCCL, parallel structures side by side.

Importing ringnet pins the BLAS thread count of this process *before* NumPy loads,
so that several MPI ranks on one node do not oversubscribe its cores. See
:func:`ringnet.backend.blas_threads_for_rank` for the rule and how to override it.
"""
from ringnet._threads import configure_blas_threads as _configure_blas_threads

_configure_blas_threads()

__version__ = "0.1.0"
__all__ = ["__version__"]
