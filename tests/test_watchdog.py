"""A test that hangs inside MPI ends its mpirun stage instead of holding it (pyproject.toml's
faulthandler settings; pytest-timeout's signal cannot interrupt a blocked MPI call)."""
import os
import shutil
import subprocess
import sys
import time
import tomllib

import pytest

from conftest import launcher_free_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")

HANGING_TEST = '''
import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_waits_for_a_peer_that_never_sends():
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        comm.recv(source=1, tag=7)      # rank 1 is in a barrier rank 0 never joins
    else:
        comm.Barrier()
'''


def _ini():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["pytest"]["ini_options"]


def test_the_exit_watchdog_comes_after_pytest_timeouts_chance():
    ini = _ini()
    assert ini["faulthandler_exit_on_timeout"] is True
    assert float(ini["faulthandler_timeout"]) > float(ini["timeout"]) > 0


@needs_mpirun
def test_a_rank_blocked_in_mpi_ends_the_stage_and_names_the_test(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    # The project's own configuration (-c), with the two limits shortened; whether the
    # process exits comes from pyproject.toml's faulthandler_exit_on_timeout. Rank 1's
    # watchdog is set later than rank 0's: two ranks dumping their stacks at the same
    # moment interleave faulthandler's many small writes in mpirun's output, which then
    # need not hold the test's name in one piece. Rank 0's exit ends the job first.
    def rank(faulthandler_timeout):
        return ["-np", "1", sys.executable, "-m", "pytest", "-q", "--with-mpi",
                "-p", "no:cacheprovider", "-c", os.path.join(ROOT, "pyproject.toml"),
                "--rootdir", str(tmp_path), "-o", "timeout=2",
                "-o", f"faulthandler_timeout={faulthandler_timeout}", "test_hang.py"]
    cmd = ["mpirun", *rank(6), ":", *rank(40)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=90,
                              env=launcher_free_env())
    except subprocess.TimeoutExpired:
        pytest.fail("the stage hung: the blocked rank was not ended by the watchdog")
    elapsed = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "Timeout (0:00:06)!" in out and "Timeout (0:00:40)!" not in out, out[-2000:]
    assert "in test_waits_for_a_peer_that_never_sends" in out, out[-2000:]
    assert elapsed < 60, elapsed
