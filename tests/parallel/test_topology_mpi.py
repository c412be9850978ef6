"""Ring and tree across (faked) nodes against single: the real MPI world told that its ranks
sit on 2 nodes placed cyclically (rank r on node r mod 2, as ``srun --distribution=cyclic``).

* delay 0: ring flat (ordered by node), ring hierarchical and tree hierarchical give the
  weights of ``single`` on the same global batches (float64, relative 1e-9), every replica
  bit-identical, and the ring's neighbours are each node's ranks together;
* delay 1: the hierarchical ring runs the same recurrence (the one-process simulation);
  at N = 4 (2 x 2) the hierarchical ring is the multi-channel one, at N = 3 (2 + 1) the
  one-leader fall-back, and the header names which;
* the placement says which topology ran and why.
"""
import numpy as np
import pytest
from mpi4py import MPI

import ringnet.placement as nodes
from ringnet.config import TrainConfig
from ringnet.train import train

from conftest import flat_params, rel_error
from test_parallel_mpi import BASE, _replicas_identical, _simulate_delay1, _single_reference

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture
def cyclic_nodes(monkeypatch):
    """Every layout of the world: 2 nodes, rank r on node r mod 2."""
    names = ["node-a" if r % 2 == 0 else "node-b" for r in range(SIZE)]
    monkeypatch.setattr(nodes, "layout", lambda comm=None: nodes.group(names, names,
                                                                       (comm or WORLD).Get_rank()))
    monkeypatch.setenv("RINGNET_CPU_PROGRESS", "driven")
    return names


def _run(monkeypatch, mode, topology, delay=0, **extra):
    result = train(TrainConfig(mode=mode, delay=delay, topology=topology, **BASE, **extra),
                   world=WORLD)
    strategy = result.strategy
    params = flat_params(strategy)
    identical = _replicas_identical(params)
    strategy.close()
    return strategy, params, identical



@pytest.mark.mpi
@pytest.mark.parametrize("mode, topology", [("ring", "flat"), ("ring", "hierarchical"),
                                            ("tree", "hierarchical"), ("ring", "auto")])
def test_across_nodes_equals_single(cyclic_nodes, monkeypatch, mode, topology):
    strategy, params, identical = _run(monkeypatch, mode, topology)
    reference, _ = _single_reference()
    assert rel_error(params, reference) <= 1e-9, f"{mode} {topology} weights differ from single"
    assert identical
    comm = strategy.comm
    ran = comm.topology
    assert ran == (topology if topology != "auto" else ran)
    if SIZE > 1:
        assert strategy.placement.topology.startswith(f"{ran} (")
        assert f"topology {ran}" in strategy.placement.describe()
    if mode == "ring":
        # the ring's order: node-a's ranks (even), then node-b's (odd)
        order = [r for r in range(SIZE) if r % 2 == 0] + [r for r in range(SIZE) if r % 2]
        assert comm.order == order
        place = order.index(RANK)
        assert comm.right == order[(place + 1) % SIZE] and comm.left == order[(place - 1) % SIZE]
        # rank r still owns shard r: the update work is divided 1/N
        assert strategy.owned == slice(*comm.shard_bounds(len(params))[RANK])
        if ran == "hierarchical":      # the shape that ran is in the header
            shape = ("2 channels x 2 nodes, ring between nodes" if SIZE == 4 else
                     "one leader per node (uneven placement 2+1: no channels)" if SIZE == 3 else
                     None)
            if shape:
                assert comm.describe(1) == shape
                assert strategy.placement.topology.endswith(f"; {shape})")


@pytest.mark.mpi
def test_hierarchical_ring_delay1_runs_the_recurrence(cyclic_nodes, monkeypatch):
    _, params, identical = _run(monkeypatch, "ring", "hierarchical", delay=1, warmup_steps=0)
    assert rel_error(params, _simulate_delay1()) <= 1e-9
    assert identical


@pytest.mark.mpi
def test_one_node_stays_flat_and_unchanged(monkeypatch):
    """Without a node layout that spans nodes, auto is flat and gives the bits of flat."""
    runs = {}
    for topology in ("auto", "flat"):
        strategy, params, _ = _run(monkeypatch, "ring", topology)
        runs[topology] = params
        assert strategy.comm.topology == "flat"
        assert strategy.comm.order == list(range(SIZE))
    assert np.array_equal(runs["auto"], runs["flat"])
