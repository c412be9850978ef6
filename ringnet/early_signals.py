"""SIGTERM and SIGUSR1 noted from a program's first line, before its run can act on them.

A time limit, ``scancel`` or a preemption may signal a job in its first second, while
Python still imports NumPy, mpi4py and CuPy and MPI starts: with the default action the
rank would die there (MPICH's "BAD TERMINATION", exit 15) and SLURM would not requeue the
job. The programs call :func:`hold` first, before any other import; the handler only notes
the signal. :class:`ringnet.stopping.StopSignals` (``python -m ringnet.train``) and
``python -m ringnet.launch`` then :func:`take` it as if it had arrived under their own
handlers. Once a program has its exit code it calls :func:`settle`: further signals are
ignored through the interpreter's exit (Python puts its own handlers back to the default,
fatal action while it finalizes), so the code stands. Only the standard library is
imported here.
"""
import signal
import threading

__all__ = ["hold", "take", "held", "settle", "SIGNALS"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_noted = []


def _note(signum, frame):
    if not _noted:
        _noted.append(signal.Signals(signum).name)


_note.graceful = True       # checkpoint writes keep their temporary on this signal


def hold():
    """Note SIGTERM and SIGUSR1 from now on (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _note)


def held():
    """True when :func:`hold` set this process's handlers."""
    return all(signal.getsignal(signum) is _note for signum in SIGNALS)


def take():
    """Return the name of the first signal noted since :func:`hold` (None if none) and
    forget it."""
    return _noted.pop() if _noted else None


def settle():
    """The exit code is decided: ignore SIGTERM and SIGUSR1 from now on, where :func:`hold`
    set the handlers (a library caller's process is left as it is)."""
    if held() and threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
