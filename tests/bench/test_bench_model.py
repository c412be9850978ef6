"""bench model: the performance model's closed-form pieces against hand-computed values.

* traffic: bytes per rank per step of every mode against (a) the closed forms
  2(N-1)/N * P * itemsize (ring), (N-1) * P on the master, and (b) the transport's
  own ``bytes_sent`` counters of the real strategies under mpirun (N = 1..4);
* the ring, tree and master communicators run in-process on a recording transport
  send exactly the bytes the model assigns to each rank;
* times: ring, tree and master exchange times against sums written out by hand for a
  link with round numbers; delay 0 adds, delay 1 overlaps;
* consistency: a faster link never predicts a slower step, the master's step grows
  with N, delay 1 is never slower than delay 0 on a GPU, efficiency = speedup / N;
* the link fit recovers alpha and beta from synthetic timings;
* the CLI's --json has exactly the documented keys, --plot writes a PNG, bad input
  ends with one ``ringnet: error:`` line and exit 2.

No test asserts a measured time.
"""
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import (calibration, cli, codefacts, compute as compute_profiles,
                                 exchange, profiling, roofline, sends, simulate, worker)
from ringnet.models import build_model
from ringnet.shards import shard_bounds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
ALPHA, BETA = 1e-3, 1e9          # 1 ms per message, 1 GB/s: hand sums stay readable


def _system(alpha=ALPHA, beta=BETA, ranks_per_node=1 << 20, add=0.0, update=0.0):
    compute = pm.roofline_compute("k40", ("lenet",))
    compute.add_s_per_elem, compute.add_s_per_call = add, 0.0
    compute.update_s_per_param, compute.update_s_per_call = update, 0.0
    link = pm.Link("test", alpha, beta)
    return pm.System("test", link, link, ranks_per_node, compute)


# -- traffic -------------------------------------------------------------------------------
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


class _Done:
    def __init__(self, log=None, entry=None):
        self.log, self.entry = log, entry

    def wait(self):
        if self.log is not None:
            self.log.append(("wait", self.entry))


def _recording_transport(rank, size):
    """A Transport that moves nothing and records what the communicator code asks of it:
    ``bytes_sent``, ``messages`` (non-empty sends) and ``log`` (posts and waits in order)."""
    from ringnet.comm.transport import Transport

    class Recording(Transport):
        name = "recording"

        def isendrecv(self, send_array, send_peer, recv_array, recv_peer):
            sent = 0 if send_array is None else send_array.nbytes
            received = 0 if recv_array is None else recv_array.nbytes
            self._count(sent, received)
            self.messages += sent > 0
            entry = (len(self.log), send_peer if sent else None, recv_peer if received else None)
            self.log.append(("post", entry))
            return _Done(self.log, entry)

    world = types.SimpleNamespace(Get_rank=lambda: rank, Get_size=lambda: size)
    transport = Recording(world, timeout_s=1)
    transport.messages, transport.log = 0, []
    return transport


ROOTED_RUNS = {
    "ring": lambda c, buf: (c.reduce_scatter(buf), c.allgather(buf)),
    "tree": lambda c, buf: (c.reduce(buf, root=0), c.bcast(buf, root=0)),
    "master": lambda c, buf: (c.reduce(buf, root=0), c.bcast(buf, root=0)),
}


def _record(mode, rank, n, length):
    from ringnet.comm import MasterSlaveCommunicator, RingCommunicator, TreeCommunicator
    classes = {"ring": RingCommunicator, "tree": TreeCommunicator,
               "master": MasterSlaveCommunicator}
    transport = _recording_transport(rank, n)
    with np.errstate(all="ignore"):     # receives leave scratch unwritten: adds garbage
        ROOTED_RUNS[mode](classes[mode](transport), np.zeros(length, np.float32))
    return transport


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_communicator_code_sends_what_the_model_counts(n):
    # cifar10_quick's 580 KB gradient: several pipeline pieces where the code cuts them
    model = build_model("cifar10_quick")
    p = model.num_params
    for mode in ROOTED_RUNS:
        runs = [_record(mode, rank, n, p) for rank in range(n)]
        assert [t.bytes_sent for t in runs] == pm.traffic(model, mode, n, 64), mode
        assert [t.messages for t in runs] == pm.messages(model, mode, n, 64, delay=1), mode


def _layer_parts(model):
    """One part per layer with parameters, last layers first (the shape of the code's buckets)."""
    from ringnet.parallel.plans import layer_param_ranges
    per_layer = layer_param_ranges(model)
    return [(lo, hi, layer) for layer, (lo, hi) in sorted(per_layer.items(), reverse=True)]


@pytest.mark.parametrize("n", [2, 4, 7])
def test_bucketed_ring_sends_what_the_model_counts(n, monkeypatch):
    # each part's exchange runs over the shard bounds clipped to it (empty steps send nothing)
    from ringnet.comm import RingCommunicator
    model = build_model("lenet")
    p = model.num_params
    parts = _layer_parts(model)
    monkeypatch.setattr(sends, "buckets", lambda model, stop: parts)
    sent, messages = [], []
    for rank in range(n):
        transport = _recording_transport(rank, n)
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


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_auto_runs_the_rounds_the_model_times(n):
    # the model times auto's algorithms by the code's table (rounds, bytes of the busiest
    # rank); here the code's implementation is held to that table on the recording transport
    auto = pytest.importorskip("ringnet.comm.auto")
    from ringnet.comm.cost import ALGORITHMS, choose, terms
    length = 1000
    for algorithm in ALGORITHMS:
        runs = []
        for rank in range(n):
            transport = _recording_transport(rank, n)
            with np.errstate(all="ignore"):
                auto.AutoCommunicator(transport, algorithm=algorithm).allreduce(
                    np.zeros(length, np.float32))
            runs.append(transport)
        rounds, sent, _ = terms(algorithm, 4 * length, n)
        posts = [sum(what == "post" for what, _ in t.log) for t in runs]
        if algorithm == "direct":          # N-1 transfers posted at once: one round
            for t in runs:
                first_wait = next(i for i, (what, _) in enumerate(t.log) if what == "wait")
                assert first_wait == n - 1
            assert max(t.bytes_sent for t in runs) == sent
        else:
            assert max(posts) == rounds, algorithm
        if n & (n - 1) == 0:               # no folding: the busiest rank sends the table's bytes
            assert max(t.bytes_sent for t in runs) == pytest.approx(sent, abs=4 * n), algorithm
    system = _system()
    if n == 4:                             # recursive doubling: 2 rounds of the whole 4000 bytes
        assert pm.allreduce_time(system, "rd", 4000, 4) == pytest.approx(2 * ALPHA + 8000 / BETA)
    # the model's auto is the algorithm the code picks
    picked = choose(4 * length, n)
    assert pm.allreduce_time(system, "auto", 4 * length, n) == \
        pm.allreduce_time(system, picked, 4 * length, n)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_rooted_pieces_are_the_communicators_cuts(n):
    # the public rule: the tree cuts from 4 ranks on (inner ranks forward), the master never
    # unless chunk_bytes asks; the communicator's own buffers and the model use that rule
    from ringnet.comm import MasterSlaveCommunicator, TreeCommunicator
    from ringnet.comm.base import pipeline_pieces
    length = build_model("cifar10_quick").num_params
    whole = [(0, length)]
    assert TreeCommunicator.pieces(length, 4, n) == (pipeline_pieces(length, 4) if n >= 4 else whole)
    assert len(pipeline_pieces(length, 4)) > 1
    assert MasterSlaveCommunicator.pieces(length, 4, n) == whole
    assert MasterSlaveCommunicator.pieces(length, 4, n, chunk_bytes=4096)[:2] == [(0, 1024), (1024, 2048)]
    assert TreeCommunicator.pieces(0, 4, n) == []
    buf = np.zeros(length, np.float32)
    for cls in (TreeCommunicator, MasterSlaveCommunicator):
        comm = cls(_recording_transport(0, n))
        assert comm._pieces(buf) == cls.pieces(length, 4, n)
        assert exchange._pieces(length, 4, cls.name, n) == cls.pieces(length, 4, n)
        # the root receives every sender's piece as one message: pieces x senders
        run = _record(cls.name, 0, n, length)
        senders = 2 if cls is TreeCommunicator and n > 2 else 1 if cls is TreeCommunicator else n - 1
        receives = sum(1 for kind, (_, _, src) in run.log if kind == "post" and src is not None)
        assert receives == len(cls.pieces(length, 4, n)) * senders


def test_rooted_receives_are_posted_as_the_model_assumes():
    # concurrent: the root posts its receive from worker 2 before it waits on worker 1's;
    # serial: it waits on each receive before posting the next
    runs = _record("master", 0, 3, 1000)
    first_wait = next(i for i, (what, _) in enumerate(runs.log) if what == "wait")
    posts_before = sum(what == "post" for what, _ in runs.log[:first_wait])
    assert (posts_before == 2) == exchange._rooted_concurrent()


# -- times -------------------------------------------------------------------------------
def test_ring_time_hand_computed():
    system = _system()
    bounds = shard_bounds(1000, 4)             # 250 elements = 1000 bytes per step
    step = ALPHA + 1000 / BETA
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * step)
    add = _system(add=1e-6)                       # + 250 adds of 1 us each per step
    assert exchange.ring_time(add, bounds, 4, "rs") == pytest.approx(3 * (step + 250e-6))
    assert exchange.ring_time(system, shard_bounds(1000, 1), 4, "rs") == 0.0


def test_a_full_token_bucket_passes_its_burst_at_the_wire_s_speed():
    """A ring collective that follows compute on a link with a token bucket: the first
    steps' bytes up to the burst cost only their latency, the rest the shaped rate; the
    bucket is not refilled within the collective; without after_idle nothing changes."""
    import dataclasses
    system = _system()
    bounds = shard_bounds(1000, 4)             # 3 steps of 1000 bytes
    bucket = dataclasses.replace(system.intra, burst_bytes=1500)
    shaped = dataclasses.replace(system, intra=bucket, inter=bucket)
    full = 3 * (ALPHA + 1000 / BETA)
    assert exchange.ring_time(shaped, bounds, 4, "ag") == pytest.approx(full)
    # 1000 + 500 bytes within the burst, 500 + 1000 at the rate
    assert exchange.ring_time(shaped, bounds, 4, "ag", after_idle=True) == \
        pytest.approx(3 * ALPHA + 1500 / BETA)
    big = dataclasses.replace(bucket, burst_bytes=1 << 20)
    assert exchange.ring_time(dataclasses.replace(shaped, intra=big, inter=big), bounds, 4,
                               "ag", after_idle=True) == pytest.approx(3 * ALPHA)


@pytest.mark.parametrize("rate", ["1gbit", "10gbit", "100mbit", "2.5gbit", "500kbps", "fast"])
def test_tbf_burst_is_the_cluster_s(rate):
    """The burst the model assumes for a shaped link is the one hpc/cluster.sh gives tc."""
    from ringnet.perfmodel.links import tbf_burst_bytes
    script = os.path.join(ROOT, "hpc", "cluster.sh")
    shell = subprocess.run(["bash", "-c", f"eval \"$(sed -n '/^burst_of()/,/^}}/p' {script})\"; "
                           f"burst_of {rate}"], capture_output=True, text=True, check=True)
    assert tbf_burst_bytes(rate) == int(shell.stdout)


def test_inter_node_hop_sets_the_ring_pace():
    slow = pm.Link("slow", 2 * ALPHA, BETA / 10)
    system = _system(ranks_per_node=2)
    system.inter = slow
    bounds = shard_bounds(1000, 4)
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * slow.time(1000))
    system.ranks_per_node = 4
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * (ALPHA + 1000 / BETA))


def test_tree_and_master_times_hand_computed(monkeypatch):
    system = _system()
    nbytes = 4000
    h = ALPHA + nbytes / BETA
    # serial communicators, heap of 4: 0 <- {1, 2}, 1 <- {3}. Reduce: 1 gets 3 (h), 0 gets 1
    # (2h) then 2 (3h). Broadcast: 0 sends to 1 and 2 at once (alpha + 2 S/beta), 1 then to 3.
    monkeypatch.setattr(exchange, "_rooted_concurrent", lambda: False)
    reduce, bcast = exchange.tree_time(system, 4, nbytes, 1000)
    assert reduce == pytest.approx(3 * h)
    assert bcast == pytest.approx(2 * ALPHA + 3 * nbytes / BETA)
    reduce, bcast = exchange.master_time(system, 4, nbytes, 1000)
    assert reduce == pytest.approx(3 * h)                      # one after the other
    assert bcast == pytest.approx(ALPHA + 3 * nbytes / BETA)   # three copies share one link
    # concurrent receives, one piece: 1 gets 3 (h); 0 gets 1 and 2 at once on its link
    monkeypatch.setattr(exchange, "_rooted_concurrent", lambda: True)
    monkeypatch.setattr(exchange, "_pieces", lambda length, itemsize, mode, n: [(0, length)])
    reduce, bcast = exchange.tree_time(system, 4, nbytes, 1000)
    assert reduce == pytest.approx(h + ALPHA + 2 * nbytes / BETA)
    assert bcast == pytest.approx(2 * ALPHA + 3 * nbytes / BETA)
    reduce, bcast = exchange.master_time(system, 4, nbytes, 1000)
    assert reduce == pytest.approx(ALPHA + 3 * nbytes / BETA)  # three at once share one link
    # four pieces of 250 elements: a chain 0 <- 1 (N=2 heap is one edge) streams them
    quarter = ALPHA + nbytes / 4 / BETA
    monkeypatch.setattr(exchange, "_pieces", lambda length, itemsize, mode, n: [(a, a + length // 4)
                                                                 for a in range(0, length, length // 4)])
    reduce, bcast = exchange.tree_time(system, 2, nbytes, 1000)
    assert reduce == pytest.approx(4 * quarter) and bcast == pytest.approx(4 * quarter)
    # heap of 3 pipelined: the root's link takes both children's piece j at once
    reduce, bcast = exchange.tree_time(system, 3, nbytes, 1000)
    assert reduce == pytest.approx(4 * (ALPHA + 2 * nbytes / 4 / BETA))
    add = _system(add=1e-6)                                    # + two adds of 250 per piece
    reduce, _ = exchange.tree_time(add, 3, nbytes, 1000)
    assert reduce == pytest.approx(4 * (ALPHA + 2 * nbytes / 4 / BETA) + 2 * 250e-6)


def test_delay0_adds_and_delay1_overlaps():
    system = _system(update=1e-9)
    lenet = build_model("lenet")
    unbucketed = dict(pm.code_facts(), bucket_bytes=0)
    for mode in ("ring", "tree", "master"):
        with pm.facts(unbucketed):
            sync = pm.predict(system, lenet, mode, 0, 4, 64)
        assert sync.step_s == pytest.approx(sync.compute_s + sync.comm_s + sync.update_s)
        lagged = pm.predict(system, lenet, mode, 1, 4, 64)
        assert lagged.step_s == pytest.approx(max(lagged.compute_s, lagged.comm_s) + lagged.update_s)
    ring = pm.predict(system, lenet, "ring", 0, 4, 64)
    single = pm.predict(system, lenet, "single", 0, 1, 64)
    # the ring updates one shard of 107770 parameters; the single process all 431080
    assert ring.update_s == pytest.approx(107770e-9)
    assert single.update_s == pytest.approx(431080e-9)


def test_cpu_contention_slows_compute_past_the_cores():
    system = _system()
    system.cores = 2.0
    assert [system.contention(n) for n in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    lenet = build_model("lenet")
    free = pm.predict(_system(), lenet, "ring", 0, 4, 64).compute_s
    assert pm.predict(system, lenet, "ring", 0, 4, 64).compute_s == pytest.approx(2 * free)


def test_polled_stream_overlap_hand_computed():
    system = _system()
    system.cores, system.steal, system.rate, system.ranks_here = 2.0, 0.5, 0.5, 2
    ops = [(0.0, [("msg", 2.0), ("cpu", 0.25)])]
    # exchange of 2 s needs 4 s beside the compute, which it slows by 0.5 * 4 s
    long = pm.Timeline([], [], {}, 10.0)
    assert simulate.simulate_ops(system, long, ops, "poll")[0] == pytest.approx(10.0 + 2.0 + 0.25)
    # a 1 s compute stretches to 2 s; 1 s of exchange done, 1 s left at full speed
    short = pm.Timeline([], [], {}, 1.0)
    assert simulate.simulate_ops(system, short, ops, "poll")[0] == pytest.approx(2.0 + 1.0 + 0.25)
    # a spare core takes the update off the compute's core
    system.ranks_here = 1
    assert simulate.simulate_ops(system, long, ops, "poll")[0] == pytest.approx(12.0)


def test_driven_stream_waits_for_layer_boundaries():
    system = _system()
    system.cores, system.ranks_here = 1.0, 1
    ops = [(0.0, [("msg", 0.5), ("cpu", 0.1), ("msg", 0.5)])]
    # the first transfer is noticed at the boundary at 1; the add delays the compute by
    # 0.1, so the next boundaries are 2.1, 3.1, 4.1; the second transfer is seen at 2.1
    layers = pm.Timeline([1.0, 2.0, 3.0, 4.0], [], {}, 4.0)
    assert simulate.simulate_ops(system, layers, ops, "driven") == pytest.approx((4.1, 0.1))
    # after the compute the waiting thread drives: at blocking speed
    one = pm.Timeline([1.0], [], {}, 1.0)
    assert simulate.simulate_ops(system, one, ops, "driven")[0] == pytest.approx(1.0 + 0.1 + 0.5)
    # inside a blocking collective the thread progresses all along
    dense = pm.Timeline([], [(0.0, 4.0)], {}, 4.0)
    assert simulate.simulate_ops(system, dense, [(0.0, [("msg", 0.5)])], "driven")[0] == pytest.approx(4.0)
    assert simulate.simulate_ops(system, dense, [(3.9, [("msg", 0.5)])], "driven")[0] == pytest.approx(4.4)


def test_driven_copy_delays_the_compute_and_moves_at_the_calibrated_rate():
    system = _system()
    system.cores, system.ranks_here = 1.0, 1
    layers = pm.Timeline([1.0, 2.0, 3.0, 4.0], [], {}, 4.0)
    # one message: a 0.1 wait (seen at the boundary at 1), then a 0.3 copy the training
    # thread makes inside its test: the compute ends 0.3 later (4.3)
    ops = [(0.0, exchange.message_time(pm.Link("x", 0.1, 1.0), 0.3))]
    assert ops[0][1] == [("msg", 0.1), ("copy", 0.3)]
    step, shift = simulate.simulate_ops(system, layers, ops, "driven")
    assert shift == pytest.approx(0.3) and step == pytest.approx(4.3)
    # at a calibrated rate of 0.25 a message takes 4x as long beside compute: the wait is
    # seen at 1, the copy (1.2; +0.3 on the compute, boundaries now 1.3, 2.3, ...) at 2.3
    system.rate = 0.25
    late = [(0.0, [("msg", 0.1), ("copy", 0.3), ("msg", 0.1)])]
    # the second wait starts at 2.3 and takes 0.4 beside compute: seen at the boundary 3.3
    assert simulate.simulate_ops(system, layers, late, "driven") == pytest.approx((4.3, 0.3))
    # a GPU's copy engine moves it: nothing added to the compute
    assert simulate.simulate_ops(system, layers, ops, "gpu") == pytest.approx((4.0, 0.0))


def test_ranks_beyond_the_cores_share_them(monkeypatch):
    # 4 ranks busy at once took 2x one alone (waits that sleep): 2 effective cores, each
    # rank's compute 2x slower at N = 4, none at N = 1, 2
    raw = {"cores": 2, "solo_s": 0.02, "together_s": 0.04,
           "blocking": {"4096": 0.004, "1048576": 0.010}, "streamed": {}}
    record = calibration.calibration_record(4, raw, 0.0)
    assert record["cores"] == pytest.approx(2.0) and record["slowdown"] == pytest.approx(2.0)
    system = pm.System("local", None, None, 1 << 30, _system().compute, calibrated={4: record})
    assert [system.at(n).contention(n) for n in (1, 2, 4)] == pytest.approx([1.0, 1.0, 2.0])
    # 4 ranks on 2 cores timed at 1.6x one alone (a mean over ranks that started and ended
    # apart): they still had only 2 cores, for the work unit and for a model's own step
    raw_fast = dict(raw, together_s=0.032,
                    models={"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.0064}})
    fast = calibration.calibration_record(4, raw_fast, 0.0)
    assert fast["cores"] == 2 and fast["model_cores"] == {"lenet": 2}
    fast_system = pm.System("local", None, None, 1 << 30, _system().compute, calibrated={4: fast})
    assert fast_system.at(4).contention(4, "lenet") == pytest.approx(2.0)
    # on a machine of 16 cores the same 1.6x means 2.5 cores' worth: kept as measured
    roomy = calibration.calibration_record(4, dict(raw_fast, cores=16), 0.0)
    assert roomy["cores"] == pytest.approx(2.5) and roomy["model_cores"]["lenet"] == pytest.approx(2.5)
    # ranks bound one to a core of 16 (affinity 1): the calibration counts the machine's
    # cores, so the cap does not pin 4 ranks to the one core a rank's affinity names
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert pm.usable_cores() == 16
    # a record of the older worker (its waits spun: 3.3x) names no cores: this machine's
    raw.pop("cores")
    raw["together_s"] = 0.066
    assert calibration.calibration_record(4, raw, 0.0)["cores"] == pm.usable_cores()


def _round_robin_wait(n, cores, slice_s, samples, rng):
    """Simulate: N busy ranks share ``cores`` cores, each core running its N/cores ranks in
    turn for one slice each; a rank blocks on a random peer at a random moment and waits
    until that peer next runs. Returns the mean wait over ``samples`` draws."""
    per_core = max(1, n // cores)                  # N <= cores: each rank has its own
    period = per_core * slice_s
    total = 0.0
    for _ in range(samples):
        peer = int(rng.integers(n))
        turn = peer % per_core                     # its place in its core's rotation
        t = float(rng.uniform(0, 50 * period))
        start = (t // period) * period + turn * slice_s
        while start + slice_s <= t:                # this period's slot is over: the next one
            start += period
        total += max(0.0, start - t)
    return total / samples


@pytest.mark.parametrize("n, cores", [(1, 2), (2, 2), (4, 2), (6, 2), (8, 2), (9, 3), (16, 4)])
def test_scheduling_wait_matches_a_round_robin_simulation(n, cores):
    rng = np.random.default_rng(n * 10 + cores)
    slice_s = 3e-3
    simulated = _round_robin_wait(n, cores, slice_s, 40000, rng)
    assert pm.scheduling_wait(n, cores, slice_s) == pytest.approx(simulated, rel=0.03, abs=1e-9)
    # every rank has a core (N <= cores), or a GPU (no cores): no wait at all
    assert pm.scheduling_wait(min(n, cores), cores, slice_s) == 0.0
    assert pm.scheduling_wait(n, None, slice_s) == 0.0


def _waits_raw(n, first, per_msg, idle_alpha=1e-3):
    """Raw calibration timings whose loaded small exchanges took ``first`` more (the wait for
    peers) plus ``per_msg`` more per message than the same exchanges entered idle."""
    msgs = 2 * (n - 1)
    waits = {}
    for count in pm.LOADED_EXCHANGES:
        waits[f"idle{count}"] = count * msgs * idle_alpha
        waits[f"loaded{count}"] = waits[f"idle{count}"] + first + count * msgs * per_msg
    return {"cores": 2, "solo_s": 0.02, "together_s": 0.04,
            "blocking": {"4096": 0.004, "1048576": 0.010}, "streamed": {}, "waits": waits}


def test_calibrated_waits_set_the_step_s_wait_and_each_message_s():
    # at N = 4 on 2 cores the exchange entered after compute waited 6 ms more, plus 0.2 ms
    # per message: the slices are recovered, and at N = 4 the system waits exactly that
    record = calibration.calibration_record(4, _waits_raw(4, 6e-3, 2e-4), 0.0)
    unit = pm.scheduling_wait(4, 2, 1.0)                # 1/4 of a slice at N = 4 on 2 cores
    assert unit == pytest.approx(0.25)
    assert record["slice_s"] == pytest.approx(6e-3 / unit)
    assert record["msg_slice_s"] == pytest.approx(2e-4 / unit)
    system = pm.System("local", None, None, 1 << 30, _system().compute, calibrated={4: record})
    at4 = system.at(4)
    assert at4.wait_s == pytest.approx(6e-3) and at4.msg_wait_s == pytest.approx(2e-4)
    # every message of a blocking ring exchange pays it: 2(N-1) of them
    lenet = build_model("lenet")
    plain = pm.System("local", None, None, 1 << 30, _system().compute,
                      calibrated={4: dict(record, slice_s=0.0, msg_slice_s=0.0)}).at(4)
    bounds = shard_bounds(lenet.num_params, 4)
    both = [exchange.ring_time(s, bounds, 4, "rs") + exchange.ring_time(s, bounds, 4, "ag") for s in (at4, plain)]
    assert both[0] - both[1] == pytest.approx(6 * 2e-4)
    # the tree's and the master's waits too, one per wait on their critical path
    from ringnet.parallel.plans import RootedPlan
    for mode in ("tree", "master"):
        part = RootedPlan.traffic(1000, 4, lenet.dtype.itemsize, [(0, 1000)], mode)[0]
        items = [exchange.flat_items(s, 4, part, 0.0) for s in (at4, plain)]
        peers = [sec for kind, sec in items[0] if kind == "peer"]
        assert peers and all(p == pytest.approx(2e-4) for p in peers)
        assert [i for i in items[0] if i[0] != "peer"] == items[1]
    # N = 8 from the N = 4 calibration: the closed form scales it, (1-2/8)(8/2-1)/2 / (1/4)
    assert system.at(8).wait_s == pytest.approx(6e-3 * 0.75 * 3 / 2 / 0.25)
    # N = 2 on 2 cores: every rank has a core, whatever the exchanges measured
    two = calibration.calibration_record(2, _waits_raw(2, 6e-3, 2e-4), 0.0)
    assert two["slice_s"] == two["msg_slice_s"] == 0.0
    assert pm.System("local", None, None, 1 << 30, _system().compute,
                     calibrated={2: two}).at(2).wait_s == 0.0
    # a record without these timings (older worker): no wait
    raw = _waits_raw(4, 6e-3, 2e-4)
    raw.pop("waits")
    assert calibration.calibration_record(4, raw, 0.0)["slice_s"] == 0.0
    # spec-sheet profiles: none
    assert pm.make_system("pcie3", _system().compute, 8).wait_s == 0.0


def test_peer_wait_beside_compute_is_in_the_calibrated_rate():
    # a message's wait for a descheduled peer costs its time after the compute, and nothing
    # beside it (the stream's calibrated rate there was measured with the ranks oversubscribed)
    system = _system()
    system.cores, system.ranks_here = 1.0, 1
    layers = pm.Timeline([1.0, 2.0, 3.0, 4.0], [], {}, 4.0)
    assert exchange.message_time(pm.Link("x", 0.1, 1.0), 0.3, 0.5) == [("msg", 0.1), ("copy", 0.3), ("peer", 0.5)]
    beside = [(0.0, [("msg", 0.1), ("peer", 5.0)])]
    assert simulate.simulate_ops(system, layers, beside, "driven") == pytest.approx((4.0, 0.0))
    assert simulate.simulate_ops(system, layers, beside, "poll") == pytest.approx((4.0, 0.0))
    after = [(4.0, [("msg", 0.1), ("peer", 0.5)])]
    assert simulate.simulate_ops(system, layers, after, "driven") == pytest.approx((4.6, 0.0))


def test_wait_for_peers_is_paid_once_per_step():
    lenet = build_model("lenet")
    system = _system()
    base = {(m, d): pm.predict(system, lenet, m, d, 4, 64).step_s
            for m, d in (("ring", 0), ("ring", 1), ("tree", 0), ("master", 0), ("split-fc", 0))}
    system.wait_s = 5e-3
    for (mode, delay), step in base.items():
        got = pm.predict(system, lenet, mode, delay, 4, 64).step_s
        # once per step, in every mode
        assert got - step == pytest.approx(5e-3), (mode, delay)
    # one rank: nothing to wait for
    assert pm.predict(system, lenet, "ring", 0, 1, 64).step_s == \
        pytest.approx(pm.predict(_system(), lenet, "ring", 0, 1, 64).step_s)


def test_a_delay0_step_waits_for_its_slowest_rank():
    # 2 ranks on 2 cores, lenet's slowest rank 6% behind the mean step by step: a delay-0
    # step is 6% of its compute longer; delay 1 (a step of slack) and single are not
    raw = _waits_raw(2, 0.0, 0.0)
    raw["models"] = {"lenet": {"batch": 32, "solo_s": 0.004, "together_s": 0.004, "imbalance": 1.06},
                     "cifar10_quick": {"batch": 32, "solo_s": 0.02, "together_s": 0.02,
                                       "imbalance": 0.99}}
    record = calibration.calibration_record(2, raw, 0.0)
    assert record["imbalance"] == {"lenet": pytest.approx(1.06), "cifar10_quick": 1.0}
    assert "lenet step (batch 32) with all ranks busy 1.00x alone, slowest rank 1.06x the mean" \
        in calibration.describe_contention(2, record)
    lenet = build_model("lenet")

    def local(n, **change):
        return pm.System("local", None, None, 1 << 30, _system().compute,
                         calibrated={n: dict(record, **change)})
    for mode, delay in (("ring", 0), ("tree", 0), ("master", 0), ("split-fc", 0), ("ring", 1)):
        got = pm.predict(local(2), lenet, mode, delay, 2, 64)
        even = pm.predict(local(2, imbalance={}), lenet, mode, delay, 2, 64)
        extra = 0.06 * got.compute_s if not delay else 0.0
        assert got.step_s - even.step_s == pytest.approx(extra, rel=1e-9, abs=1e-12), (mode, delay)
        assert got.compute_s == even.compute_s
    # records of the older worker carry none
    old = {k: v for k, v in raw["models"]["lenet"].items() if k != "imbalance"}
    assert calibration.calibration_record(2, dict(raw, models={"lenet": old}), 0.0)["imbalance"] == {}
    # 4 ranks on 2 cores: the waits for descheduled peers stand for it
    raw4 = dict(_waits_raw(4, 0.0, 0.0), models=raw["models"])
    record4 = calibration.calibration_record(4, raw4, 0.0)
    crowded = pm.System("local", None, None, 1 << 30, _system().compute, calibrated={4: record4})
    assert crowded.at(4).imbalance is None and crowded.at(2).imbalance == record4["imbalance"]
    assert pm.predict(crowded, lenet, "ring", 0, 4, 64) == pm.predict(
        pm.System("local", None, None, 1 << 30, _system().compute,
                  calibrated={4: dict(record4, imbalance={})}), lenet, "ring", 0, 4, 64)


def test_contention_is_measured_with_the_model_s_own_step():
    # the work unit: 4 ranks 2x one alone (2 cores); lenet's own step at its per-rank batch:
    # 2.5x (1.6 effective cores); a model the calibration did not time keeps the work unit's
    raw = _waits_raw(4, 0.0, 0.0)
    raw["models"] = {"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.010}}
    record = calibration.calibration_record(4, raw, 0.0)
    assert record["model_cores"] == {"lenet": pytest.approx(1.6)}
    system = pm.System("local", None, None, 1 << 30, _system().compute, calibrated={4: record})
    at4 = system.at(4)
    assert at4.contention(4, "lenet") == pytest.approx(2.5)
    assert at4.contention(4, "cifar10_quick") == pytest.approx(2.0)
    assert at4.contention(1, "lenet") == 1.0
    # lenet predicts as on a machine of 1.6 cores; without its own timing, as on one of 2
    lenet = build_model("lenet")

    def local(**change):
        return pm.System("local", None, None, 1 << 30, _system().compute,
                         calibrated={4: dict(record, **change)})
    for mode, delay in (("ring", 1), ("ring", 0), ("tree", 0)):
        got = pm.predict(system, lenet, mode, delay, 4, 64)
        assert got == pm.predict(local(cores=1.6, model_cores={}), lenet, mode, delay, 4, 64)
        assert got.compute_s > pm.predict(local(model_cores={}), lenet, mode, delay, 4, 64).compute_s
    # GPU / spec-sheet systems: no contention
    assert pm.make_system("pcie3", _system().compute, 8).contention(4, "lenet") == 1.0


def test_step_split_telescopes_to_the_step():
    # hook marks after each layer (3 layers), the loss's end, and the strategy's spans:
    # the layer times, the rest and the update add up to the step span
    marks = [("forward", 0, 1.0), ("forward", 1, 1.5), ("forward", 2, 2.5), ("loss", -1, 2.75),
             ("backward", 2, 3.0), ("backward", 1, 4.0), ("backward", 0, 6.0)]
    spans = {"step": (0.5, 7.0), "compute": (0.75, 5.5), "update": (6.5, 0.5)}
    forward, backward, rest, update = profiling._split_step(3, marks, spans)
    assert forward == [0.25, 0.5, 1.0] and backward == [2.0, 1.0, 0.25]
    assert rest == pytest.approx(0.25 + 0.25 + 1.0) and update == 0.5
    assert sum(forward) + sum(backward) + rest + update == pytest.approx(spans["step"][1])


def test_profile_parts_add_up_to_the_median_step():
    # three steps of two layers; the second and third each lost the core in another part:
    # the parts' medians (1, 2 | 3, 4 | rest 0.5, update 0.5 = 11) miss it, the median
    # step (13) has it, so the parts are scaled by 13/11
    rows = [([1.0, 2.0], [3.0, 4.0], 0.5, 0.5, 11.0),
            ([5.0, 2.0], [3.0, 4.0], 0.5, 0.5, 15.0),
            ([1.0, 2.0], [3.0, 6.0], 0.5, 0.5, 13.0)]
    got = profiling._step_medians(rows)
    k = 13.0 / 11.0
    assert got == pytest.approx([1 * k, 2 * k, 3 * k, 4 * k, 0.5 * k, 0.5 * k, 13.0])
    assert sum(got[:-1]) == pytest.approx(got[-1])


def test_compute_profile_cli_saves_a_training_steps_profile(tmp_path):
    # the command as a user runs it: the profile it saves says how it was measured and has
    # the median step of every batch size it ran (the times themselves are checked against
    # a clock the test controls, below: a second timed run on a shared machine is noise)
    path = tmp_path / "here.json"
    proc = _cli("--compute", "here", "--models", "lenet", "--profile", "pcie3", "--np", "1",
                "--paper-compute", "k40", "--save-compute", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    compute = pm.load_compute(str(path))
    assert compute.method == pm.TRAINING_STEPS and set(compute.steps_ms["lenet"]) == {16, 32, 64}
    assert all(ms > 0 for ms in compute.steps_ms["lenet"].values())
    assert pm.profile_method({"device": "cpu"}) == pm.ISOLATED_LAYERS


class _VirtualClock:
    """``time.perf_counter`` that moves only when the test says: every layer's forward and
    backward and every optimizer step cost a known, closed-form time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_compute_profile_recovers_the_layer_costs_of_a_controlled_clock(monkeypatch):
    # forward of layer i at batch b costs (i + 1) ms + b * (i + 1) us, backward twice that,
    # the loss 0.5 ms + b * 3 us, an optimizer step 5 us + 1 ns per element. The profile,
    # measured through real training steps, must give back exactly these lines, and the
    # model's single-mode prediction their sum
    import time
    from ringnet import optim
    clock = _VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock)

    def fwd_s(i, b):
        return (i + 1) * 1e-3 + b * (i + 1) * 1e-6

    def loss_s(b):
        return 0.5e-3 + b * 3e-6

    def timed(fn, cost):
        def run(*args, **kwargs):
            clock.now += cost
            return fn(*args, **kwargs)
        return run
    training_steps = profiling._training_steps

    def controlled(name, batch, dtype, seed):
        model, step = training_steps(name, batch, dtype, seed)
        for i, (_, layer) in enumerate(model.layers):
            layer.forward = timed(layer.forward, fwd_s(i, batch))
            layer.backward = timed(layer.backward, 2 * fwd_s(i, batch))
        model.loss_layer.forward = timed(model.loss_layer.forward, loss_s(batch))
        return model, step
    monkeypatch.setattr(profiling, "_training_steps", controlled)
    sgd_step = optim.SGD.step

    def update(self, w, g, it):
        clock.now += 5e-6 + w.size * 1e-9
        return sgd_step(self, w, g, it)
    monkeypatch.setattr(optim.SGD, "step", update)

    compute = pm.measure_compute(["lenet"], batches=(16, 32, 64), rounds=2, steps=3)
    model = build_model("lenet")
    assert [name for name, _, _ in compute.layers["lenet"]] == [name for name, _ in model.layers]
    for i, (_, fwd, bwd) in enumerate(compute.layers["lenet"]):
        assert fwd == pytest.approx(((i + 1) * 1e-3, (i + 1) * 1e-6), rel=1e-6, abs=1e-12)
        assert bwd == pytest.approx((2 * (i + 1) * 1e-3, 2 * (i + 1) * 1e-6), rel=1e-6, abs=1e-12)
    assert compute.overhead["lenet"] == pytest.approx((0.5e-3, 3e-6), rel=1e-6)
    assert compute.update_s_per_param == pytest.approx(1e-9, rel=1e-6)
    assert compute.update_s_per_call == pytest.approx(5e-6, rel=1e-6)
    n = len(model.layers)
    for b in (16, 32, 64):
        step_s = 3 * sum(fwd_s(i, b) for i in range(n)) + loss_s(b) + 5e-6 + model.num_params * 1e-9
        assert compute.steps_ms["lenet"][b] == pytest.approx(1e3 * step_s, rel=1e-6)
        system = pm.make_system("pcie3", compute, 1)
        assert pm.predict(system, model, "single", 0, 1, b).step_s == pytest.approx(step_s, rel=1e-6)


def test_isolated_profile_keeps_one_model_per_batch(monkeypatch):
    # training never changes its batch, so its layers keep their buffers: the isolated
    # profile times each batch size on its own model instance (sizes alternate pass by pass)
    seen = []

    def fake(model, x, iters):
        seen.append((len(x), id(model)))
        return [(name, 1.0, 1.0) for name, _ in model.layers]
    monkeypatch.setattr(profiling, "layer_times", fake)
    pm.isolated_compute(("lenet",), batches=(2, 4), iters=3)
    assert [b for b, _ in seen] == [2, 4] * 3
    models = {b: {m for bb, m in seen if bb == b} for b in (2, 4)}
    assert len(models[2]) == len(models[4]) == 1 and models[2] != models[4]


def test_buckets_start_during_the_backward(monkeypatch):
    lenet = build_model("lenet")
    system = _system(alpha=1e-6, beta=1e8)         # bandwidth-bound: 4.3 ms per shard step
    system.compute.layers["lenet"] = [(name, (fa * 1e3, fb * 1e3), (ba * 1e3, bb * 1e3))
                                      for name, (fa, fb), (ba, bb) in system.compute.layers["lenet"]]
    monkeypatch.setattr(sends, "buckets", lambda model, stop: [])
    whole = pm.predict(system, lenet, "ring", 0, 4, 64)
    steps = 6 * (1e-6 + 107770 * 4 / 1e8)          # 2(N-1) steps of one 107770-element shard
    assert whole.step_s == pytest.approx(whole.compute_s + steps, rel=1e-9)
    # one bucket per layer with parameters, last layers first: the ip1 and ip2 buckets'
    # exchanges run while the conv layers' backward goes on
    parts = _layer_parts(lenet)
    monkeypatch.setattr(sends, "buckets", lambda model, stop: parts)
    bucketed = pm.predict(system, lenet, "ring", 0, 4, 64)
    assert bucketed.step_s < whole.step_s - 0.5 * steps
    # conv1's bucket (520 parameters) starts only when the backward ends: its steps stay exposed
    conv1 = 6 * (1e-6 + 130 * 4 / 1e8)
    assert bucketed.step_s >= bucketed.compute_s + conv1 - 1e-12
    # latency-bound, four buckets cost four times the messages: buckets lose
    system.intra = system.inter = pm.Link("slow", 5e-2, 1e12)
    slow_bucketed = pm.predict(system, lenet, "ring", 0, 4, 64).step_s
    monkeypatch.setattr(sends, "buckets", lambda model, stop: [])
    assert slow_bucketed > pm.predict(system, lenet, "ring", 0, 4, 64).step_s + 6 * 5e-2


def test_calibration_record_from_raw_timings():
    # blocking exchange 10 ms; beside 40 ms of work (30 ms with nothing beside it) it
    # spans 50 ms: 10 ms after the work, so none was done during the 40 ms of overlap
    raw = {"solo_s": 0.020, "together_s": 0.030,
           "blocking": {"4096": 0.004, "1048576": 0.010},
           "streamed": {"1048576": [0.050, 0.040]}}
    record = calibration.calibration_record(2, raw, 0.0)
    assert record["slowdown"] == pytest.approx(1.5)
    assert record["steal"] == pytest.approx(0.25)      # 10 ms lost over 40 ms of overlap
    assert record["rate"] == pytest.approx(1e-3)       # clamped: no progress beside compute
    raw["streamed"] = {"1048576": [0.020, 0.040]}      # done within the work
    assert calibration.calibration_record(2, raw, 0.0)["rate"] == pytest.approx(0.5)


# -- consistency -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lenet", "cifar10_quick"])
def test_predictions_are_consistent(name):
    compute = pm.roofline_compute("k40", (name,))
    model = build_model(name)
    nps = (1, 2, 4, 8, 16, 64, 256, 1024)
    rows = {}
    for profile in ("pcie3/eth-10g", "nvlink4/ib-hdr"):
        system = pm.make_system(profile, compute, 8)
        for r in pm.sweep(system, model, nps, 64, "weak"):
            rows[(profile, r["mode"], r["delay"], r["np"])] = r
            assert r["efficiency"] == pytest.approx(r["speedup"] / r["np"])
    for (profile, mode, delay, n), r in rows.items():
        if profile == "nvlink4/ib-hdr":      # faster links never predict a slower step
            assert r["step_ms"] <= rows[("pcie3/eth-10g", mode, delay, n)]["step_ms"] * (1 + 1e-12)
        if mode == "ring" and delay == 1:    # overlap never loses on a GPU (but for the
            # step boundary's element-wise passes over the weights, which delay 0 does not make)
            boundary_ms = 1e3 * pm.boundary_s(compute, model.num_params,
                                              pm.code_facts()["delay_compensation"])
            assert r["step_ms"] <= (rows[(profile, "ring", 0, n)]["step_ms"] + boundary_ms) * (1 + 1e-12)
    for profile in ("pcie3/eth-10g", "nvlink4/ib-hdr"):
        master = [rows[(profile, "master", 0, n)]["step_ms"] for n in nps if n > 1]
        assert master == sorted(master) and len(set(master)) == len(master)
    bytes_ring = [pm.traffic(model, "ring", n, 64) for n in nps]
    means = [np.mean(b) for b in bytes_ring]
    assert means == sorted(means) and means[-1] < 2 * model.num_params * 4


def test_crossover_is_where_the_order_flips():
    compute = pm.roofline_compute("k40", ("lenet",))
    system = pm.make_system("nvlink4/ib-hdr", compute, 8)
    lenet = build_model("lenet")
    found = pm.crossovers(system, lenet, 64, "weak", 1024)
    assert found
    for c in found:
        n = c["from_np"]
        faster, slower = (tuple(c[k].rsplit(" d", 1)) for k in ("faster", "than"))

        def t(md, n):
            return pm.predict(system, lenet, md[0], int(md[1]), n, 64 * n).step_s
        assert t(faster, n) < t(slower, n)
        assert t(faster, n - 1) >= t(slower, n - 1)


def test_link_fit_recovers_alpha_beta():
    n, alpha, beta = 4, 3e-4, 2e8
    times = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / beta) for s in (4096, 65536, 1 << 20)]
    fit_alpha, fit_beta = calibration._fit_link(n, times, 0.0)
    assert fit_alpha == pytest.approx(alpha, rel=1e-6)
    assert fit_beta == pytest.approx(beta, rel=1e-6)


@pytest.mark.parametrize("mode", ["tree", "master"])
def test_rooted_link_fit_recovers_alpha_beta(mode):
    n, link = 4, pm.Link("true", 2e-3, 3e8)
    system = pm.System("true", link, link, 1 << 30, compute_profiles.ZERO_COMPUTE)
    timing = exchange.tree_time if mode == "tree" else exchange.master_time
    times = [(s, sum(timing(system, n, s, s // 4))) for s in (4096, 65536, 1 << 20)]
    alpha, beta = calibration._fit_rooted(mode, n, times, 0.0)
    assert alpha == pytest.approx(2e-3, rel=1e-6)
    assert beta == pytest.approx(3e8, rel=1e-6)


def test_roofline_flops_of_lenet_conv1():
    lenet = build_model("lenet")
    (_, conv1), (_, in_shape, out_shape) = lenet.layers[0], lenet.shapes[0]
    flops, _, _ = roofline._layer_work(conv1, in_shape, out_shape)
    assert flops == 2 * 1 * 5 * 5 * 20 * 24 * 24


def test_compute_profile_round_trips(tmp_path):
    compute = pm.roofline_compute("h100", ("lenet",))
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(compute.to_json()))
    back = pm.load_compute(str(path))
    assert len(back.layers["lenet"]) == len(compute.layers["lenet"])
    for got, want in zip(back.layers["lenet"], compute.layers["lenet"]):
        assert got[0] == want[0]
        assert tuple(got[1]) == pytest.approx(want[1]), got[0]
        assert tuple(got[2]) == pytest.approx(want[2]), got[0]
    assert back.update_s_per_param == pytest.approx(compute.update_s_per_param)


# -- the command line ------------------------------------------------------------------------
def _cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "ringnet.bench", "model", *args],
                          capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def gpu_profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "k40.json"
    path.write_text(json.dumps(pm.roofline_compute("k40", ("lenet", "cifar10_quick")).to_json()))
    return str(path)


def test_cli_json_has_the_documented_shape(gpu_profile):
    proc = _cli("--compute", gpu_profile, "--profile", "pcie3", "--profile", "nvlink4/ib-hdr",
                "--np", "1", "2", "4", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"predictions", "validation", "paper"}
    keys = {"model", "mode", "delay", "np", "profile", "topology", "between", "step_ms", "speedup",
            "efficiency", "floor_ms", "residual_ms"}
    assert all(set(r) == keys for r in out["predictions"])
    assert {r["topology"] for r in out["predictions"]} == {"flat"}     # no N spans nodes here
    # 2 models x 2 profiles x (single + 5 modes x 4 N)
    assert len(out["predictions"]) == 2 * 2 * (1 + 5 * 4)
    assert out["validation"] == []
    assert {(r["model"], r["np"], r["reported_speedup"]) for r in out["paper"]} == \
        {("lenet", 4, 3.77), ("cifar10_quick", 4, 3.79)}
    assert all(set(r) == {"model", "np", "predicted_speedup", "reported_speedup"} for r in out["paper"])


def test_cli_plot_writes_a_png(gpu_profile, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "scaling.png"
    proc = _cli("--compute", gpu_profile, "--models", "lenet", "--profile", "pcie3",
                "--np", "1", "2", "4", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    (("--profile", "pcie9"), "unknown profile 'pcie9'"),
    (("--models", "resnet"), "unknown model"),
    (("--compute", "/nonexistent/profile.json"), "cannot read compute profile"),
    (("--np", "0"), "must be >= 1"),
])
def test_cli_bad_input_is_one_line(args, words):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("ringnet: error: ") and words in proc.stderr
    assert "Traceback" not in proc.stderr


# -- against the transport's own counters (mpirun -np N, N = 1..4) -------------------------
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


@pytest.mark.mpi
def test_calibration_worker_times_the_model_steps_and_the_waits(capsys):
    # the worker's own output (one iteration, a tiny batch): what the record is made from
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    assert worker.calibrate_worker(1, ["lenet"], 3) == 0
    out = capsys.readouterr().out.strip().splitlines()
    if world.Get_rank():
        assert out == []
        return
    raw = json.loads(out[-1])
    n = world.Get_size()
    assert raw["np"] == n and raw["cores"] == pm.usable_cores()
    assert raw["models"]["lenet"]["batch"] == 3 and raw["models"]["lenet"]["calls"] >= 1
    assert raw["models"]["lenet"]["solo_s"] > 0 and raw["models"]["lenet"]["together_s"] > 0
    assert raw["models"]["lenet"]["imbalance"] >= 1.0 - 1e-12        # a maximum over a mean
    assert sorted(raw["waits"]) == sorted(f"{kind}{c}" for kind in ("idle", "loaded")
                                          for c in pm.LOADED_EXCHANGES)
    assert all(v > 0 for v in raw["waits"].values())
    record = calibration.calibration_record(n, raw, 0.0)
    assert record["model_cores"]["lenet"] > 0
    if n <= raw["cores"]:
        assert record["slice_s"] == record["msg_slice_s"] == 0.0


# -- validation records ----------------------------------------------------------------------
def _validation_record(measured, code=None):
    compute = pm.roofline_compute("k40", ("lenet",)).to_json()
    compute["device"] = "cpu"
    raw = {"solo_s": 0.02, "together_s": 0.02,
           "blocking": {"4096": 0.004, "1048576": 0.010},
           "streamed": {"1048576": [0.020, 0.040]}}
    record = {"batch_size": 64, "steps": 5,
              "rounds": [{"compute": compute, "calibration": {"by_np": {"2": {"raw": raw}}},
                          "measured": measured}]}
    if code is not None:
        record["code"] = code
    return record


def test_validation_reprint_says_where_the_model_is_off(tmp_path):
    row = {"model": "lenet", "mode": "ring", "delay": 0, "np": 2, "step_ms": 100.0,
           "compute_ms": 10.0, "exposed_ms": 85.0, "update_ms": 1.0, "data_ms": 4.0}
    path = tmp_path / "v.json"
    path.write_text(json.dumps(_validation_record([row])))
    rows = pm.validation_rows(json.loads(path.read_text()))
    assert len(rows) == 1 and rows[0]["measured_ms"] == 100.0
    predicted_exposed, measured_exposed = rows[0]["parts"]["exposed"]
    assert measured_exposed == 85.0
    text = pm.diagnose(rows[0], rows)
    # the model's exchange of a 1.7 MB gradient on this link is far below 85 ms
    assert predicted_exposed < 40 and "exposed communication" in text and "85.0 ms" in text
    proc = _cli("--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "2",
                "--validation", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "where the model is off" in proc.stdout and "exposed communication" in proc.stdout
    assert "the code measured: CPU streams poll, no delay-0 buckets" in proc.stdout


def test_validate_writes_the_record_and_prints_its_readme_table(tmp_path, monkeypatch, capsys):
    # the measuring runs stood in for by a record with the new timings at N = 4 (2 cores):
    # the command writes it to the file given and ends with the table the reprint prints
    rows = [{"model": "lenet", "mode": "ring", "delay": 0, "np": n, "step_ms": 20.0,
             "compute_ms": 15.0, "exposed_ms": 4.0, "update_ms": 1.0, "data_ms": 0.0}
            for n in (1, 4)]
    record = _validation_record(rows)
    raw4 = _waits_raw(4, 6e-3, 2e-4)
    raw4["models"] = {"lenet": {"batch": 16, "solo_s": 0.004, "together_s": 0.010}}
    record["rounds"][0]["calibration"]["by_np"]["4"] = {"raw": raw4}
    seen = {}

    def fake_validate(models, batch, steps, repeats, mpirun, iters, nps):
        seen.update(models=models, batch=batch, steps=steps, repeats=repeats, nps=nps)
        return record
    monkeypatch.setattr(cli, "validate", fake_validate)
    path = tmp_path / "docs-record.json"
    args = ["--compute", "k40", "--models", "lenet", "--profile", "pcie3", "--np", "1", "4",
            "--validate", "--validate-repeats", "2", "--validate-steps", "20", "--validation", str(path)]
    assert pm.main(args) == 0
    out = capsys.readouterr().out
    assert seen == {"models": ["lenet"], "batch": 64, "steps": 20, "repeats": 2, "nps": (1, 4)}
    assert json.loads(path.read_text()) == record
    assert "N=4: lenet step (batch 16) with all ranks busy 2.50x alone; wait for descheduled " \
           "peers 6.00 ms per step, 200 us per message" in out
    table = out[out.index("# the README's validation table"):].split("\n", 1)[1].strip()
    assert pm.main(["--compute", "k40", "--np", "1", "4", "--models", "lenet", "--profile", "pcie3",
                    "--validation", str(path), "--table", "validation", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == table
    assert table.splitlines()[0] == "| model | mode | N=1 predicted / measured ms | N=4 |"
    assert [line.split(" | ")[:2] for line in table.splitlines()[2:]] == [["| lenet", "ring d0"]]


def test_a_record_is_predicted_as_the_code_it_measured_ran():
    row = {"model": "lenet", "mode": "ring", "delay": 1, "np": 2, "step_ms": 100.0}
    old = pm.validation_rows(_validation_record([row]))[0]["predicted_ms"]
    assert pm.validation_rows(_validation_record([row], pm.OLD_FACTS))[0]["predicted_ms"] == old
    # the same record measured with driven progress: the exchange waits for layer boundaries
    driven = dict(pm.OLD_FACTS, progress="driven")
    assert pm.validation_rows(_validation_record([row], driven))[0]["predicted_ms"] != old
    with pm.facts(driven):
        assert pm.code_facts() == driven


def test_delay1_boundary_passes_are_charged_on_the_training_thread():
    # one pass of the in-step update per parameter = 1 ns: the look-ahead's boundary makes 4
    # passes over the gradient region, the plain recurrence 2, delay 0 and single none
    lenet = build_model("lenet")
    system = _system(update=pm.SGD_PASSES * 1e-9)
    pass_s = lenet.num_params * 1e-9

    def at(compensation, mode="ring", delay=1, n=2):
        with pm.facts(dict(pm.code_facts(), delay_compensation=compensation)):
            return pm.predict(system, lenet, mode, delay, n, 64)
    for n in (1, 2, 4):
        plain, look = at("none", n=n), at("lookahead", n=n)
        assert look.step_s - plain.step_s == pytest.approx(2 * pass_s, rel=1e-9)
        assert look.update_s - plain.update_s == pytest.approx(2 * pass_s, rel=1e-9)
        assert look.exposed_s == pytest.approx(plain.exposed_s, abs=1e-12)
    no_passes = dict(pm.BOUNDARY_PASSES, none=0)
    with pm.facts(dict(pm.code_facts(), delay_compensation="none")):
        plain = pm.predict(system, lenet, "ring", 1, 2, 64)
        original = codefacts.BOUNDARY_PASSES
        codefacts.BOUNDARY_PASSES = no_passes
        try:
            bare = pm.predict(system, lenet, "ring", 1, 2, 64)
        finally:
            codefacts.BOUNDARY_PASSES = original
    assert plain.step_s - bare.step_s == pytest.approx(2 * pass_s, rel=1e-9)
    assert at("none", "ring", 0) == at("lookahead", "ring", 0)
    assert at("none", "single", 0, 1) == at("lookahead", "single", 0, 1)
    # the code's default compensation is what the model assumes for the code running now
    from ringnet.config import TrainConfig
    assert pm.code_facts()["delay_compensation"] == \
        TrainConfig(model="lenet", mode="ring", delay=1).resolved(2).delay_compensation


def test_markdown_tables_have_a_row_per_configuration():
    from ringnet.tables import parse_markdown
    rows = [{"model": "lenet", "mode": mode, "delay": d, "np": n, "predicted_ms": 11.0,
             "measured_ms": 10.0 if n == 1 else 12.5} for mode, d in (("single", 0), ("ring", 1))
            for n in (1, 2) if mode != "single" or n == 1]
    header, body = parse_markdown(pm.markdown_validation(rows))
    assert header == ["model", "mode", "N=1 predicted / measured ms", "N=2"]
    assert body == [["lenet", "single d0", "11 / 10 (+10%)", "\u2013"],
                    ["lenet", "ring d1", "11 / 10 (+10%)", "11 / 12.5 (\u221212%)"]]
    proc = _cli("--compute", "k40", "--np", "4", "--table", "paper", "--markdown")
    assert proc.returncode == 0, proc.stderr
    header, body = parse_markdown(proc.stdout)
    assert header[-1] == "reported (ring d1)" and [r[-1] for r in body] == ["3.77", "3.79"]
    proc = _cli("--compute", "k40", "--table", "validation", "--markdown")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("ringnet: error: --table validation")


def test_code_facts_are_the_code_s():
    facts = pm.code_facts()
    try:
        from ringnet.comm.stream import progress_mode
    except ImportError:
        assert facts["progress"] == "poll"
    else:
        assert facts["progress"] == progress_mode()
    try:
        from ringnet.parallel.plans import bucket_bytes
    except ImportError:
        assert facts["bucket_bytes"] == 0
    else:
        assert facts["bucket_bytes"] == bucket_bytes()


def test_the_readme_s_validation_figures_are_the_record_s():
    # docs/bench-model-validation.json reprinted with and without the slowest-rank term:
    # the figures the README gives in words beside its table
    import copy
    import re
    import statistics
    with open(os.path.join(ROOT, "docs", "bench-model-validation.json")) as f:
        record = json.load(f)
    even = copy.deepcopy(record)
    for rnd in even["rounds"]:
        for c in rnd["calibration"]["by_np"].values():
            for m in c["raw"].get("models", {}).values():
                m.pop("imbalance", None)
    with open(os.path.join(ROOT, "README.md")) as f:
        text = re.sub(r"\s+", " ", f.read())

    def summary(rows):
        errors = [abs(r["error"]) for r in rows]
        return statistics.median(errors), sum(e <= 0.15 for e in errors)
    with_term, without = pm.validation_rows(record), pm.validation_rows(even)
    (m1, k1), (m0, k0) = summary(with_term), summary(without)
    assert f"Median |error| {100 * m1:.0f}%, {k1} of 32 rows within 15%" in text
    assert f"goes from median {100 * m0:.1f}% and {k0} of 32 to {100 * m1:.1f}% and {k1} of 32" in text

    def delay0_at_2(rows):
        errors = [r["error"] for r in rows if r["np"] == 2 and not r["delay"]]
        return 100 * statistics.mean(errors), 100 * min(errors), 100 * max(errors)
    mean0, lo0, hi0 = delay0_at_2(without)
    mean1, lo1, hi1 = delay0_at_2(with_term)
    assert mean0 < 0 and abs(mean1) < abs(mean0)
    assert (f"{-mean0:.1f}% too fast on average (−{-lo0:.0f}% to +{hi0:.0f}%), with it "
            f"{abs(mean1):.1f}% (−{-lo1:.0f}% to +{hi1:.0f}%)") in text


def test_a_calibration_across_nodes_prints_the_inter_link_for_train():
    """The 1 Gbit/s cluster's recorded calibration (2 and 4 nodes, one rank each): the
    printed --inter-link pair reads back as the fitted link, and with it --topology auto
    takes the hierarchical ring for LeNet at 2 nodes x 2 ranks; a calibration on one node
    prints none."""
    from ringnet.perfmodel.text import inter_link_hint
    from ringnet.comm.hierarchical import parse_inter_link
    from ringnet.placement import group
    from ringnet.parallel import topology_choice
    with open(os.path.join(ROOT, "docs", "bench-model-validation-1gbit.json")) as f:
        rnd = json.load(f)["rounds"][0]
    add = rnd["compute"]["add_ns_per_element"] * 1e-9
    for n, entry in rnd["calibration"]["by_np"].items():
        record = calibration.calibration_record(int(n), entry["raw"], add)
        hint = inter_link_hint(int(n), record)
        assert hint.startswith(f"across {n} nodes;"), hint
        pair = hint.split("--inter-link ")[1].split()[0]
        alpha, beta = parse_inter_link(pair)
        assert alpha == pytest.approx(record["alpha_s"], rel=5e-3)
        assert 1 / beta == pytest.approx(record["beta_Bps"], rel=5e-4)
        names = ["a", "a", "b", "b"]
        assert topology_choice("ring", build_model("lenet"), group(names, names, 0),
                               inter_link=pair)[0] == "hierarchical"
        one_node = dict(entry["raw"], placement=dict(entry["raw"]["placement"], per_node=int(n)))
        assert inter_link_hint(int(n), dict(record, raw=one_node)) is None
