"""Checks for runs started by SLURM's ``srun``."""
import os

from ringnet.errors import EXIT_USAGE, UsageError

__all__ = ["check_world_size"]


def check_world_size(size, environ=None):
    """Raise UsageError when ``srun`` started several tasks but MPI sees a world of one.

    That happens when srun and the MPI library share no process-management interface
    (PMI): every task then starts as its own one-rank MPI job and would train alone.
    Only task 0 reports it, so the job log holds one line; the other tasks exit 2 quietly.
    """
    environ = os.environ if environ is None else environ
    try:
        tasks = int(environ.get("SLURM_STEP_NUM_TASKS", "1"))
    except ValueError:
        return
    if size != 1 or tasks <= 1:
        return
    if environ.get("SLURM_PROCID", "0") != "0":
        raise SystemExit(EXIT_USAGE)
    raise UsageError(f"srun started {tasks} tasks but MPI sees a world of 1 rank in each: srun "
                     "and this MPI library share no PMI; use `srun --mpi=pmi2` (MPICH) or "
                     "`--mpi=pmix` (Open MPI), or MpiDefault in slurm.conf")
