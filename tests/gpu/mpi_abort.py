"""pytest plugin of the GPU acceptance run (``-p mpi_abort``): under mpirun, a rank whose
test fails prints its error and aborts the job, so ranks waiting for it in a collective end
now, with that error in the log, instead of at the stage's time limit."""
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
    sys.stderr.write(f"{text}\nrank {rank} FAILED {report.nodeid} ({report.when}): "
                     f"{last[1:].strip()}; aborting the job\n")
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)
