"""pytest plugin of the GPU acceptance run (``-p mpi_abort``): under mpirun, a rank whose
test fails prints its error and aborts the job, so ranks waiting for it in a collective end
now, with that error in the log, instead of at the stage's time limit.

The abort can end the launcher before it has passed the rank's last output on, so the
line also goes to the file named by ``RINGNET_STAGE_ABORTS`` (set by tests/gpu/stage.sh),
which the stage's row reads."""
import os
import sys


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi.COMM_WORLD.Get_size() < 2:
        return
    rank = mpi.COMM_WORLD.Get_rank()
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    last = next((line for line in reversed(text.splitlines()) if line.startswith("E ")), "")
    line = f"rank {rank} FAILED {report.nodeid} ({report.when}): {last[1:].strip()}"
    aborts = os.environ.get("RINGNET_STAGE_ABORTS")
    if aborts:
        fd = os.open(aborts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (line + "\n").encode())      # one write: lines of ranks never mix
            os.fsync(fd)
        finally:
            os.close(fd)
    sys.stderr.write(f"{text}\n{line}; aborting the job\n")
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)
