"""The run-time control plane: phases, deadlines, agreement between ranks, the watchdog,
fault injection.

No rank waits for another without a deadline. Transfers inside a step are bounded by
the transport's timeout; everything else that needs every rank (the setup agreement
of :func:`collective`, evaluation, the replica check, the final statistics, the save)
goes through :func:`agree`: non-blocking sends and receives and one wait loop that,
at its deadline, names the rank(s) that did not arrive and the phase. Blocking MPI
calls that cannot be made non-blocking (communicator creation) run under a
:func:`watchdog`.

Deadlines (:class:`Deadline`): ``RINGNET_COMM_TIMEOUT`` seconds (default 300) until
step times are known; then ``FACTOR`` times the median recent step time, never below
``min(FLOOR_S, RINGNET_COMM_TIMEOUT)`` nor above ``RINGNET_COMM_TIMEOUT``.

``RINGNET_FAULT=SIGNAL:PHASE:RANK`` (e.g. ``STOP:evaluation:1``) makes rank RANK send
itself SIGNAL (STOP, KILL, TERM, INT, USR1) when it enters PHASE; ``ENOSPC:save-write:0``
makes rank 0's checkpoint write fail as on a full disk: the hook of the fault-injection
tests and of ``python -m ringnet.bench faults``.
"""
import collections
import errno
import os
import signal
import statistics
import sys
import threading
import time

from ringnet.errors import EXIT_USAGE, USER_ERRORS, StallError, TrainingError, UsageError
from ringnet.placement import ranks_text
from ringnet.shutdown import abort, print_error, sleep_backoff, world

__all__ = ["agree", "collective", "check_same_run", "differences", "stalled", "Deadline", "watchdog",
           "stall_error", "comm_timeout",
           "default_timeout", "MAX_TIMEOUT_S", "current_phase", "set_phase", "fault_point",
           "import_mpi"]

_TAG = 0x5249       # control messages of agree() on the caller's communicator


def stall_error(missing, phase, seconds, detail=None, speaker=None, comm=None):
    """Return the StallError of ranks ``missing`` (ranks of ``comm``), their nodes named where
    the ranks span nodes ('ranks 2, 3 (node node2)': a cut link or a lost node shows as the
    ranks behind it)."""
    try:
        who = ranks_text(list(missing), comm=comm)
    except Exception:   # noqa: BLE001 - a message: the plain form will do
        who = None
    return StallError(missing, phase, seconds, detail=detail, speaker=speaker, who=who)


def _world_rank(comm, rank):
    """Return the MPI_COMM_WORLD rank of ``rank`` of ``comm`` (None if it cannot be told)."""
    everyone = world()
    if everyone is None or comm is everyone:
        return rank
    try:
        mine, theirs = comm.Get_group(), everyone.Get_group()
        try:
            found = mine.Translate_ranks([rank], theirs)[0]
        finally:
            mine.Free()
            theirs.Free()
    except Exception:  # noqa: BLE001 - a communicator without a group: nobody is chosen
        return None
    return None if found < 0 else int(found)


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


# -- phases and fault injection ------------------------------------------------------
_phase = "setup"
_fault = None


def current_phase():
    """Return the phase this rank is in ("setup", "step 12", "evaluation", ...)."""
    return _phase


def set_phase(name):
    """Record that this rank enters phase ``name`` (used in messages; a fault point)."""
    global _phase
    _phase = name
    fault_point(name)


# Faults that are not signals: the OS error a write meets there (a full disk).
FAULT_ERRORS = {"ENOSPC": errno.ENOSPC}


def _parse_fault():
    spec = os.environ.get("RINGNET_FAULT", "")
    if not spec:
        return ()
    try:
        what, phase, rank = spec.split(":")
        fault = (FAULT_ERRORS[what.upper()] if what.upper() in FAULT_ERRORS
                 else getattr(signal, "SIG" + what.upper()))
        if what.upper() in FAULT_ERRORS and phase != "save-write":
            raise ValueError("an OS error is met where the checkpoint is written")
        return (what.upper(), fault, phase, int(rank))
    except (ValueError, AttributeError):
        raise UsageError(f"RINGNET_FAULT={spec!r}: expected SIGNAL:PHASE:RANK or ENOSPC:save-write:RANK, "
                         "e.g. STOP:evaluation:1") from None


def fault_point(name):
    """Make the fault ``RINGNET_FAULT`` names happen to this rank when ``name`` is its phase:
    send it the signal, or raise the OS error (ENOSPC: a full disk, where a write is)."""
    global _fault
    if _fault is None:
        _fault = _parse_fault()
    if _fault and _fault[2] == name:
        comm = world()
        if (comm.Get_rank() if comm is not None else 0) == _fault[3]:
            if _fault[0] in FAULT_ERRORS:
                raise OSError(_fault[1], os.strerror(_fault[1]))
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), _fault[1])


# -- deadlines -------------------------------------------------------------------------
# The longest deadline: the set-up watchdog waits 2 x this + 10 s, within what a timer
# takes (threading.TIMEOUT_MAX is about 9.2e9 s on Linux); 1e8 s is over three years.
MAX_TIMEOUT_S = 1e8


def default_timeout() -> float:
    """Return the transfer timeout in seconds: ``RINGNET_COMM_TIMEOUT`` or 300.

    Raises ValueError unless the variable is a positive finite number.
    """
    value = os.environ.get("RINGNET_COMM_TIMEOUT", "")
    try:
        seconds = float(value) if value else 300.0
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):     # 0, negative, NaN or inf: no usable deadline
        raise ValueError(f"RINGNET_COMM_TIMEOUT={value!r} is not a positive number of seconds")
    if seconds > MAX_TIMEOUT_S:     # the set-up watchdog's timer would overflow
        raise ValueError(f"RINGNET_COMM_TIMEOUT={value!r} is too large: at most "
                         f"{MAX_TIMEOUT_S:.0f} seconds")
    return seconds


def comm_timeout():
    """Return ``RINGNET_COMM_TIMEOUT`` in seconds (default 300); UsageError unless positive and finite."""
    try:
        return default_timeout()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


class Deadline:
    """How long a rank waits for its peers, following the measured step time.

    Until ``WARMUP`` steps are measured: the ceiling (``RINGNET_COMM_TIMEOUT``). Then
    ``FACTOR`` x the median of the last ``WINDOW`` step times, clamped to
    ``[min(FLOOR_S, ceiling), ceiling]``: a 0.1 s step stalls out after 30 s instead
    of 300 s, and no healthy step is 20x slower than its recent median.
    """

    FACTOR = 20.0
    FLOOR_S = 30.0
    WARMUP = 3
    WINDOW = 50

    def __init__(self, ceiling=None):
        self.ceiling = comm_timeout() if ceiling is None else float(ceiling)
        self.floor = min(self.FLOOR_S, self.ceiling)
        self.times = collections.deque(maxlen=self.WINDOW)

    def record(self, seconds):
        """Add one measured step time."""
        self.times.append(float(seconds))

    @property
    def seconds(self):
        """Return the current deadline in seconds."""
        if len(self.times) < self.WARMUP:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.FACTOR * statistics.median(self.times)))


# -- agreement across ranks ------------------------------------------------------------
def agree(comm, value, phase=None, timeout=None, root=None):
    """Return every rank's ``value`` (a small picklable object), ordered by rank.

    Non-blocking point-to-point messages on ``comm`` and one wait loop: at ``timeout``
    seconds (default :func:`comm_timeout`) it raises :class:`StallError` naming the
    ranks whose value did not arrive and ``phase``. A rank that arrives at another
    phase raises :class:`TrainingError` naming both phases. With ``root`` (a gather),
    only that rank receives and returns the list; the others return None once it
    took their value.
    """
    phase = phase or _phase
    if comm is None or comm.Get_size() == 1:
        return [value]
    if timeout is None:
        try:
            timeout = comm_timeout()
        except UsageError:      # reported by whoever reads it; do not fail the agreement
            timeout = 300.0
    rank, size = comm.Get_rank(), comm.Get_size()
    targets = [r for r in range(size) if r != rank and root in (None, r)]
    sends = [(r, comm.isend((phase, value), dest=r, tag=_TAG)) for r in targets]
    got = {rank: value} if root in (None, rank) else {r: None for r in range(size)}
    start = time.monotonic()
    pause = 1e-4
    while len(got) < size:
        arrived = False
        for r in range(size):
            if r not in got and comm.iprobe(source=r, tag=_TAG):
                their_phase, their_value = comm.recv(source=r, tag=_TAG)
                if their_phase != phase:
                    raise TrainingError(f"ranks out of step: rank {r} is at {their_phase} while "
                                        f"rank {rank} is at {phase}")
                got[r] = their_value
                arrived = True
        if arrived:
            continue
        if time.monotonic() - start > timeout:
            raise stall_error([r for r in range(size) if r not in got], phase, timeout,
                              speaker=_world_rank(comm, min(got)), comm=comm)
        pause = sleep_backoff(pause)
    while sends:    # small messages leave at once; this waits on a large one or a full buffer
        sends = [(r, s) for r, s in sends if not s.Test()]
        if sends and time.monotonic() - start > timeout:
            raise stall_error([r for r, _ in sends], phase, timeout,
                              detail="its message from this rank was not taken", comm=comm)
        if sends:
            pause = sleep_backoff(pause)
    return [got[r] for r in range(size)] if root in (None, rank) else None


def collective(comm, fn, *args, phase=None, timeout=None, **kwargs):
    """Run ``fn`` on every rank of ``comm``; if it raised on any rank, all exit 2.

    Returns ``fn``'s value on success. A :class:`UsageError` on some ranks is printed
    once by the lowest failing rank (with its rank when not every rank failed).
    Other exceptions propagate after the agreement, so :func:`run_main` aborts.
    The agreement goes through :func:`agree` (bounded by ``timeout``).
    """
    error = None
    try:
        value = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        error = ("usage", str(exc))
    except Exception as exc:  # noqa: BLE001 - re-raised below once agreed
        error = ("other", exc)
    report = None if error is None else (error[0], str(error[1]))
    errors = agree(comm, report, phase=phase, timeout=timeout)
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
            print_error(message)
    raise SystemExit(EXIT_USAGE)


def differences(prints):
    """Return what differs between the ranks' ``prints`` ([{field: value}], by rank), one
    text per field: 'FIELD is A on rank 0 but B on rank(s) 2, 3'."""
    problems = []
    for field in sorted(set().union(*prints)):
        values = [p.get(field) for p in prints]
        differ = [r for r, v in enumerate(values) if v != values[0]]
        if differ:
            problems.append(f"{field} is {values[0]} on rank 0 but {values[differ[0]]} on rank(s) "
                            f"{', '.join(str(r) for r in differ)}")
    return problems


def check_same_run(world, fingerprint):
    """Exit 2 on every rank, naming the fields and the ranks, unless all ranks sent the same
    ``fingerprint`` ({field: value}; the start-up agreement of ``python -m ringnet.train``)."""
    prints = agree(world, fingerprint, phase="setup")
    problems = differences(prints)
    if problems:
        raise UsageError("ranks were started with different settings or data: " + "; ".join(problems)
                         + " (every rank must run the same command on the same data)")


def stalled(world, exc, deadline):
    """Turn a transfer timeout ``exc`` into the error naming the rank(s) that stopped answering.

    The ranks that are alive also time out (each waits on the chain that leads to the
    stalled one) and meet here; those that do not arrive are the ones at fault.
    """
    phase = current_phase()
    try:
        agree(world, phase, phase="stall check", timeout=0.5 * deadline.seconds + 2.0)
    except StallError as stall:
        return stall_error(stall.missing, phase, deadline.seconds, detail=f"here: {exc}",
                           speaker=stall.speaker, comm=world)
    except TrainingError as other:
        return other
    return TrainingError(f"{phase}: {exc}")


class watchdog:
    """Context manager: abort the job when the block has not finished within ``seconds``.

    For blocking MPI calls without a non-blocking form (communicator creation).
    """

    def __init__(self, phase, seconds):
        self.phase, self.seconds = phase, float(seconds)
        self._timer = None

    def _fire(self):
        abort(f"{self.phase} did not finish within {self.seconds:.3g} s: another rank stopped "
              "answering (deadline: RINGNET_COMM_TIMEOUT)")

    def __enter__(self):
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        return False


# -- exits -----------------------------------------------------------------------------
