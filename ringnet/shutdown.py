"""How a rank ends the whole job: one error line that reaches the terminal, then MPI_Abort;
after Ctrl-C, one ``interrupted`` line and exit 130 without the launcher's own banners.

A line still in the pipe to the launcher's forwarder dies with the job when the launcher
kills the ranks, so :func:`abort` waits (bounded) until the forwarder has read stdout and
stderr before it aborts. This module imports only :mod:`ringnet.errors` from ringnet: the
transports (the NCCL watchdog) end the job through it too.
"""
import ctypes
import fcntl
import os
import signal
import stat
import struct
import sys
import termios
import threading
import time

from ringnet.errors import EXIT_FAILURE, EXIT_INTERRUPTED

__all__ = ["abort", "interrupted", "print_error", "one_line", "world", "started_mpi",
           "note_exit", "noted_exit", "EXIT_RECORD_AT",
           "sleep_backoff", "flush", "wait_until_read", "unread_bytes", "quiet_broken_pipe", "ABORT_GRACE_S", "DRAIN_LIMIT_S",
           "FINALIZE_LIMIT_S"]

ABORT_GRACE_S = 0.25  # seconds between the error line leaving the pipe and MPI_Abort (see abort)
DRAIN_LIMIT_S = 10.0  # at most this long for the launcher to read the error line (see abort)
FINALIZE_LIMIT_S = 10.0  # an interrupted rank waits this long for the others (see interrupted)
# Where in ``$RINGNET_HEARTBEAT`` (after the step count's record) a rank notes the exit code
# it ends the job with (see note_exit).
EXIT_RECORD_AT = 24


def note_exit(code):
    """Note the exit code this rank ends the job with in ``$RINGNET_HEARTBEAT`` (when set).

    srun gives the launcher its own code for a job whose rank aborted (137 for a rank it
    killed after another's MPI_Abort), so a diverged run (3) or bad input (2) would look
    like a lost rank and be relaunched; the launcher reads this record instead
    (:func:`noted_exit`). Best effort: a file that cannot be written changes nothing."""
    path = os.environ.get("RINGNET_HEARTBEAT")
    if not path or code in (None, 0):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, f"{int(code):7d}\n".encode(), EXIT_RECORD_AT)
        finally:
            os.close(fd)
    except OSError:
        pass


def noted_exit(path):
    """The exit code a rank noted in the heartbeat file ``path`` (:func:`note_exit`), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(EXIT_RECORD_AT)
            text = f.read(8)
        return int(text) if text.strip() else None
    except (OSError, ValueError):
        return None


def world():
    """Return MPI_COMM_WORLD (None where mpi4py cannot load)."""
    try:
        from mpi4py import MPI
    except Exception:  # pragma: no cover - mpi4py is a hard dependency
        return None
    return MPI.COMM_WORLD


def sleep_backoff(pause):
    """Sleep ``pause`` seconds; return the next pause of a polling loop (doubling, at most 10 ms)."""
    time.sleep(pause)
    return min(0.01, pause * 2 + 1e-4)


def print_error(message):
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"ringnet: error: {one_line(message)}", file=sys.stderr, flush=True)


def one_line(message):
    """``message`` on one line: library messages (h5py's, MPI's) may hold newlines."""
    return " ".join(str(message).split())


def abort(message=None, code=EXIT_FAILURE):
    """Print ``message`` (once, from this rank) and abort the whole MPI job."""
    note_exit(code)
    comm = world()
    if message:
        prefix = f"[rank {comm.Get_rank()}] " if comm is not None and comm.Get_size() > 1 else ""
        print(f"{prefix}ringnet: error: {one_line(message)}", file=sys.stderr, flush=True)
    if comm is not None and comm.Get_size() > 1:
        # The launcher kills every process as soon as it learns of the abort; a line still
        # in the pipe to the launcher's forwarder dies with them (seen with MPICH's hydra
        # under load). Wait until the forwarder has read stdout and stderr (bounded), and
        # a moment more for it to pass them on.
        wait_until_read((1, 2), DRAIN_LIMIT_S)
        time.sleep(ABORT_GRACE_S)
        comm.Abort(code)
    os._exit(code)


def interrupted():
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
    mpi = started_mpi()
    if mpi is None or mpi.COMM_WORLD.Get_rank() == 0:
        flush()
        os.write(2, b"ringnet: error: interrupted\n")     # one write: never split by another
    flush()
    if mpi is None:
        os._exit(EXIT_INTERRUPTED)
    # As in abort: a line still in the pipe to the launcher's forwarder dies with the job.
    wait_until_read((1, 2), DRAIN_LIMIT_S)
    comm = mpi.COMM_WORLD
    try:
        # MPI_Finalize fails on a world communicator that still holds messages nobody
        # received (the agreement messages of agree() from a rank interrupted later
        # than this one), and a rank whose finalize failed counts for mpirun as one that
        # died. Once every rank passed this barrier, no rank sends any more: receive what
        # arrived, then finalize.
        barrier = comm.Ibarrier()
        end = time.monotonic() + FINALIZE_LIMIT_S
        pause = 1e-4
        while not barrier.Test():
            if time.monotonic() > end:
                # Interrupted on its own (kill -INT on one rank): the others never came.
                # End the job as a failure does, saying which rank it was.
                abort(None if comm.Get_rank() == 0 else "interrupted", code=EXIT_INTERRUPTED)
            pause = sleep_backoff(pause)
        _discard_messages(mpi, comm)
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


def flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()          # os._exit drops what Python still buffers
        except (OSError, ValueError):
            pass


def started_mpi():
    """Return mpi4py's MPI module when this process started MPI and has not finalized it
    (None otherwise, without starting it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi
    except Exception:  # noqa: BLE001 - a broken MPI: treat as none
        pass
    return None


def unread_bytes(fd):
    """Return how many bytes written to pipe ``fd`` its reader has not read (None: not a pipe)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError, struct.error):
        return None


def wait_until_read(fds, limit_s):
    """Sleep until every pipe among ``fds`` is empty (its reader took the bytes), at most ``limit_s``."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and any(unread_bytes(fd) for fd in fds):
        time.sleep(0.01)


def quiet_broken_pipe():
    """Exit quietly when the reader of stdout went away (``... | head``), as Unix tools do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(128 + signal.SIGPIPE)
