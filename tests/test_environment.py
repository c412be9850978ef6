"""Environment variables that shape a run (ringnet.environment): a bad value is one line
before any work, and ranks that were given different values exit 2 naming the variable."""
import subprocess
import sys

import pytest

from conftest import ENV, launcher_free_env

TRAIN = [sys.executable, "-m", "ringnet.train", "--steps", "2", "--quiet"]


@pytest.mark.parametrize("name, value, needle", [
    ("RINGNET_COMM_TIMEOUT", "1e300", "too large: at most 100000000 seconds"),
    ("RINGNET_COMM_TIMEOUT", "x", "not a positive number"),
    ("RINGNET_CPU_PROGRESS", "fast", "use one of driven, poll, block"),
    ("RINGNET_BUCKET_BYTES", "1k", "not a number of bytes"),
    ("RINGNET_DATA_IN_MEMORY_MB", "lots", "not a whole number of MiB"),
    ("RINGNET_CUDA_AWARE_MPI", "yes", "use 0 or 1"),
    ("RINGNET_PROGRESS_SECONDS", "soon", "not a number of seconds"),
    ("RINGNET_NCCL", "fake", "use standin"),
    ("RINGNET_SAVE_SYNC", "2", "use 0 or 1"),
    ("RINGNET_MALLOC", "yes", "use 0 or 1"),
])
def test_a_bad_value_is_one_line_naming_it(name, value, needle):
    proc = subprocess.run(TRAIN, capture_output=True, text=True, timeout=120,
                          env=dict(ENV, **{name: value}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"ringnet: error: {name}="), proc.stderr
    assert needle in lines[0]


@pytest.mark.parametrize("name, value", [("RINGNET_BUCKET_BYTES", "0"),
                                         ("RINGNET_CPU_PROGRESS", "poll"),
                                         ("RINGNET_COMM_TIMEOUT", "100")])
def test_ranks_given_different_knobs_exit_2_naming_the_variable(name, value):
    env = launcher_free_env()
    env.update(OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    args = ["--steps", "2", "--quiet", "--mode", "ring", "--delay", "0"]
    cmd = ["mpirun", "-np", "1", "-env", name, value, sys.executable, "-m", "ringnet.train", *args,
           ":", "-np", "1", sys.executable, "-m", "ringnet.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ringnet: error:")]
    assert len(lines) == 1, proc.stderr
    assert f"{name} is '{value}' on rank 0 but unset on rank(s) 1" in lines[0], lines[0]
