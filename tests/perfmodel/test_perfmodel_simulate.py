"""An exchange beside compute (ringnet.perfmodel.simulate), hand-computed: a polled stream, a
driven one that waits for layer boundaries and copies on the training thread, the wait for
a descheduled peer, and the progress ranks use where they span nodes."""
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import exchange, simulate

from tests.perfmodel.helpers import round_system


def test_polled_stream_overlap_hand_computed():
    system = round_system()
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


def test_each_op_at_its_own_rate_beside_compute():
    system = round_system()
    system.cores, system.steal, system.rate, system.ranks_here = 2.0, 0.0, 0.25, 2
    compute = pm.Timeline([], [], {}, 4.0)
    ops = [(0.0, [("msg", 1.0)]), (0.0, [("msg", 1.0)])]
    # the calibrated rate for both: 2 s of exchange need 8 s beside the compute; by its
    # end (4 s) 1 s is done, the other 1 s at full speed after
    assert simulate.simulate_ops(system, compute, ops, "poll")[0] == pytest.approx(5.0)
    assert simulate.simulate_ops(system, compute, ops, "poll", rates=[0.25, 0.25])[0] == \
        pytest.approx(5.0)
    # the first at full speed (1 s), the second at 0.5: 3 s of compute left move 1 s
    assert simulate.simulate_ops(system, compute, ops, "poll", rates=[1.0, 0.5])[0] == \
        pytest.approx(4.0)
    # the first at 0.5 (2 s), the second at the ring's 0.25 (0.5 s in the 2 s left, 0.5 after)
    assert simulate.simulate_ops(system, compute, ops, "poll", rates=[0.5, 0.25])[0] == \
        pytest.approx(4.5)


def test_driven_stream_waits_for_layer_boundaries():
    system = round_system()
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
    system = round_system()
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


def test_peer_wait_beside_compute_is_in_the_calibrated_rate():
    # a message's wait for a descheduled peer costs its time after the compute, and nothing
    # beside it (the stream's calibrated rate there was measured with the ranks oversubscribed)
    system = round_system()
    system.cores, system.ranks_here = 1.0, 1
    layers = pm.Timeline([1.0, 2.0, 3.0, 4.0], [], {}, 4.0)
    assert exchange.message_time(pm.Link("x", 0.1, 1.0), 0.3, 0.5) == [("msg", 0.1), ("copy", 0.3), ("peer", 0.5)]
    beside = [(0.0, [("msg", 0.1), ("peer", 5.0)])]
    assert simulate.simulate_ops(system, layers, beside, "driven") == pytest.approx((4.0, 0.0))
    assert simulate.simulate_ops(system, layers, beside, "poll") == pytest.approx((4.0, 0.0))
    after = [(4.0, [("msg", 0.1), ("peer", 0.5)])]
    assert simulate.simulate_ops(system, layers, after, "driven") == pytest.approx((4.6, 0.0))


def test_ranks_across_nodes_progress_as_the_code_does_there():
    import dataclasses
    from ringnet.perfmodel.codefacts import facts
    from ringnet.perfmodel.simulate import progress_of
    from ringnet.perfmodel.system import System
    from ringnet.perfmodel.links import Link
    link = Link("x", 1e-4, 1e8)
    system = System("local", link, link, 1 << 30, None, cores=2)
    placed = dataclasses.replace(system, placed_per_node=1)
    with facts({"progress": "driven", "progress_nodes": "poll", "bucket_bytes": 0,
                "rooted_concurrent": True}):
        assert progress_of(system, 2) == "driven"         # one node, as before
        assert progress_of(placed, 1) == "driven"
        assert progress_of(placed, 2) == "poll"           # the ranks span 2 nodes
    with facts({"progress": "driven", "bucket_bytes": 0, "rooted_concurrent": True}):
        assert progress_of(placed, 2) == "driven"         # a record that did not say
