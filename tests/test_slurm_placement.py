"""ringnet.placement reads what SLURM says of where tasks run, in SLURM's own forms: the
tasks-per-node lists ("2(x3),1"), the step's list before the allocation's,
``--ntasks-per-node`` alone, and ``--distribution=cyclic``. The launcher's relaunch size
(ringnet.hosts) and the BLAS threads' share (ringnet.blas) read the same answers."""
import subprocess

import pytest

from ringnet import placement
from ringnet.hosts import JobNodes


@pytest.mark.parametrize("text, counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2(x3)", [1, 2, 2, 2]), ("3(x2)", [3, 3]),
    ("", None), (None, None), ("two", None), ("0", None), ("2(x0)", None), ("2(x", None),
])
def test_task_counts_read_slurm_s_lists(text, counts):
    assert placement.slurm_task_counts(text) == counts


UNEVEN = {"SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_STEP_NUM_TASKS": "7",
          "SLURM_TASKS_PER_NODE": "4(x2)"}


def test_block_and_cyclic_placement_of_an_uneven_step():
    """The step's own list wins over the allocation's; block fills each node in turn,
    cyclic deals the tasks round the nodes, skipping a node once it is full."""
    assert placement.slurm_rank_nodes(UNEVEN) == [0, 0, 1, 1, 2, 2, 3]
    cyclic = dict(UNEVEN, SLURM_DISTRIBUTION="cyclic")
    assert placement.slurm_rank_nodes(cyclic) == [0, 1, 2, 3, 0, 1, 2]
    assert placement.slurm_rank_nodes(dict(cyclic, SLURM_DISTRIBUTION="cyclic:block")) == \
        [0, 1, 2, 3, 0, 1, 2]
    # a node's count of tasks is its entry of the list, whichever the distribution
    for env in (UNEVEN, cyclic):
        nodes = placement.slurm_rank_nodes(env)
        for node in range(4):
            assert nodes.count(node) == placement.local_ranks_on_node(
                dict(env, SLURM_NODEID=str(node)))
    assert placement.slurm_rank_nodes({}) is None


def test_ntasks_per_node_alone_counts_for_every_node():
    env = {"SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS": "6",
           "SLURM_DISTRIBUTION": "cyclic"}
    assert placement.slurm_rank_nodes(env) == [0, 1, 2, 0, 1, 2]
    assert placement.allocation_tasks_per_node(env) == 2


def test_the_relaunch_size_is_the_busiest_node_s_count():
    """An allocation of 1, 2, 2, 2 tasks: a relaunch may put 2 on a node (the first number
    alone, 1, left a relaunch a task short on every node), the count BLAS divides the
    busiest node's cores by."""
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_TASKS_PER_NODE": "1,2(x3)"}

    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 0, stdout="n1\nn2\nn3\nn4\n", stderr="")
    nodes = JobNodes.of(["srun"], 7, env, run=run)
    assert nodes.names == ["n1", "n2", "n3", "n4"]
    assert nodes.per_node == 2 == placement.allocation_tasks_per_node(env)
    assert max(placement.local_ranks_on_node(dict(env, SLURM_NODEID=str(i))) for i in range(4)) == 2
