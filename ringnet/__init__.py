"""ringnet: multi-GPU CNN training with MPI and NCCL, parallel structures side by side.

Importing ringnet changes nothing in the process (no environment variables). The
programs (``python -m ringnet.train``, ``python -m ringnet.bench``) pin the BLAS thread
count *before* NumPy loads, so that several MPI ranks on one node do not oversubscribe
its cores: see :func:`ringnet.blas.configure_blas_threads` for the rule and how to
override it; a library user calls it before importing NumPy to get the same.
"""
__version__ = "0.1.0"
__all__ = ["__version__"]
