"""MPI's start-up bounded (ringnet.start_watch): a rank whose MPI_Init never returns ends
after the deadline, rank 0 with one line, instead of hanging for good.

The process manager that never answers is emulated: ``PMI_FD`` names one end of a socket
pair whose other end nobody reads, so MPICH's PMI client sends its first request and waits
for the answer inside MPI_Init, holding Python's lock, as it does when SLURM's PMI2 plugin
misreads a request.
"""
import os
import socket
import subprocess
import sys
import time

import pytest

from ringnet import start_watch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _silent_manager(rank, args=("-m", "ringnet.train", "--steps", "2"), seconds="2"):
    a, b = socket.socketpair()
    env = dict(os.environ, PMI_FD=str(a.fileno()), PMI_RANK=str(rank), PMI_SIZE="2",
               RINGNET_COMM_TIMEOUT=seconds)
    for name in ("SLURM_PROCID", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        env.pop(name, None)
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, *args], pass_fds=(a.fileno(),), env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=90)
    finally:
        a.close()
        b.close()
    return proc, time.monotonic() - start


@pytest.mark.parametrize("rank", [0, 1])
def test_a_start_up_that_never_ends_is_ended_after_the_deadline(rank):
    proc, seconds = _silent_manager(rank)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])
    assert 2 <= seconds < 30, seconds
    assert proc.stdout == ""
    if rank == 0:
        assert proc.stderr == start_watch.MESSAGE.format(seconds=2.0), proc.stderr
    else:
        assert proc.stderr == "", proc.stderr          # one line for the job: rank 0's


def test_the_calibration_worker_is_bounded_too():
    proc, _ = _silent_manager(0, ("-m", "ringnet.bench", "model", "--calibrate-worker"))
    assert proc.returncode == -9 and "MPI start-up (MPI_Init) did not finish" in proc.stderr, \
        proc.stderr[-2000:]


WATCHER = """
import os, sys, time
from ringnet import start_watch
start_watch.watch({seconds})
pid = start_watch._watcher[0]
print(pid, flush=True)
{then}
"""


def _gone(pid, within=5.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True         # exited; its parent is gone or about to reap it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_start_that_comes_up_ends_its_watcher_and_keeps_running():
    then = "start_watch.up(); time.sleep(3); print('alive', flush=True)"
    proc = subprocess.run([sys.executable, "-c", WATCHER.format(seconds=1, then=then)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    pid = int(proc.stdout.split()[0])
    assert proc.returncode == 0 and proc.stdout.split()[1] == "alive", proc.stderr
    assert _gone(pid, 0.1)
    start_watch.up()            # no watch here: a no-op


def test_a_program_that_ends_before_mpi_is_up_takes_its_watcher_along():
    then = "os._exit(4)"
    proc = subprocess.run([sys.executable, "-c", WATCHER.format(seconds=60, then=then)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4
    assert _gone(int(proc.stdout.split()[0]))


def test_the_deadline_and_the_rank_come_from_the_environment():
    assert start_watch.start_timeout({}) == 300.0
    assert start_watch.start_timeout({"RINGNET_COMM_TIMEOUT": "12.5"}) == 12.5
    for bad in ("0", "-1", "nan", "inf", "abc", ""):
        assert start_watch.start_timeout({"RINGNET_COMM_TIMEOUT": bad}) == 300.0
    assert start_watch.launcher_rank({}) is None
    assert start_watch.launcher_rank({"SLURM_PROCID": "3"}) == 3
    assert start_watch.launcher_rank({"PMI_RANK": "0", "SLURM_PROCID": "3"}) == 0
    assert start_watch.launcher_rank({"PMI_RANK": "x", "PMIX_RANK": "2"}) == 2
