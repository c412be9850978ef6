"""The environment variables that shape a run, read and checked in one place.

:func:`check_environment` parses each of them with the parser the code that uses it calls,
so a bad value (empty where a number is needed, not a number, out of range) is one line
naming the variable before any work, instead of a traceback from deep inside a transport.
:func:`run_knobs` returns the ones that change what is computed or exchanged; they enter
the start-up fingerprint that every rank must share (``ringnet.train.check_same_run``), so
ranks started with different values exit 2 naming the variable instead of failing later in
a transfer.
"""
import os

from ringnet.errors import InputError, UsageError

__all__ = ["RUN_KNOBS", "check_environment", "run_knobs"]

# Variables whose value changes what a run computes or exchanges (every rank must agree).
# RINGNET_FAULT and RINGNET_HEARTBEAT are per rank by design; RINGNET_DATA and
# RINGNET_DATA_IN_MEMORY_MB change where the bytes come from, not which (the data set's
# content fingerprint is compared on its own); RINGNET_PROGRESS_SECONDS only rank 0's log.
RUN_KNOBS = ("RINGNET_COMM_TIMEOUT", "RINGNET_CPU_PROGRESS", "RINGNET_BUCKET_BYTES",
             "RINGNET_NCCL", "RINGNET_CUDA_AWARE_MPI", "RINGNET_SAVE_SYNC")


def _parsers():
    from ringnet.comm.mpi_transport import mpi_cuda_aware_setting
    from ringnet.comm.stream import progress_mode
    from ringnet.control import default_timeout
    from ringnet.data.catalog import in_memory_bytes
    from ringnet.parallel.plans import bucket_bytes
    from ringnet.progress import progress_interval
    return (default_timeout, progress_mode, bucket_bytes, mpi_cuda_aware_setting,
            in_memory_bytes, progress_interval, _nccl_kind, _switch("RINGNET_SAVE_SYNC"),
            _switch("RINGNET_MALLOC"))


def _nccl_kind():
    value = os.environ.get("RINGNET_NCCL", "")
    if value not in ("", "cupy", "standin"):
        raise ValueError(f"RINGNET_NCCL={value!r}: use standin (or leave it unset)")


def _switch(name):
    """A parser for a 0/1 variable ``name`` (unset is allowed)."""
    def parse():
        value = os.environ.get(name, "")
        if value not in ("", "0", "1"):
            raise ValueError(f"{name}={value!r}: use 0 or 1")
    return parse


def check_environment():
    """Raise UsageError (one line, naming the variable) if a ``RINGNET_*`` value is unusable."""
    for parse in _parsers():
        try:
            parse()
        except UsageError:
            raise
        except (ValueError, OverflowError, InputError) as exc:
            raise UsageError(str(exc)) from None


def run_knobs(environ=None):
    """Return {variable: value or None} of :data:`RUN_KNOBS` (None: unset)."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in RUN_KNOBS}
