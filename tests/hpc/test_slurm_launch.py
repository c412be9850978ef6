"""launch/local.sh: ranks on this node, by rank count or by usable cores, also inside a SLURM step.

Reference: the same run under plain ``mpirun`` (identical loss).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from test_slurm import SLURM_ENV, needs_slurm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCAL = os.path.join(ROOT, "launch", "local.sh")
TRAIN = ["--steps", "4", "--no-eval", "--json", "--seed", "5"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
           PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
# A workstation without GPUs: no nvidia-smi on the PATH the script sees.
NO_GPU = dict(ENV, PATH=os.pathsep.join(p for p in ENV["PATH"].split(os.pathsep)
                                        if not os.path.exists(os.path.join(p, "nvidia-smi"))))


def summary_of(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])


@pytest.fixture(scope="module")
def reference():
    proc = subprocess.run(["mpirun", "-np", "2", sys.executable, "-m", "ringnet.train", *TRAIN],
                          capture_output=True, text=True, env=ENV, timeout=300)
    return summary_of(proc)


def test_local_sh_with_a_rank_count(reference):
    proc = subprocess.run(["bash", LOCAL, "-n", "2", *TRAIN], capture_output=True, text=True,
                          env=NO_GPU, timeout=300)
    summary = summary_of(proc)
    assert summary["ranks"] == 2 and summary["mode"] == "ring"
    assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)


@pytest.mark.skipif(shutil.which("taskset") is None or (os.cpu_count() or 1) < 2,
                    reason="needs taskset and two cores")
def test_local_sh_without_gpus_runs_one_rank_per_usable_core(reference):
    proc = subprocess.run(["taskset", "-c", "0,1", "bash", LOCAL, *TRAIN], capture_output=True,
                          text=True, env=NO_GPU, timeout=300)
    summary = summary_of(proc)
    assert summary["ranks"] == 2
    assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)


@needs_slurm
def test_local_sh_inside_an_srun_step(reference):
    env = dict(SLURM_ENV, PATH=NO_GPU["PATH"])
    proc = subprocess.run(["srun", "-n", "1", "-c", "2", "--time=10", "bash", LOCAL, "-n", "2",
                           *TRAIN], capture_output=True, text=True, env=env, timeout=300)
    summary = summary_of(proc)
    assert summary["ranks"] == 2
    assert summary["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-6)
