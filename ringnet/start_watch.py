"""MPI's start-up, bounded: a rank whose MPI_Init does not return ends with one line.

MPI_Init waits for the launcher's process manager (hydra's proxy, slurmstepd's PMI
server) to answer, and holds Python's global interpreter lock while it waits: no Python
thread, timer or signal handler of the rank runs until it returns. Where the manager never
answers (SLURM's ``--mpi=pmi2`` plugin now and then misreads one of MPICH's long PMI-1
lines, then waits for the rest of it; its slurmd log says "mpi/pmi2: value not properly
terminated in client request"), the job would hang in start-up for good.

:func:`watch` therefore forks a watcher *process* before the program's first MPI import: it
waits, on a pipe, for the rank to say that MPI is up (:func:`up`); if that does not come
within the deadline (``RINGNET_COMM_TIMEOUT``, default 300 s), rank 0 (as the launcher's
environment numbers it) writes one line, and every watcher kills its rank, which the
launcher sees as a lost rank (``ringnet.launch`` relaunches it). A rank that ends before
MPI is up closes the pipe, and its watcher ends with it. Only the standard library is
imported here.
"""
import math
import os
import select
import signal
import warnings

__all__ = ["watch", "up", "start_timeout", "launcher_rank", "STALLED", "MESSAGE"]

STALLED = "ringnet: error: MPI start-up (MPI_Init) did not finish"     # what the line starts with
MESSAGE = (STALLED + " within {seconds:g} s: the "
           "launcher's process manager stopped answering (under srun --mpi=pmi2 with MPICH, "
           "slurmd's log says 'mpi/pmi2: value not properly terminated'; a relaunch "
           "usually starts; deadline: RINGNET_COMM_TIMEOUT)\n")
# the rank as launchers number it before MPI is up: hydra, SLURM, PMIx, Open MPI
RANK_VARIABLES = ("PMI_RANK", "SLURM_PROCID", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")

_watcher = None         # (pid, write end of the pipe) while a watch runs


def start_timeout(environ=None):
    """The seconds MPI's start-up may take: ``RINGNET_COMM_TIMEOUT`` (default 300; a value
    that is not a positive number counts as the default here, and is refused with one line
    once the run checks its environment)."""
    value = (os.environ if environ is None else environ).get("RINGNET_COMM_TIMEOUT", "")
    try:
        seconds = float(value)
    except ValueError:
        return 300.0
    return seconds if 0 < seconds < math.inf else 300.0


def launcher_rank(environ=None):
    """This process's rank as the launcher's environment gives it, or None."""
    env = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def watch(seconds=None):
    """Start watching this process's MPI start-up (once; call before the first MPI import).
    ``seconds``: the deadline (default :func:`start_timeout`)."""
    global _watcher
    if _watcher is not None or not hasattr(os, "fork"):
        return
    seconds = start_timeout() if seconds is None else float(seconds)
    parent = os.getpid()
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():     # (the watcher calls nothing a thread could hold)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:                        # the watcher: the standard library only, then _exit
        try:
            for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                signal.signal(signum, signal.SIG_DFL)
            os.close(write_end)
            ready, _, _ = select.select([read_end], [], [], seconds)
            if not ready and os.getppid() == parent:
                if launcher_rank() in (None, 0):
                    os.write(2, MESSAGE.format(seconds=seconds).encode())
                os.kill(parent, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read_end)
    _watcher = (pid, write_end)


def up():
    """MPI is up: end the watch (a no-op where none runs)."""
    global _watcher
    if _watcher is None:
        return
    pid, write_end = _watcher
    _watcher = None
    os.close(write_end)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
