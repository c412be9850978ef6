"""A failing rank ends the whole MPI job promptly, with its traceback once (run under mpirun)."""
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_job(tmp_path, body, np_=2, env=None, limit=60):
    """Run ``body`` as a ringnet entry point under mpirun; return (code, output, seconds)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        import numpy as np
        from ringnet.comm import create
        from ringnet.cli import run_main

        def main(argv):
        """) + textwrap.indent(textwrap.dedent(body), "    ") + "\nrun_main(main)\n")
    # A clean environment: the test process may itself be an MPI singleton.
    clean = launcher_free_env()
    clean.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + clean.get("PYTHONPATH", ""))
    clean.update(env or {})
    start = time.perf_counter()
    proc = subprocess.run(["mpirun", "-np", str(np_), sys.executable, str(script)],
                          capture_output=True, text=True, timeout=limit, env=clean)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def test_exception_on_one_rank_aborts_job(tmp_path):
    code, output, seconds = run_job(tmp_path, """
        comm = create("ring", transport="mpi")
        buf = np.ones(1 << 20, np.float32)
        comm.allreduce(buf)
        if comm.rank == 1:
            raise ValueError("boom on purpose")
        comm.allreduce(buf)  # rank 0 waits here for a peer that is gone
        time.sleep(60)
        """, env={"RINGNET_COMM_TIMEOUT": "120"})
    assert code != 0, output
    assert seconds < 30, f"job took {seconds:.1f} s to end"
    assert output.count("[rank 1] Traceback") == 1, output
    assert "[rank 1] ValueError: boom on purpose" in output, output
    assert "[rank 0] Traceback" not in output, output


def test_transfer_timeout_aborts_job_with_peer_and_size(tmp_path):
    code, output, seconds = run_job(tmp_path, """
        comm = create("ring", transport="mpi")
        if comm.rank == 0:
            comm.transport.recv(np.empty(1024, np.float32), 1)  # rank 1 never sends
        time.sleep(60)
        """, env={"RINGNET_COMM_TIMEOUT": "1"})
    assert code != 0, output
    assert seconds < 30, f"job took {seconds:.1f} s to end"
    assert "CommTimeoutError: recv from rank 1 of 4096 bytes did not complete within 1 s" in output, output
    assert output.count("[rank 0] Traceback") == 1, output
