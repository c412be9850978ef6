"""A system's cores (ringnet.perfmodel.system): compute slows down past the cores, and the wait
for a descheduled peer matches a simulation of ranks taking turns on their cores."""
import dataclasses

import numpy as np
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import sends, topology
from ringnet.models import build_model

from tests.perfmodel.helpers import round_system, waits_raw


def test_cpu_contention_slows_compute_past_the_cores():
    system = round_system()
    system.cores = 2.0
    assert [system.contention(n) for n in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    lenet = build_model("lenet")
    free = pm.predict(round_system(), lenet, "ring", 0, 4, 64).compute_s
    assert pm.predict(system, lenet, "ring", 0, 4, 64).compute_s == pytest.approx(2 * free)


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


def _calibration(per_node=None):
    """Raw local calibrations at N = 2 and 4 on one core a node, whose loaded exchanges
    waited for descheduled peers, the ranks placed ``per_node`` to a node by the launcher
    (None: all on this one)."""
    by_np = {}
    for n in (2, 4):
        raw = waits_raw(n, 0.02, 1e-4)
        raw.update(cores=1, together_s=raw["solo_s"],
                   models={"lenet": {"batch": 64 // n, "calls": 1, "solo_s": 0.01,
                                     "together_s": 0.01, "imbalance": 1.1}})
        if per_node:
            raw["placement"] = {"per_node": per_node, "launcher": "srun --mpi=pmi2"}
        by_np[str(n)] = {"raw": raw}
    return {"by_np": by_np}


def test_a_calibration_on_a_cluster_places_the_ranks_as_it_did():
    """Calibrated with one rank a node (the launcher placed them so), N ranks do not share
    one node's core: no contention, no wait for descheduled peers, the imbalance of ranks
    that each have a core; calibrated on one node, the same N ranks share its core."""
    compute = pm.roofline_compute("k40", ("lenet",))
    lenet = build_model("lenet")
    cluster = pm.make_system("local", compute, 1, _calibration(per_node=1))
    one_node = pm.make_system("local", compute, 1, _calibration())
    assert cluster.placed_per_node == 1
    assert one_node.placed_per_node is None and one_node.ranks_per_node > 4
    for n in (2, 4):
        spread = cluster.at(n)
        assert spread.contention(n, "lenet") == 1.0
        assert spread.wait_s == 0.0 and spread.msg_wait_s == 0.0
        assert spread.imbalance == {"lenet": 1.1}
        shared = one_node.at(n)
        assert shared.contention(n, "lenet") == n
        assert shared.wait_s == pytest.approx(0.02, rel=0.05)     # the loaded wait it measured
        assert shared.imbalance is None
    alone = pm.predict(cluster, lenet, "single", 0, 1, 16).compute_s
    assert pm.predict(cluster, lenet, "tree", 0, 4, 64).compute_s == pytest.approx(alone, rel=0.02)
    assert pm.predict(one_node, lenet, "tree", 0, 4, 64).compute_s > 3.5 * alone


def test_two_ranks_a_node_price_the_hierarchical_exchange_on_the_node_s_link_and_the_network():
    """Calibrated with two ranks a node (N = 2 on one node, N = 4 on two): at N = 4 the
    hierarchical exchange runs within each node on the link calibrated at N = 2 and between
    the nodes on the one calibrated at N = 4, as a profile of those two links with two ranks
    a node would; the flat exchange keeps the N = 4 link alone. One rank a node has no link
    within a node, and its hierarchical prediction is the flat one."""
    compute = pm.roofline_compute("k40", ("lenet",))
    lenet = build_model("lenet")
    calibration = _calibration(per_node=2)
    calibration["by_np"]["2"]["raw"]["blocking"] = {"4096": 0.0004, "1048576": 0.0010}
    system = pm.make_system("local", compute, 1, calibration)
    node, across = system.at(2).intra, system.at(4).inter
    assert node.beta_Bps > 5 * across.beta_Bps          # the node's link is the faster one
    at4 = system.at(4)
    assert (at4.node_link.alpha_s, at4.node_link.beta_Bps) == (node.alpha_s, node.beta_Bps)
    layout = at4.layout()
    assert layout.ranks_per_node == 2 and layout.intra is at4.node_link
    assert layout.inter is at4.inter and layout.links_per_node == 1     # one link a node
    # the exchange priced is the channels' on those two links, two ranks a node sharing
    # the node's link (the contention stays the calibration's: four ranks on the two
    # nodes' cores)
    by_hand = dataclasses.replace(at4, intra=node, ranks_per_node=2, links_per_node=1)
    a_link_each = dataclasses.replace(by_hand, links_per_node=None)
    for delay in (0, 1):
        hier = pm.predict(system, lenet, "ring", delay, 4, 64, topology="hierarchical")
        flat = pm.predict(system, lenet, "ring", delay, 4, 64)
        whole, _, _ = sends.step(lenet, "ring", 4, 64, delay)
        def comm(system):
            items = topology.hierarchical_items(system, 4, whole.parts[0], 0.0)
            return sum(t for kind, t in items if kind in ("msg", "copy", "peer"))
        assert hier.comm_s == pytest.approx(comm(by_hand))
        assert comm(a_link_each) < 0.8 * comm(by_hand)   # the channels' link shared by two
        assert hier.comm_s < flat.comm_s                 # half of it on the faster link
    one_a_node = pm.make_system("local", compute, 1, _calibration(per_node=1))
    assert one_a_node.at(4).node_link is None and one_a_node.at(4).layout() is not None
    assert pm.predict(one_a_node, lenet, "ring", 1, 4, 64, topology="hierarchical").step_s == \
        pm.predict(one_a_node, lenet, "ring", 1, 4, 64).step_s


def _half_core_nodes():
    """A calibration on nodes of half a core, one rank a node (quota 0.5 in its raw)."""
    calibration = _calibration(per_node=1)
    for entry in calibration["by_np"].values():
        entry["raw"]["quota"] = 0.5
    return calibration


def test_a_node_held_to_a_quota_computes_at_full_speed_while_it_waits():
    """One rank a node on nodes of half a core (the profile measured busy there): a step
    whose rank mostly waits for a slow link computes at a full core's speed (half the
    profile), and a step that is mostly compute is held to its CPU time over the quota
    (the single step is the profile's own); at delay 1, where the exchange runs beside the
    whole compute, the compute is held as the profile was; with two ranks a node, or no
    quota, the prediction is as before."""
    compute = pm.roofline_compute("k40", ("lenet",)).scaled(40.0)    # CPU-like times
    lenet = build_model("lenet")
    held = pm.make_system("local", compute, 1, _half_core_nodes())
    free = pm.make_system("local", compute, 1, _calibration(per_node=1))
    assert held.at(4).quota == 0.5 and free.at(4).quota is None
    single, single_free = (pm.predict(s, lenet, "single", 0, 1, 64) for s in (held, free))
    assert single.step_s == pytest.approx(single_free.step_s, rel=1e-9)
    # a slow link (1 MB/s): the exchange decides; compute at a full core's speed
    slow = dataclasses.replace(free.at(4), calibrated=None,
                               inter=pm.Link("slow", 1e-3, 1e6), intra=pm.Link("slow", 1e-3, 1e6))
    slow_held = dataclasses.replace(slow, quota=0.5)
    waits, busy = (pm.predict(s, lenet, "tree", 0, 4, 64) for s in (slow_held, slow))
    assert waits.compute_s == pytest.approx(0.5 * busy.compute_s, rel=1e-6)
    assert waits.step_s < busy.step_s
    assert waits.step_s >= (waits.compute_s + waits.update_s) / 0.5
    # a fast link: the compute decides, and the quota holds the step to CPU time / 0.5
    fast = dataclasses.replace(slow, inter=pm.Link("fast", 0.0, 1e15), intra=pm.Link("fast", 0.0, 1e15))
    fast_held = dataclasses.replace(fast, quota=0.5)
    bound = pm.predict(fast_held, lenet, "ring", 0, 4, 64)
    unheld = pm.predict(dataclasses.replace(fast, compute=compute.full_speed(0.5)), lenet, "ring", 0, 4, 64)
    assert bound.step_s == pytest.approx((unheld.compute_s + unheld.update_s) / 0.5, rel=1e-9)
    assert bound.step_s > unheld.step_s and bound.exposed_s == 0.0
    # the stream's rate was measured under the quota: beside compute at a full core's
    # speed (delay 0, the buckets during the backward), running, it moves at rate / q
    streamed = dataclasses.replace(slow, rate=0.3, steal=0.2)
    at_speed = dataclasses.replace(streamed, rate=0.6, compute=compute.full_speed(0.5))
    bucketed = pm.predict(dataclasses.replace(streamed, quota=0.5), lenet, "ring", 0, 4, 64)
    assert bucketed.step_s == pytest.approx(pm.predict(at_speed, lenet, "ring", 0, 4, 64).step_s,
                                            rel=1e-9)
    # delay 1: the exchange runs beside the whole compute, which is held as the profile was;
    # the stream at the rate measured beside such compute, polling on a CPU of its own
    delayed = pm.predict(dataclasses.replace(streamed, quota=0.5), lenet, "ring", 1, 4, 64)
    by_hand = pm.predict(dataclasses.replace(streamed, steal=0.0), lenet, "ring", 1, 4, 64)
    assert delayed.step_s == pytest.approx(by_hand.step_s, rel=1e-9)
    assert delayed.compute_s == pytest.approx(by_hand.compute_s, rel=1e-9)
    assert delayed.step_s != pytest.approx(pm.predict(at_speed, lenet, "ring", 1, 4, 64).step_s,
                                           rel=1e-3)
    # the rate of the delayed exchange beside one step of the model, where the calibration
    # timed it, replaces the one measured beside compute back to back; delay 0 keeps that
    for rate in (0.05, 0.9):
        own = dataclasses.replace(streamed, quota=0.5, delayed_rate={"lenet": rate})
        by_hand = pm.predict(dataclasses.replace(streamed, steal=0.0, rate=rate), lenet, "ring", 1,
                             4, 64)
        assert pm.predict(own, lenet, "ring", 1, 4, 64).step_s == pytest.approx(by_hand.step_s,
                                                                                 rel=1e-9)
        assert pm.predict(own, lenet, "ring", 0, 4, 64).step_s == bucketed.step_s
    other = dataclasses.replace(streamed, quota=0.5, delayed_rate={"cifar10_quick": 0.9})
    assert pm.predict(other, lenet, "ring", 1, 4, 64).step_s == delayed.step_s
    fast_loop, slow_loop = (pm.predict(dataclasses.replace(streamed, quota=0.5,
                                                           delayed_rate={"lenet": r}),
                                       lenet, "ring", 1, 4, 64).step_s for r in (0.9, 0.05))
    assert fast_loop < slow_loop
    # two ranks a node share its quota as before: no change
    two = _calibration(per_node=2)
    for entry in two["by_np"].values():
        entry["raw"]["quota"] = 0.5
    shared = pm.make_system("local", compute, 1, two)
    plain = pm.make_system("local", compute, 1, _calibration(per_node=2))
    assert pm.predict(shared, lenet, "ring", 1, 4, 64).step_s == pm.predict(plain, lenet, "ring", 1, 4, 64).step_s


def test_a_rooted_route_s_buckets_move_at_the_rate_measured_for_it():
    """Where the calibration timed the master's (or tree's) reduce + broadcast beside
    compute, that route's delay-0 buckets move at its rate, not the ring's: the same step as
    a system whose ring rate is that rate; the other routes keep the ring's; under a quota
    of q it runs at rate / q (at most 1) as the ring's does; the delayed step keeps the
    rate measured beside one step of the model."""
    compute = pm.roofline_compute("k40", ("lenet",)).scaled(40.0)
    lenet = build_model("lenet")
    held = pm.make_system("local", compute, 1, _half_core_nodes())
    slow = dataclasses.replace(held.at(4), calibrated=None, steal=0.0, quota=None, rate=0.2,
                               inter=pm.Link("slow", 1e-3, 5e7), intra=pm.Link("slow", 1e-3, 5e7))
    own = dataclasses.replace(slow, rooted_rate={"master": 0.6})
    as_ring = dataclasses.replace(slow, rate=0.6)
    master, by_hand, ring_rate = (pm.predict(s, lenet, "master", 0, 4, 64).step_s
                                  for s in (own, as_ring, slow))
    assert master == pytest.approx(by_hand, rel=1e-12)
    assert master < ring_rate                           # a faster stream hides more
    for mode in ("tree", "ring"):
        assert pm.predict(own, lenet, mode, 0, 4, 64).step_s == \
            pm.predict(slow, lenet, mode, 0, 4, 64).step_s
    # under a quota of 0.5: 0.3 measured there runs at 0.6, as a ring rate of 0.3 does
    quota = dataclasses.replace(slow, quota=0.5, rooted_rate={"master": 0.3})
    ring_quota = dataclasses.replace(slow, quota=0.5, rate=0.3)
    assert pm.predict(quota, lenet, "master", 0, 4, 64).step_s == pytest.approx(
        pm.predict(ring_quota, lenet, "master", 0, 4, 64).step_s, rel=1e-12)
    # delay 1 under the quota: the rate beside one step of the model, whatever the route's
    delayed = dataclasses.replace(quota, delayed_rate={"lenet": 0.5})
    assert pm.predict(delayed, lenet, "master", 1, 4, 64).step_s == pm.predict(
        dataclasses.replace(delayed, rooted_rate=None), lenet, "master", 1, 4, 64).step_s


def test_a_compute_longer_than_a_period_s_budget_is_held_past_it():
    """Under a quota of q = 0.5 with period P, a rank that waited computes at a full core's
    speed only for the period's budget q P (the kernel carries none over) and at the quota's
    rate past it: with P equal to the full-speed compute c, the compute takes c/2 + (c/2)/q
    = 1.5 c; with a period whose budget covers the compute, it is c as before. The
    calibration records the period (hpc/cluster.sh's 10 ms where an older worker did not)."""
    compute = pm.roofline_compute("k40", ("lenet",)).scaled(40.0)
    lenet = build_model("lenet")
    held = pm.make_system("local", compute, 1, _half_core_nodes())
    assert held.at(4).quota_period_s == 0.01
    slow = dataclasses.replace(held.at(4), calibrated=None, steal=0.0, quota_period_s=None,
                               inter=pm.Link("slow", 1e-3, 1e6), intra=pm.Link("slow", 1e-3, 1e6))
    c = pm.predict(slow, lenet, "tree", 0, 4, 64).compute_s
    long_ = pm.predict(dataclasses.replace(slow, quota_period_s=c), lenet, "tree", 0, 4, 64)
    assert long_.compute_s == pytest.approx(1.5 * c, rel=1e-9)
    short = pm.predict(dataclasses.replace(slow, quota_period_s=2 * c), lenet, "tree", 0, 4, 64)
    assert short.compute_s == pytest.approx(c, rel=1e-9)
    assert long_.step_s > short.step_s


def test_a_held_timeline_runs_at_the_quota_s_rate_past_the_budget():
    from ringnet.perfmodel.simulate import Timeline
    line = Timeline([1.0, 2.0, 3.0], [(2.5, 3.0)], {0: 3.0, 1: 1.5}, 3.0).held(2.0, 0.5)
    assert line.points == [1.0, 2.0, 4.0] and line.dense == [(3.0, 4.0)]
    assert line.ready == {0: 4.0, 1: 1.5} and line.end == 4.0


def test_a_held_timeline_may_run_below_a_full_core_before_the_budget_is_spent():
    from ringnet.perfmodel.simulate import Timeline
    line = Timeline([1.0, 2.0, 3.0], [(2.5, 3.0)], {0: 3.0, 1: 1.5}, 3.0).held(2.0, 0.5, 0.8)
    # 2 s of work at 0.8 of a core take 2.5 s; the last second at 0.5 takes 2
    assert line.points == pytest.approx([1.25, 2.5, 4.5])
    assert line.dense[0] == pytest.approx((3.5, 4.5)) and line.end == pytest.approx(4.5)
    assert line.ready == pytest.approx({0: 4.5, 1: 1.875})


def test_the_step_s_transfers_cost_cpu_per_message_and_per_byte_sent():
    """``transfer_cpu_s`` against a count by hand: a delay-1 ring at N = 4 sends 2(N-1) = 6
    messages of LeNet's gradient, 2(N-1)/N of it per rank, all on the stream; split-fc's
    activations are priced at the blocking path's cost, its conv prefix at the stream's
    where the code runs it on a stream (delay 1, or delay-0 buckets: cifar10_quick's) and
    at the blocking path's where the training thread exchanges it (LeNet's at delay 0,
    whose conv prefix makes one bucket, so none)."""
    from ringnet.perfmodel.prediction import transfer_cpu_s
    lenet = build_model("lenet")
    params = sum(p.size for p in lenet.params)
    slow = pm.Link("slow", 1e-3, 1e8)             # every message outlasts the wait's spin
    system = dataclasses.replace(round_system(), intra=slow, inter=slow, rooted=None)
    assert transfer_cpu_s(system, lenet, "ring", 4, 64, 1) is None        # not calibrated
    stream = {"per_msg_s": 1e-4, "per_byte_s": 2e-9}
    system = dataclasses.replace(system, cpu_stream=stream,
                                 cpu_blocking={"per_msg_s": 0.0, "per_byte_s": 0.0})
    assert transfer_cpu_s(system, lenet, "ring", 4, 64, 1) == pytest.approx(
        6 * 1e-4 + 2e-9 * 6 / 4 * 4 * params, rel=1e-6)
    # a message that takes less than the calibrated cost spins only as long as it takes
    fast = pm.Link("fast", 2e-5, 1e15)
    quick = dataclasses.replace(system, intra=fast, inter=fast)
    assert transfer_cpu_s(quick, lenet, "ring", 4, 64, 1) == pytest.approx(
        6 * 2e-5 + 2e-9 * 6 / 4 * 4 * params, rel=1e-6)
    assert transfer_cpu_s(system, lenet, "single", 1, 64) == 0.0
    assert transfer_cpu_s(system, lenet, "ring", 1, 64, 1) == 0.0
    costly = dataclasses.replace(system, cpu_blocking={"per_msg_s": 1e-3, "per_byte_s": 0.0})
    cheap = dataclasses.replace(system, cpu_stream={"per_msg_s": 0.0, "per_byte_s": 0.0})
    for model, delay, on_stream in ((lenet, 0, False), (lenet, 1, True),
                                    (build_model("cifar10_quick"), 0, True)):
        whole, bucketed, buckets = sends.step(model, "split-fc", 4, 64, delay)
        assert bool(buckets) == (on_stream and not delay)
        acts = max(sum(t.messages(4)[r] for t in whole.activations) for r in range(4))
        exchange = [t for part in bucketed.parts for t in part.transfers]
        moved = max(sum(t.messages(4)[r] for t in whole.activations + exchange)
                    for r in range(4))
        assert 0 < acts < moved
        stream_part = transfer_cpu_s(system, model, "split-fc", 4, 64, delay)
        if on_stream:        # the exchange at the stream's cost, the activations blocking
            assert stream_part > 0
            assert transfer_cpu_s(costly, model, "split-fc", 4, 64, delay) == \
                pytest.approx(stream_part + acts * 1e-3)
            assert transfer_cpu_s(dataclasses.replace(costly, cpu_stream=cheap.cpu_stream),
                                  model, "split-fc", 4, 64, delay) == pytest.approx(acts * 1e-3)
        else:                # everything on the training thread's blocking waits
            assert stream_part == 0.0
            assert transfer_cpu_s(costly, model, "split-fc", 4, 64, delay) == \
                pytest.approx(moved * 1e-3)
    assert transfer_cpu_s(costly, lenet, "ring", 4, 64, 1) == transfer_cpu_s(system, lenet, "ring", 4, 64, 1)


def test_under_a_quota_the_step_is_no_shorter_than_its_cpu_with_the_transfers():
    """On a node of half a core with the transfers' CPU calibrated, a compute-bound step is
    its CPU over the quota: the compute without the stream's steal (which stood for part of
    that CPU), the update and the transfers' CPU; without the calibration, as before."""
    from ringnet.perfmodel.prediction import transfer_cpu_s
    compute = pm.roofline_compute("k40", ("lenet",)).scaled(40.0)    # CPU-like times
    lenet = build_model("lenet")
    fast = dataclasses.replace(pm.make_system("local", compute, 1, _calibration(per_node=1)).at(4),
                               calibrated=None, inter=pm.Link("fast", 3e-4, 1e15),
                               intra=pm.Link("fast", 3e-4, 1e15), steal=0.2, rooted=None)
    costs = {"per_msg_s": 2e-4, "per_byte_s": 3e-9}
    held = dataclasses.replace(fast, quota=0.5, cpu_stream=costs, cpu_blocking=costs)
    for mode, delay in (("ring", 1), ("ring", 0), ("tree", 0), ("split-fc", 0)):
        bound = pm.predict(held, lenet, mode, delay, 4, 64)
        unheld = pm.predict(dataclasses.replace(fast, compute=compute.full_speed(0.5), steal=0.0),
                            lenet, mode, delay, 4, 64)
        spent = transfer_cpu_s(held, lenet, mode, 4, 64, delay)
        assert spent > 0
        assert bound.step_s == pytest.approx((unheld.compute_s + unheld.update_s + spent) / 0.5,
                                             rel=1e-9), mode
        before = pm.predict(dataclasses.replace(held, cpu_stream=None, cpu_blocking=None),
                            lenet, mode, delay, 4, 64)
        assert bound.step_s > before.step_s
