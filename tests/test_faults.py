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

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return faults.prepare(str(tmp_path_factory.mktemp("faults")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", faults.quick_cases(), ids=lambda c: c.name)
def test_fault(case, files):
    outcome = faults.run_case(case, files)
    assert outcome.ok, "; ".join(outcome.problems) + "\n" + outcome.output[-3000:]


def test_full_matrix_covers_every_phase_mode_and_size():
    names = [c.name for c in faults.all_cases()]
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
