"""A graceful stop: SIGTERM or SIGUSR1 ends a run at a step boundary with its checkpoint saved.

A time limit, ``scancel`` or a preemption sends SIGTERM (SLURM's ``--signal=B:USR1@120``
sends SIGUSR1 to the batch script first, which passes it on). The signal may reach one rank
or all of them, at any moment, maybe inside a transfer. So its handler only notes it, and
the ranks agree at each step boundary whether any of them was signalled:

* at the end of step t every rank starts a non-blocking all-reduce (MPI_Iallreduce, max) of
  its flag on a communicator of its own, and waits for the one it started at step t-1. The
  tiny reduction runs beside step t, so waiting for it costs almost nothing, and all ranks
  read the same round at the same step: they stop together, at the first step boundary
  after the signal arrived, plus one;
* the wait is bounded by the run's deadline like every other (a stalled rank is named).

The run then writes one synchronous checkpoint to ``--save`` and exits with
:data:`ringnet.errors.EXIT_STOPPED` (75). A second signal while it saves is noted and
changes nothing: the save is atomic, the previous checkpoint stays whole until the new one
is complete.
"""
import signal
import threading
import time

from ringnet import early_signals
from ringnet.control import current_phase
from ringnet.errors import TrainingError

__all__ = ["StopSignals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Note SIGTERM and SIGUSR1 while active (``with``); :meth:`agreed` says when to stop.

    The handlers are installed on ``with``, before the ranks can agree on anything, so a
    signal in the set-up is noted too, and one noted before (by the program's first line,
    :mod:`ringnet.early_signals`, or by an outer StopSignals) counts as if it came now;
    :meth:`attach` then gives the ranks their own communicator for the rounds (without one,
    or on one rank, no agreement is needed).
    ``timeout``: a callable giving the seconds a round may take (the run's deadline). Nested,
    the inner one hands the signals back to the outer one when it ends: a run that is
    complete notes a late signal and ends as it would have.
    """

    def __init__(self, timeout=lambda: 300.0):
        self.timeout = timeout
        self.received = None        # name of the first signal noted on this rank
        self.stopped_by = None      # the agreed reason, once the ranks agreed to stop
        self._previous = {}
        self._comm = None
        self._pending = None        # (request, send buffer, receive buffer) of the round in flight

    def attach(self, world, timeout=None):
        """Agree over ``world`` (collective: every rank calls it once, after the set-up's first
        agreement, so that no rank waits here for one that stalled)."""
        if timeout is not None:
            self.timeout = timeout
        if world is not None and world.Get_size() > 1:
            self._comm = world.Dup()

    # -- the handler --------------------------------------------------------------------
    def _note(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name

    _note.graceful = True       # checkpoint writes keep their temporary on this signal (see there)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._note)
        # a signal the program noted before this (ringnet.early_signals), or an outer
        # StopSignals noted while the run was being set up: as if it came now
        outer = getattr(self._previous.get(signal.SIGTERM), "__self__", None)
        early = early_signals.take()
        if self.received is None:
            self.received = (outer.received if isinstance(outer, StopSignals) else None) or early
        return self

    def __exit__(self, exc_type, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
        if self.received is not None and early_signals.held():
            early_signals.take()    # (noted here: not to be taken again by a later run)
        if exc_type is None:        # on an error the job is aborted: no rank waits for a round
            self._cancel()
            if self._comm is not None:
                self._comm.Free()
        self._comm = None
        return False

    # -- the agreement --------------------------------------------------------------------
    def agreed(self):
        """Call at every step boundary (every rank, the same number of times). Return the
        signal's name once the ranks agreed to stop, else None."""
        if self.stopped_by is not None:
            return self.stopped_by
        if self._comm is None:
            self.stopped_by = self.received
            return self.stopped_by
        import numpy as np
        from mpi4py import MPI
        if self._pending is not None:
            request, _, result = self._pending
            self._wait(request)
            self._pending = None
            if result[0]:
                self.stopped_by = signal.Signals(int(result[0])).name
                return self.stopped_by
        flag = np.array([int(signal.Signals[self.received]) if self.received else 0], np.int64)
        result = np.zeros(1, np.int64)
        self._pending = (self._comm.Iallreduce(flag, result, op=MPI.MAX), flag, result)
        return None

    def _wait(self, request):
        limit = self.timeout()
        end = time.monotonic() + limit
        pause = 1e-5
        while not request.Test():
            if time.monotonic() > end:
                raise TrainingError(f"{current_phase()}: the step-boundary agreement on stopping "
                                    f"did not complete within {limit:.3g} s (a rank stalled; "
                                    f"deadline: RINGNET_COMM_TIMEOUT)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _cancel(self):
        if self._pending is not None:
            try:
                self._wait(self._pending[0])   # every rank started it: it completes
            except Exception:   # noqa: BLE001 - leaving anyway
                pass
            self._pending = None
