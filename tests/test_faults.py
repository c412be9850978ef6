"""Fault injection (the CI subset of `python -m ringnet.bench faults`): no hang, one line, nothing left behind.

Each case starts ``python -m ringnet.train`` under mpirun (or alone) with one fault: a
rank stopped or killed on entering a phase, ranks started with different settings
(MPMD), or a bad file, flag or environment value. The case passes when the exit code
and the single ``ringnet: error:`` line are the expected ones, the job ended within
its bound, no process of the run is left, and the checkpoint at ``--save`` is intact
with no temporary file beside it (a killed writer's is recognised as stale). The
reference is the fault itself: the stopped rank is known, so the message must name it.
"""
import shutil

import pytest

from ringnet.bench import faults
from conftest import launcher_free_env

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")

# The runs' transfer deadline (RINGNET_COMM_TIMEOUT): shorter than the benchmark's, since a
# stalled-rank case takes a few deadlines; long enough for 4 ranks on 2 busy cores.
CI_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return faults.prepare(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", faults.quick_cases(), ids=lambda c: c.name)
def test_fault(case, files):
    outcome = faults.run_case(case, files, timeout=CI_TIMEOUT)
    assert outcome.ok, "; ".join(outcome.problems) + "\n" + outcome.output[-3000:]


def test_full_matrix_covers_every_phase_mode_and_size():
    names = [c.name for c in faults.all_cases()]
    kinds = {c.kind for c in faults.all_cases()}
    assert {"signal", "concurrent"} <= kinds
    # signals at moments spread over the first two seconds, both signals, both launchers
    signals = [c for c in faults.all_cases() if c.kind == "signal"]
    moments = sorted(c.at for c in signals)
    assert moments[0] < 0.3 and moments[-1] > 1.7 and len(moments) >= 8
    assert {(c.signal, c.via) for c in signals} == {(s, v) for s in ("TERM", "USR1")
                                                     for v in ("mpirun", "launch")}
    assert any(c.trigger == "signal-twice" for c in signals)
    for flag in ("--save is --dataset", "--trace is --dataset", "--json-file is --save",
                 "--save a FIFO", "--save ends in /"):
        assert any(name.startswith(f"collision {flag} ") for name in names), flag
    for phase in faults.STOP_PHASES:
        for mode in faults.MODES:
            for n in (2, 4):
                assert any(name.startswith(f"stop {phase} ") and f" {mode} N={n}" in name
                           for name in names), (phase, mode, n)


def test_info_into_a_closed_pipe_exits_quietly(tmp_path):
    """`python -m ringnet.datasets info F | head -1`: no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    import numpy as np

    from ringnet.data.hdf5 import write_dataset
    classes = [f"c{i}" for i in range(3000)]                    # > 64 KiB of table rows
    labels = np.arange(3000)
    images = np.zeros((3000, 1, 2, 2), np.uint8)
    path = tmp_path / "many.h5"
    write_dataset(path, images, labels, images[:10], labels[:10], classes)
    proc = subprocess.Popen([sys.executable, "-m", "ringnet.datasets", "info", "--verify", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    first = proc.stdout.readline()
    proc.stdout.close()                                          # what `head -1` does
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first.startswith(b"file "), first
    assert stderr == "", stderr
    assert proc.returncode == 141


def test_abort_waits_until_the_launcher_read_the_error_line(tmp_path):
    """abort() holds MPI_Abort until the reader of the rank's stderr pipe took the line,
    and gives up at its limit when nobody reads."""
    import os
    import threading
    import time

    from ringnet import shutdown
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"ringnet: error: something\n")
        assert shutdown.unread_bytes(write_end) == 26
        start = time.monotonic()
        shutdown.wait_until_read([write_end], 0.5)               # nobody reads: the limit
        assert 0.5 <= time.monotonic() - start < 30
        threading.Timer(0.3, os.read, (read_end, 100)).start()   # the launcher reads later
        start = time.monotonic()
        shutdown.wait_until_read([write_end], 60)
        assert shutdown.unread_bytes(write_end) == 0 and time.monotonic() - start < 30
    finally:
        os.close(read_end)
        os.close(write_end)
    plain = tmp_path / "log"
    with open(plain, "w") as f:
        assert shutdown.unread_bytes(f.fileno()) is None          # not a pipe: nothing to wait for


def test_a_stall_is_reported_once_by_the_lowest_rank_that_arrived(tmp_path):
    """Rank 2 never arrives; rank 1 notices 3 s before rank 0. The one error line comes
    from rank 0 (every live rank agrees it speaks) and names rank 2; rank 1 stays quiet
    while waiting for rank 0's abort. (With a stagger by rank, rank 1 spoke first.)"""
    import subprocess
    import sys
    import time
    script = tmp_path / "stall.py"
    script.write_text(
        "import time\n"
        "from mpi4py import MPI\n"
        "from ringnet.cli import run_main\n"
        "from ringnet.control import agree\n"
        "def main(argv):\n"
        "    comm = MPI.COMM_WORLD\n"
        "    rank = comm.Get_rank()\n"
        "    if rank == 2:\n"
        "        time.sleep(120)\n"
        "    agree(comm, rank, phase='the test phase', timeout=4.0 if rank == 0 else 1.0)\n"
        "run_main(main)\n")
    env = launcher_free_env("RINGNET_")
    start = time.monotonic()
    proc = subprocess.run(["mpirun", "-np", "3", sys.executable, str(script)], capture_output=True,
                          text=True, timeout=180, env=env)
    seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "ringnet: error:" in line]
    assert proc.returncode == 1, output
    assert len(lines) == 1 and lines[0].startswith("[rank 0] ringnet: error: rank 2 did not "
                                                   "arrive at the test phase within 4 s"), output
    assert "Traceback" not in output
    assert seconds < 90, f"took {seconds:.0f} s"


def test_the_srun_cases_come_with_slurm_only_and_run_under_ringnet_launch(monkeypatch):
    """The srun cases (`bench faults --slurm`): ringnet.launch starts the ranks with srun and
    relaunches at most once; each names the exit it must end with; without SLURM's client
    commands --slurm is one line, before any case runs."""
    assert not any(c.kind == "srun" for c in faults.all_cases() + faults.quick_cases())
    cases = [c for c in faults.all_cases(slurm=True) if c.kind == "srun"]
    assert cases == [c for c in faults.quick_cases(slurm=True) if c.kind == "srun"]
    assert sorted(c.code for c in cases if c.code is not None) == [2, 2, 3, faults.EXIT_STOPPED]
    assert [c.name for c in cases if c.launcher_message] == ["srun a rank killed at step 3: relaunched N=2"]
    cmd = faults._command(cases[0], "/files", "/run/ck.h5", "python", "mpirun")
    assert cmd[:10] == ["python", "-m", "ringnet.launch", "-n", "2", "--launcher",
                        "srun --mpi=pmi2", "--max-restarts", "1", "--"]
    assert cmd[10:12] == ["--steps", "6"] and "--lr" in cmd and "--save" in cmd
    real = faults.shutil.which
    monkeypatch.setattr(faults.shutil, "which", lambda name: None if name == "srun" else real(name))
    with pytest.raises(faults.UsageError, match=r"^--slurm: srun and sinfo not found"):
        faults.main(["--slurm", "--filter", "srun"])
