"""How ringnet entry points fail: one clear message, a non-zero exit, never a hang.

* :class:`UsageError` — bad command-line input (flags, data files, a world size a mode
  cannot use, ranks started with different settings). Exit code 2 with one line
  ``ringnet: error: ...``.
* library errors the entry points report the same way: :class:`InputError`
  (a ``ValueError``: input the library cannot use, e.g. a model split-fc cannot split)
  and :class:`SetupError` (a ``RuntimeError``: the machine cannot run what was asked).
  Library modules raise these in their own words; only entry points speak of flags.
* :class:`TrainingError` — a run that cannot go on (NaN loss, replicas that diverged, a
  rank that stopped answering, a data chunk that cannot be read mid-training:
  :class:`RunInputError`, exit code 2). The rank that saw it prints one line naming the
  step or phase and the rank(s) at fault, then the whole MPI job is aborted.
* Ctrl-C (SIGINT) — rank 0 prints ``ringnet: error: interrupted`` and every rank
  exits 130, without MPI_Abort, so that mpirun adds nothing (see ``_interrupted``).
* any other exception — a bug. The failing rank prints its traceback once, prefixed
  with its rank, and the whole MPI job is aborted (``MPI_Abort``).

No rank waits for another without a deadline. Transfers inside a step are bounded by
the transport's timeout; everything else that needs every rank (the setup agreement
of :func:`collective`, evaluation, the replica check, the final statistics, the save)
goes through :func:`exchange`: non-blocking sends and receives and one wait loop that,
at its deadline, names the rank(s) that did not arrive and the phase. Blocking MPI
calls that cannot be made non-blocking (communicator creation) run under a
:func:`watchdog`.

Deadlines (:class:`Deadline`): ``RINGNET_COMM_TIMEOUT`` seconds (default 300) until
step times are known; then ``FACTOR`` times the median recent step time, never below
``min(FLOOR_S, RINGNET_COMM_TIMEOUT)`` nor above ``RINGNET_COMM_TIMEOUT``.

``RINGNET_FAULT=SIGNAL:PHASE:RANK`` (e.g. ``STOP:evaluation:1``) makes rank RANK send
itself SIGNAL (STOP, KILL, TERM, INT) when it enters PHASE: the hook of the
fault-injection tests and of ``python -m ringnet.bench faults``.
"""
import argparse
import collections
import ctypes
import fcntl
import os
import signal
import stat
import statistics
import struct
import sys
import termios
import threading
import time
import traceback

__all__ = ["UsageError", "InputError", "SetupError", "TransportUnavailable", "USER_ERRORS", "ArgumentParser",
           "TrainingError", "RunInputError", "StallError", "Deadline", "collective", "exchange",
           "watchdog", "set_phase", "current_phase", "fault_point", "comm_timeout",
           "DivergedError", "run_main", "abort", "import_mpi", "EXIT_USAGE", "EXIT_FAILURE",
           "EXIT_DIVERGED", "EXIT_INTERRUPTED", "EXIT_STOPPED"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_DIVERGED = 3     # non-finite loss: a rerun from the same weights diverges again
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what shells report for a program ended by Ctrl-C
EXIT_STOPPED = 75     # SIGTERM/SIGUSR1: stopped at a step boundary, checkpoint saved (EX_TEMPFAIL:
                      # try again later, i.e. requeue and --resume)
ABORT_GRACE_S = 0.25  # seconds between the error line leaving the pipe and MPI_Abort (see abort)
DRAIN_LIMIT_S = 10.0  # at most this long for the launcher to read the error line (see abort)
FINALIZE_LIMIT_S = 10.0  # an interrupted rank waits this long for the others (see _interrupted)
SPEAKER_WAIT_S = 20.0  # a stall's other ranks wait this long for its speaker's abort (run_main)
_TAG = 0x5249       # control messages of exchange() on the caller's communicator


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class InputError(ValueError):
    """Input a library function cannot use, said in the library's words."""


class SetupError(RuntimeError):
    """The machine or installation cannot run what was asked (no usable GPU, NCCL missing)."""


class TransportUnavailable(SetupError):
    """A transport or device asked for cannot run on this rank.

    ``reason`` says which rule refused it, so that an entry point can name the setting
    to change: ``"cpu-device"`` (a GPU transport with the buffers on the CPU),
    ``"no-gpu"`` (the GPU asked for is not usable), ``"shared-gpu"`` (ranks share a GPU,
    which NCCL cannot run), ``"no-nccl"`` (NCCL does not load on every rank).
    ``transport`` is the transport asked for (None where the device was the problem).
    """

    REASONS = ("cpu-device", "no-gpu", "shared-gpu", "no-nccl")

    def __init__(self, message, reason, transport=None):
        if reason not in self.REASONS:
            raise ValueError(f"unknown reason {reason!r}: choose {', '.join(self.REASONS)}")
        super().__init__(message)
        self.reason, self.transport = reason, transport


# What an entry point reports in one line with exit code 2 (no traceback).
USER_ERRORS = (UsageError, InputError, SetupError)


class TrainingError(RuntimeError):
    """A run that cannot go on (NaN loss, replicas that diverged): one line, job aborted."""


class DivergedError(TrainingError):
    """The loss became NaN or infinite: deterministic, so the job ends with EXIT_DIVERGED."""
    exit_code = EXIT_DIVERGED


class RunInputError(TrainingError):
    """Bad input met during the run by some ranks only (a data chunk first read mid-training
    that cannot be read): the rank that met it prints one line, the job is aborted, exit 2."""
    exit_code = EXIT_USAGE


class StallError(TrainingError):
    """Ranks that did not arrive at a phase within the deadline.

    ``speaker``: the world rank that reports it (the lowest rank that did arrive), or None.
    """

    def __init__(self, missing, phase, seconds, detail=None, speaker=None, comm=None):
        self.missing, self.phase, self.seconds = list(missing), phase, seconds
        self.speaker = speaker
        who = _ranks(self.missing, comm)
        text = (f"{who} did not arrive at {phase} within {seconds:.3g} s "
                f"(stopped, hung or far slower than the others; deadline: RINGNET_COMM_TIMEOUT)")
        super().__init__(text + (f"; {detail}" if detail else ""))


def _ranks(ranks, comm=None):
    """'rank 3' / 'ranks 2, 3', with their node where the ranks span nodes ('ranks 2, 3
    (node node2)': a cut link or a lost node shows as the ranks behind it)."""
    try:
        from ringnet.comm.nodes import ranks_text
        return ranks_text(list(ranks), comm=comm)
    except Exception:   # noqa: BLE001 - a message: the plain form will do
        pass
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _world_rank(comm, rank):
    """Return the MPI_COMM_WORLD rank of ``rank`` of ``comm`` (None if it cannot be told)."""
    world = _world()
    if world is None or comm is world:
        return rank
    try:
        mine, theirs = comm.Get_group(), world.Get_group()
        try:
            found = mine.Translate_ranks([rank], theirs)[0]
        finally:
            mine.Free()
            theirs.Free()
    except Exception:  # noqa: BLE001 - a communicator without a group: nobody is chosen
        return None
    return None if found < 0 else int(found)


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


def _parse_fault():
    spec = os.environ.get("RINGNET_FAULT", "")
    if not spec:
        return ()
    try:
        sig, phase, rank = spec.split(":")
        return (getattr(signal, "SIG" + sig.upper()), phase, int(rank))
    except (ValueError, AttributeError):
        raise UsageError(f"RINGNET_FAULT={spec!r}: expected SIGNAL:PHASE:RANK, "
                         "e.g. STOP:evaluation:1") from None


def fault_point(name):
    """Send this rank the signal named by ``RINGNET_FAULT`` when ``name`` is its phase."""
    global _fault
    if _fault is None:
        _fault = _parse_fault()
    if _fault and _fault[1] == name:
        comm = _world()
        if (comm.Get_rank() if comm is not None else 0) == _fault[2]:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), _fault[0])


# -- deadlines -------------------------------------------------------------------------
def comm_timeout():
    """Return ``RINGNET_COMM_TIMEOUT`` in seconds (default 300); UsageError unless positive and finite."""
    from ringnet.comm.transport import default_timeout
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
def _sleep_backoff(pause):
    time.sleep(pause)
    return min(0.01, pause * 2 + 1e-4)


def exchange(comm, value, phase=None, timeout=None, root=None):
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
            raise StallError([r for r in range(size) if r not in got], phase, timeout,
                             speaker=_world_rank(comm, min(got)), comm=comm)
        pause = _sleep_backoff(pause)
    while sends:    # small messages leave at once; this waits on a large one or a full buffer
        sends = [(r, s) for r, s in sends if not s.Test()]
        if sends and time.monotonic() - start > timeout:
            raise StallError([r for r, _ in sends], phase, timeout,
                             detail="its message from this rank was not taken", comm=comm)
        if sends:
            pause = _sleep_backoff(pause)
    return [got[r] for r in range(size)] if root in (None, rank) else None


def collective(comm, fn, *args, phase=None, timeout=None, **kwargs):
    """Run ``fn`` on every rank of ``comm``; if it raised on any rank, all exit 2.

    Returns ``fn``'s value on success. A :class:`UsageError` on some ranks is printed
    once by the lowest failing rank (with its rank when not every rank failed).
    Other exceptions propagate after the agreement, so :func:`run_main` aborts.
    The agreement goes through :func:`exchange` (bounded by ``timeout``).
    """
    error = None
    try:
        value = fn(*args, **kwargs)
    except USER_ERRORS as exc:
        error = ("usage", str(exc))
    except Exception as exc:  # noqa: BLE001 - re-raised below once agreed
        error = ("other", exc)
    report = None if error is None else (error[0], str(error[1]))
    errors = exchange(comm, report, phase=phase, timeout=timeout)
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
def _print_error(message):
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"ringnet: error: {_one_line(message)}", file=sys.stderr, flush=True)


def _one_line(message):
    """``message`` on one line: library messages (h5py's, MPI's) may hold newlines."""
    return " ".join(str(message).split())


def abort(message=None, code=EXIT_FAILURE):
    """Print ``message`` (once, from this rank) and abort the whole MPI job."""
    comm = _world()
    if message:
        prefix = f"[rank {comm.Get_rank()}] " if comm is not None and comm.Get_size() > 1 else ""
        print(f"{prefix}ringnet: error: {_one_line(message)}", file=sys.stderr, flush=True)
    if comm is not None and comm.Get_size() > 1:
        # The launcher kills every process as soon as it learns of the abort; a line still
        # in the pipe to the launcher's forwarder dies with them (seen with MPICH's hydra
        # under load). Wait until the forwarder has read stdout and stderr (bounded), and
        # a moment more for it to pass them on.
        _wait_until_read((1, 2), DRAIN_LIMIT_S)
        time.sleep(ABORT_GRACE_S)
        comm.Abort(code)
    os._exit(code)


def _interrupted():
    """End this rank after Ctrl-C (SIGINT) with one line for the whole job and exit 130.

    Ctrl-C reaches every rank: mpirun passes SIGINT on to each of them (srun does on a
    second Ctrl-C within a second). So each rank ends itself, and rank 0 alone says so.
    Not through MPI_Abort, whose launcher adds its own lines (MPICH: ``Abort(130) on
    node ...`` per rank). Not by exiting at once either: MPICH's mpirun kills the other
    ranks the moment one ends without MPI_Finalize, and a rank it kills shows up as its
    ``BAD TERMINATION`` banner and exit code 9. So the ranks meet, each finalizes MPI
    and exits 130, and mpirun exits 130 without a word. A rank interrupted on its own
    waits FINALIZE_LIMIT_S for the others, then aborts the job with its rank named.
    """
    # The exit must not be interrupted in turn: a second Ctrl-C would print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    mpi = _started_mpi()
    if mpi is None or mpi.COMM_WORLD.Get_rank() == 0:
        _flush()
        os.write(2, b"ringnet: error: interrupted\n")     # one write: never split by another
    _flush()
    if mpi is None:
        os._exit(EXIT_INTERRUPTED)
    # As in abort: a line still in the pipe to the launcher's forwarder dies with the job.
    _wait_until_read((1, 2), DRAIN_LIMIT_S)
    world = mpi.COMM_WORLD
    try:
        # MPI_Finalize fails on a world communicator that still holds messages nobody
        # received (the agreement messages of exchange() from a rank interrupted later
        # than this one), and a rank whose finalize failed counts for mpirun as one that
        # died. Once every rank passed this barrier, no rank sends any more: receive what
        # arrived, then finalize.
        barrier = world.Ibarrier()
        end = time.monotonic() + FINALIZE_LIMIT_S
        pause = 1e-4
        while not barrier.Test():
            if time.monotonic() > end:
                # Interrupted on its own (kill -INT on one rank): the others never came.
                # End the job as a failure does, saying which rank it was.
                abort(None if world.Get_rank() == 0 else "interrupted", code=EXIT_INTERRUPTED)
            pause = _sleep_backoff(pause)
        _discard_messages(mpi, world)
        timer = threading.Timer(FINALIZE_LIMIT_S, os._exit, (EXIT_INTERRUPTED,))
        timer.daemon = True
        timer.start()
        mpi.Finalize()
    except Exception:  # noqa: BLE001 - exiting anyway
        os._exit(EXIT_INTERRUPTED)
    # The C library's exit(), not _exit(): MPICH 5 tells mpirun that this process is done
    # only in its exit handlers, and mpirun kills the other ranks when one ends without
    # that, finalized or not. Python's own shutdown is skipped: it would wait for threads.
    ctypes.CDLL(None).exit(EXIT_INTERRUPTED)


def _discard_messages(mpi, comm):
    """Receive and drop every message that has arrived on ``comm``."""
    status = mpi.Status()
    while comm.iprobe(source=mpi.ANY_SOURCE, tag=mpi.ANY_TAG, status=status):
        comm.Recv(bytearray(status.Get_count(mpi.BYTE)), source=status.Get_source(),
                  tag=status.Get_tag())


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()          # os._exit drops what Python still buffers
        except (OSError, ValueError):
            pass


def _started_mpi():
    """Return mpi4py's MPI module when this process started MPI and has not finalized it
    (None otherwise, without starting it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi
    except Exception:  # noqa: BLE001 - a broken MPI: treat as none
        pass
    return None


def _unread_bytes(fd):
    """Return how many bytes written to pipe ``fd`` its reader has not read (None: not a pipe)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError, struct.error):
        return None


def _wait_until_read(fds, limit_s):
    """Sleep until every pipe among ``fds`` is empty (its reader took the bytes), at most ``limit_s``."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and any(_unread_bytes(fd) for fd in fds):
        time.sleep(0.01)


def _quiet_broken_pipe():
    """Exit quietly when the reader of stdout went away (``... | head``), as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(128 + signal.SIGPIPE)


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
        comm = _world()
        if comm is None or comm.Get_rank() == 0:
            _print_error(str(exc))
        sys.exit(EXIT_USAGE)
    except SystemExit:
        raise
    except BrokenPipeError:
        _quiet_broken_pipe()
    except KeyboardInterrupt:
        _interrupted()
    except TrainingError as exc:
        # Often seen by several ranks at once (a stall, NaN loss): one rank speaks and its
        # abort ends the others before they print. A stall names its speaker (the lowest
        # rank that arrived: every live rank agrees on it); the others wait for its abort,
        # and speak themselves only if it never comes. Otherwise the lowest rank speaks first.
        comm = _world()
        rank = comm.Get_rank() if comm is not None else 0
        speaker = getattr(exc, "speaker", None)
        if speaker is not None and comm is not None and comm.Get_size() > 1:
            if rank != speaker:
                time.sleep(SPEAKER_WAIT_S)
        else:
            time.sleep(0.3 * min(rank, 10))
        abort(str(exc), code=getattr(exc, "exit_code", EXIT_FAILURE))
    except BaseException as exc:  # noqa: BLE001 - last line of defence
        if isinstance(exc, _mpi_exception_type()):
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            abort(f"MPI call failed during {_phase} ({first}); another rank probably exited "
                  "(see its message above)")
        comm = _world()
        rank = comm.Get_rank() if comm is not None else 0
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        text = "".join(f"[rank {rank}] {line}" for chunk in lines for line in chunk.splitlines(True))
        sys.stderr.write(text)
        summary = str(exc) or type(exc).__name__
        abort(f"{type(exc).__name__}: {summary}")
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_broken_pipe()
    sys.exit(code or 0)


class ArgumentParser(argparse.ArgumentParser):
    """The entry points' argument parser: its errors are one-line UsageErrors (exit 2)
    naming the --help to read, instead of argparse's usage dump."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")
