"""BLAS threads per rank (ringnet.blas): the node's cores shared among its ranks, read from
what MPI launchers and srun set, and shown in the header and the --json summary."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringnet.blas import blas_threads_for_rank
from ringnet.placement import local_ranks_on_node, slurm_tasks_per_node

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, node, expected", [
    ("4", 0, 4), ("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("3,1(x2)", 2, 1),
    ("2(x3),1", 4, None), ("", 0, None), ("x", 0, None), ("2(xa)", 0, None), ("0", 0, None),
])
def test_slurm_task_lists(text, node, expected):
    assert slurm_tasks_per_node(text, node) == expected


@pytest.mark.parametrize("env, expected", [
    ({}, 1),
    ({"MPI_LOCALNRANKS": "3", "SLURM_STEP_TASKS_PER_NODE": "2"}, 3),     # the MPI launcher first
    ({"SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4"}, 2),  # srun -n 2, no --ntasks-per-node
    ({"SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_NODEID": "1"}, 3),
    ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}, 1),
    ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
    ({"MPI_LOCALNRANKS": "", "OMPI_COMM_WORLD_LOCAL_SIZE": "x", "SLURM_NTASKS_PER_NODE": "2"}, 2),
])
def test_ranks_on_this_node(env, expected):
    assert local_ranks_on_node(env) == expected


@pytest.mark.parametrize("env, cores, expected", [
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}, 2, 1),            # the 15x slow case
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2"}, 16, 8),
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_CPUS_PER_TASK": "4"}, 16, 4),
    ({"SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "8"}, 4, 4),        # never more than the affinity
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4",
      "SLURM_CPUS_PER_TASK": "4"}, 2, 1),           # a node claiming 16 CPUs on 2 cores
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4",
      "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, 3, 3),                       # srun bound each task
    ({"SLURM_STEP_TASKS_PER_NODE": "4", "SLURM_CPU_BIND_TYPE": "none"}, 8, 2),
    ({"RINGNET_BLAS_THREADS": "5", "SLURM_CPUS_PER_TASK": "2", "SLURM_STEP_ID": "0"}, 2, 5),
    ({"RINGNET_BLAS_THREADS": "", "MPI_LOCALNRANKS": "4"}, 2, 1),
])
def test_threads_per_rank(env, cores, expected):
    assert blas_threads_for_rank(env, cores=cores) == expected


@pytest.mark.parametrize("env, cores, quota, expected", [
    ({}, 2, 0.5, 1),                                   # a node of half a core: one thread
    ({}, 2, None, 2),
    ({}, 16, 4.0, 4),                                  # docker --cpus 4 on 16 cores
    ({}, 16, 3.99, 3),
    ({"MPI_LOCALNRANKS": "2"}, 16, 4.0, 2),            # the quota is the node's, shared
    ({"MPI_LOCALNRANKS": "4"}, 16, 2.0, 1),
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
      "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, 8, 4.0, 2),  # bound to 8 cores, a quota of 2 each
    ({"RINGNET_BLAS_THREADS": "3"}, 2, 0.5, 3),        # asked for: as asked
])
def test_a_cpu_quota_caps_the_threads(env, cores, quota, expected):
    assert blas_threads_for_rank(env, cores=cores, quota=quota) == expected


def _header_and_summary(env):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMP_", "OPENBLAS_NUM", "MKL_NUM", "RINGNET_BLAS",
                                 "MPI_LOCAL", "PMI_", "OMPI_"))}
    cmd = [sys.executable, "-m", "ringnet.train", "--steps", "1", "--no-progress", "--json"]
    proc = subprocess.run(["taskset", "-c", "0,1", *cmd], capture_output=True, text=True,
                          cwd=ROOT, env=dict(base, **env), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr.splitlines()[0], json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not shutil.which("taskset") or (os.cpu_count() or 1) < 2,
                    reason="needs taskset and 2 cores")
def test_an_srun_task_without_ntasks_per_node_shares_the_cores():
    header, summary = _header_and_summary({})
    assert ", 2 BLAS threads per rank," in header and summary["blas_threads"] == 2, header
    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2"}
    header, summary = _header_and_summary(srun)
    assert ", 1 BLAS thread per rank," in header and summary["blas_threads"] == 1, header
    # an empty OMP_NUM_THREADS (export OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK without the flag)
    header, summary = _header_and_summary(dict(srun, OMP_NUM_THREADS=""))
    assert summary["blas_threads"] == 1, header
