"""How ringnet entry points fail: one clear message, a non-zero exit, never a hang.

* :class:`UsageError` — bad command-line input (flags, a world size a mode cannot use).
  Exit code 2 with one line ``ringnet: error: ...``.
* library errors the entry points report the same way: :class:`InputError`
  (a ``ValueError``: input the library cannot use, e.g. a model split-fc cannot split)
  and :class:`SetupError` (a ``RuntimeError``: the machine cannot run what was asked).
  Library modules raise these in their own words; only entry points speak of flags.
* any other exception — a bug or a runtime failure (NaN loss, a transfer timeout, a
  dead peer). The failing rank prints its traceback once, prefixed with its rank, and
  the whole MPI job is aborted (``MPI_Abort``) so no other rank waits forever.

Setup code that every rank runs (argument checks, opening data) goes through
:func:`collective`: every rank reports whether it failed, so a problem seen by one
rank only (a file missing on one node) still ends every rank with exit code 2.
"""
import argparse
import os
import sys
import traceback

__all__ = ["UsageError", "InputError", "SetupError", "USER_ERRORS", "TrainingError",
           "ArgumentParser", "collective", "run_main", "abort", "import_mpi"]

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class InputError(ValueError):
    """Input a library function cannot use, said in the library's words."""


class SetupError(RuntimeError):
    """The machine or installation cannot run what was asked (no usable GPU, NCCL missing)."""


# What an entry point reports in one line with exit code 2 (no traceback).
USER_ERRORS = (UsageError, InputError, SetupError)


class TrainingError(RuntimeError):
    """A run that cannot go on (NaN loss, replicas that diverged)."""


def _world():
    try:
        from mpi4py import MPI
    except Exception:  # pragma: no cover - mpi4py is a hard dependency
        return None
    return MPI.COMM_WORLD


def import_mpi():
    """Return mpi4py's MPI module, or raise UsageError saying how to get an MPI library."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"mpi4py cannot load an MPI library ({first}): `pip install mpich` "
                         "for a local one, or load your cluster's MPI and "
                         "`pip install --no-binary=mpi4py mpi4py`") from None
    return MPI


def _print_error(message):
    sys.stdout.flush()
    print(f"ringnet: error: {message}", file=sys.stderr, flush=True)


def collective(comm, fn, *args, **kwargs):
    """Run ``fn`` on every rank of ``comm``; if it raised on any rank, all exit 2.

    Returns ``fn``'s value on success. A :class:`UsageError` on some ranks is printed
    once by the lowest failing rank (with its rank when not every rank failed).
    Other exceptions propagate after the agreement, so :func:`run_main` aborts.
    """
    error = None
    try:
        value = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        error = ("usage", str(exc))
    except Exception as exc:  # noqa: BLE001 - re-raised below once agreed
        error = ("other", exc)
    if comm is None or comm.Get_size() == 1:
        errors = [None if error is None else (error[0], str(error[1]))]
    else:
        errors = comm.allgather(None if error is None else (error[0], str(error[1])))
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return value
    if error is not None and error[0] == "other":
        raise error[1]
    first = failed[0]
    if comm is None or comm.Get_rank() == first:
        kind, message = errors[first]
        if len(failed) < len(errors):
            message = f"rank {first}: {message}"
        if kind == "usage":
            _print_error(message)
    raise SystemExit(EXIT_USAGE)


def abort(message=None, code=EXIT_FAILURE):
    """Print ``message`` (once, from this rank) and abort the whole MPI job."""
    comm = _world()
    if message:
        prefix = f"[rank {comm.Get_rank()}] " if comm is not None and comm.Get_size() > 1 else ""
        print(f"{prefix}ringnet: error: {message}", file=sys.stderr, flush=True)
    if comm is not None and comm.Get_size() > 1:
        comm.Abort(code)
    os._exit(code)


def run_main(main, argv=None):
    """Call ``main(argv)`` and turn failures into the exit behaviour described above."""
    try:
        code = main(argv)
    except USER_ERRORS as exc:
        # Raised outside `collective`: every rank reached the same verdict from the
        # same arguments, so rank 0 alone speaks and all ranks exit 2.
        comm = _world()
        if comm is None or comm.Get_rank() == 0:
            _print_error(str(exc))
        sys.exit(EXIT_USAGE)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        abort("interrupted", code=130)
    except TrainingError as exc:
        abort(str(exc))                          # the message says it all: no traceback
    except BaseException as exc:  # noqa: BLE001 - last line of defence
        comm = _world()
        rank = comm.Get_rank() if comm is not None else 0
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        text = "".join(f"[rank {rank}] {line}" for chunk in lines for line in chunk.splitlines(True))
        sys.stderr.write(text)
        summary = str(exc) or type(exc).__name__
        abort(summary if isinstance(exc, TrainingError) else f"{type(exc).__name__}: {summary}")
    sys.exit(code or 0)


class ArgumentParser(argparse.ArgumentParser):
    """The entry points' argument parser: its errors are one-line UsageErrors (exit 2)
    naming the --help to read, instead of argparse's usage dump."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")
