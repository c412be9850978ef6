"""How an entry point ends: :func:`run_main` turns each kind of failure into its exit
(see :mod:`ringnet.errors`), and :class:`ArgumentParser` makes argparse's errors one line."""
import argparse
import sys
import time
import traceback

from ringnet.control import current_phase
from ringnet.errors import EXIT_FAILURE, EXIT_USAGE, USER_ERRORS, DivergedError, TrainingError, UsageError
from ringnet.shutdown import abort, interrupted, note_exit, print_error, quiet_broken_pipe, world

__all__ = ["run_main", "ArgumentParser", "SPEAKER_WAIT_S"]

SPEAKER_WAIT_S = 20.0  # a stall's other ranks wait this long for its speaker's abort (run_main)


def _mpi_exception_type():
    mpi = sys.modules.get("mpi4py.MPI")
    return getattr(mpi, "Exception", ()) if mpi is not None else ()


def run_main(main, argv=None):
    """Call ``main(argv)`` and turn failures into the exit behaviour described above."""
    try:
        code = main(argv)
    except USER_ERRORS as exc:
        # Raised outside `collective`: every rank reached the same verdict from the
        # same arguments, so rank 0 alone speaks and all ranks exit 2.
        comm = world()
        if comm is None or comm.Get_rank() == 0:
            print_error(str(exc))
        note_exit(EXIT_USAGE)
        sys.exit(EXIT_USAGE)
    except SystemExit:
        raise
    except BrokenPipeError:
        quiet_broken_pipe()
    except KeyboardInterrupt:
        interrupted()
    except TrainingError as exc:
        # Often seen by several ranks at once (a stall, NaN loss): one rank speaks and its
        # abort ends the others before they print. A stall names its speaker (the lowest
        # rank that arrived: every live rank agrees on it); the others wait for its abort,
        # and speak themselves only if it never comes. Otherwise the lowest rank speaks first.
        comm = world()
        rank = comm.Get_rank() if comm is not None else 0
        speaker = getattr(exc, "speaker", None)
        if speaker is None and isinstance(exc, DivergedError):
            # the ranks compute on the same weights: one that diverged seldom does so alone,
            # and srun kills the others more slowly than mpirun after rank 0's abort
            speaker = 0
        if speaker is not None and comm is not None and comm.Get_size() > 1:
            if rank != speaker:
                time.sleep(SPEAKER_WAIT_S)
        else:
            time.sleep(0.3 * min(rank, 10))
        abort(str(exc), code=getattr(exc, "exit_code", EXIT_FAILURE))
    except BaseException as exc:  # noqa: BLE001 - last line of defence
        if isinstance(exc, _mpi_exception_type()):
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            abort(f"MPI call failed during {current_phase()} ({first}); another rank probably exited "
                  "(see its message above)")
        comm = world()
        rank = comm.Get_rank() if comm is not None else 0
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        text = "".join(f"[rank {rank}] {line}" for chunk in lines for line in chunk.splitlines(True))
        sys.stderr.write(text)
        summary = str(exc) or type(exc).__name__
        abort(f"{type(exc).__name__}: {summary}")
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_broken_pipe()
    note_exit(code)
    sys.exit(code or 0)


class ArgumentParser(argparse.ArgumentParser):
    """The entry points' argument parser: its errors are one-line UsageErrors (exit 2)
    naming the --help to read, instead of argparse's usage dump."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")
