"""The bytes and messages a step sends, as ringnet.perfmodel.sends counts them:

* against the closed forms 2(N-1)/N * P * itemsize (ring), (N-1) * P on the master, split-fc's
  sums written out by hand, and the conversion layer's and FC blocks' own buffers;
* the ring, tree and master communicators run in-process on a recording transport, whole
  and in buckets, send exactly the bytes and messages the model assigns to each rank;
* against the transport's own ``bytes_sent`` counters of the real strategies under mpirun
  (N = 1..4).
"""
import os
import sys

import numpy as np
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import sends
from ringnet.models import build_model
from ringnet.shards import shard_bounds

from tests.perfmodel.helpers import ROOT, ROOTED_RUNS, layer_parts, record_run, recording_transport


@pytest.mark.parametrize("length", [7, 1000, 431080])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_ring_bytes_closed_form(length, n):
    bounds = shard_bounds(length, n)
    rs, ag = pm.ring_phase_bytes(bounds, 4)
    # every shard but one goes out once in each phase: 2(N-1)/N * P * itemsize on average
    assert sum(rs) + sum(ag) == 2 * (n - 1) * length * 4
    sizes = [b - a for a, b in bounds]
    assert rs == [(length - sizes[r]) * 4 for r in range(n)]
    assert ag == [(length - sizes[(r + 1) % n]) * 4 for r in range(n)]


def test_mode_bytes_closed_form():
    lenet = build_model("lenet")
    p = lenet.num_params
    assert p == 431080
    for n in (2, 3, 4):
        ring = pm.traffic(lenet, "ring", n, 12)
        assert np.mean(ring) == pytest.approx(2 * (n - 1) / n * p * 4)
        master = pm.traffic(lenet, "master", n, 12)
        assert master[0] == (n - 1) * p * 4 and master[1:] == [p * 4] * (n - 1)
        tree = pm.traffic(lenet, "tree", n, 12)
        assert sum(tree) == 2 * (n - 1) * p * 4           # N-1 edges, each way once
    assert pm.traffic(lenet, "tree", 4, 12) == [2 * p * 4, 2 * p * 4, p * 4, p * 4]


def test_split_fc_bytes_hand_computed():
    # LeNet at N=2, global batch 12: conv prefix 520 + 25050 params, features 800 (+1 label),
    # ip1 500 outputs split 250/250, ip2 10 outputs split 5/5.
    lenet = build_model("lenet")
    n, batch, local = 2, 12, 6
    per_rank = (local * 801              # conversion all-gather: the other rank's block
                + 250 * batch            # ip1 output rows
                + 5 * batch              # ip2 output rows (logits)
                + 250 * batch            # ip2's input gradient, reduce-scattered by ip1 rows
                + local * 800            # conversion feature gradient
                + 2 * 12785) * 4         # conv gradients out, conv weights back (25570 / 2)
    assert pm.traffic(lenet, "split-fc", n, batch) == [per_rank, per_rank]


def test_split_fc_plan_matches_the_conversion_layer_buffers():
    from ringnet.parallel.conversion import DataConversion
    from ringnet.parallel.fc_slices import FcBlock, fc_blocks
    model = build_model("lenet")
    for n, batch in ((2, 12), (3, 12), (4, 8)):
        plan, conv, blocks = pm.split_fc_plan(model, n, batch)
        bounds = {label: b for label, _, b in plan}
        layer = DataConversion(None, 0, n, blocks[0][1].in_features)
        layer._prepare(np.empty(1, model.dtype), batch // n)
        assert bounds["conversion: features+labels"] == layer._bounds
        assert bounds["conversion: feature gradient"] == layer._grad_bounds
        for name, lin, acts in fc_blocks(model):
            block = FcBlock(name, lin, acts, model, shard_bounds(lin.out_features, n), 0)
            block.prepare(batch, model.dtype)
            assert bounds[f"{name} output"] == block.out_bounds


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_communicator_code_sends_what_the_model_counts(n):
    # cifar10_quick's 580 KB gradient: several pipeline pieces where the code cuts them
    model = build_model("cifar10_quick")
    p = model.num_params
    for mode in ROOTED_RUNS:
        runs = [record_run(mode, rank, n, p) for rank in range(n)]
        assert [t.bytes_sent for t in runs] == pm.traffic(model, mode, n, 64), mode
        assert [t.messages for t in runs] == pm.messages(model, mode, n, 64, delay=1), mode


@pytest.mark.parametrize("n", [2, 4, 7])
def test_bucketed_ring_sends_what_the_model_counts(n, monkeypatch):
    # each part's exchange runs over the shard bounds clipped to it (empty steps send nothing)
    from ringnet.comm import RingCommunicator
    model = build_model("lenet")
    p = model.num_params
    parts = layer_parts(model)
    monkeypatch.setattr(sends, "buckets", lambda model, stop: parts)
    sent, messages = [], []
    for rank in range(n):
        transport = recording_transport(rank, n)
        comm = RingCommunicator(transport)
        for lo, hi, _ in parts:
            bounds = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo)
                      for a, b in comm.shard_bounds(p)]
            buf = np.zeros(hi - lo, np.float32)
            with np.errstate(all="ignore"):
                comm.reduce_scatter(buf, bounds=bounds)
                comm.allgather(buf, bounds=bounds)
        sent.append(transport.bytes_sent)
        messages.append(transport.messages)
    assert sent == pm.traffic(model, "ring", n, 64)
    assert messages == pm.messages(model, "ring", n, 64, delay=0)
    assert sum(messages) < len(parts) * 2 * (n - 1) * n        # some steps are empty


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["lenet", "cifar10_quick"])
@pytest.mark.parametrize("mode, delay", [("ring", 0), ("ring", 1), ("tree", 0), ("master", 0),
                                         ("split-fc", 0), ("split-fc", 1)])
def test_strategies_send_what_the_model_counts(name, mode, delay):
    from mpi4py import MPI

    from ringnet import parallel
    from ringnet.optim import SGD, LRPolicy
    here = os.path.join(ROOT, "tests", "parallel")      # importable when run alone too
    if here not in sys.path:
        sys.path.insert(0, here)
    from test_parallel_mpi import count_sends
    world = MPI.COMM_WORLD
    size = world.Get_size()
    batch, steps = 12, 2                               # 12: divisible by N = 1..4
    model = build_model(name, seed=1)
    strategy = parallel.create(mode, model, lambda k: SGD(k, LRPolicy("fixed", 1e-3)),
                               world, delay=delay, transport="mpi")
    if hasattr(strategy, "buckets"):                 # the delay-0 buckets the model assumes
        stop = model.fc_start() if mode == "split-fc" else len(model.layers)
        expected = pm.buckets(model, stop) if delay == 0 else []
        assert [tuple(b) for b in strategy.buckets] == [tuple(b) for b in expected]
    sent, messages = count_sends(strategy, model, batch, steps)
    expected = [steps * b for b in pm.traffic(model, mode, size, batch)]
    assert sent == expected, f"{mode} delay {delay} at N={size}: bytes sent per rank"
    expected = [steps * m for m in pm.messages(model, mode, size, batch, delay)]
    assert messages == expected, f"{mode} delay {delay} at N={size}: messages per rank"
