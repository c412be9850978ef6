"""Exchange times (ringnet.perfmodel.exchange) against sums written out by hand for a link
with round numbers, and the communicators' code held to what the model times:

* the ring (with adds, a token bucket's burst, a slower hop between nodes), the tree and the
  master (serial and concurrent receives, pipelined pieces);
* auto runs the rounds of the cost table the model times, and the model's auto is the
  algorithm the code picks;
* the tree's and the master's pieces are the communicators' cuts, and their receives are
  posted as the model assumes.
"""
import numpy as np
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import exchange
from ringnet.models import build_model
from ringnet.shards import shard_bounds

from tests.perfmodel.helpers import ALPHA, BETA, record_run, recording_transport, round_system


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
            transport = recording_transport(rank, n)
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
    system = round_system()
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
        comm = cls(recording_transport(0, n))
        assert comm._pieces(buf) == cls.pieces(length, 4, n)
        assert exchange._pieces(length, 4, cls.name, n) == cls.pieces(length, 4, n)
        # the root receives every sender's piece as one message: pieces x senders
        run = record_run(cls.name, 0, n, length)
        senders = 2 if cls is TreeCommunicator and n > 2 else 1 if cls is TreeCommunicator else n - 1
        receives = sum(1 for kind, (_, _, src) in run.log if kind == "post" and src is not None)
        assert receives == len(cls.pieces(length, 4, n)) * senders


def test_rooted_receives_are_posted_as_the_model_assumes():
    # concurrent: the root posts its receive from worker 2 before it waits on worker 1's;
    # serial: it waits on each receive before posting the next
    runs = record_run("master", 0, 3, 1000)
    first_wait = next(i for i, (what, _) in enumerate(runs.log) if what == "wait")
    posts_before = sum(what == "post" for what, _ in runs.log[:first_wait])
    assert (posts_before == 2) == exchange._rooted_concurrent()


def test_ring_time_hand_computed():
    system = round_system()
    bounds = shard_bounds(1000, 4)             # 250 elements = 1000 bytes per step
    step = ALPHA + 1000 / BETA
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * step)
    add = round_system(add=1e-6)                       # + 250 adds of 1 us each per step
    assert exchange.ring_time(add, bounds, 4, "rs") == pytest.approx(3 * (step + 250e-6))
    assert exchange.ring_time(system, shard_bounds(1000, 1), 4, "rs") == 0.0


def test_a_full_token_bucket_passes_its_burst_at_the_wire_s_speed():
    """A ring collective on links with a token bucket (1500 bytes; 100 us per message at
    1 MB/s, so a latency refills 100 bytes): a rank's bytes its tokens cover cost only the
    latency, the rest the shaped rate, and the tokens refill while its link sends nothing.
    After compute (after_idle) every bucket starts full, else empty."""
    import dataclasses
    alpha, beta = 1e-4, 1e6
    system = round_system(alpha=alpha, beta=beta)
    bounds = shard_bounds(1000, 4)             # 3 steps of 1000 bytes on every link
    bucket = dataclasses.replace(system.intra, burst_bytes=1500)
    shaped = dataclasses.replace(system, intra=bucket, inter=bucket)
    # empty: 1000 bytes at the rate, then 100 bytes covered in each later step
    assert exchange.ring_time(shaped, bounds, 4, "ag") == \
        pytest.approx(3 * alpha + (3000 - 2 * 100) / beta)
    # full: 1000 covered; 500 left + 100 refilled = 600 covered; then 100
    assert exchange.ring_time(shaped, bounds, 4, "ag", after_idle=True) == \
        pytest.approx(3 * alpha + (3000 - 1000 - 600 - 100) / beta)
    big = dataclasses.replace(bucket, burst_bytes=1 << 20)
    assert exchange.ring_time(dataclasses.replace(shaped, intra=big, inter=big), bounds, 4,
                               "ag", after_idle=True) == pytest.approx(3 * alpha)
    # without a bucket every step is its latency and its bytes at the rate
    plain = exchange.ring_time(system, bounds, 4, "ag")
    assert plain == pytest.approx(3 * (alpha + 1000 / beta))


@pytest.mark.parametrize("kind", ["rs", "ag"])
def test_a_single_shard_s_ring_meets_links_that_refilled(kind):
    """One non-empty shard (a delay-0 bucket smaller than a shard): each step one rank sends
    it, the others' links are idle and refill. From empty buckets the first message pays
    the rate, the next ones find their link's bucket refilled by the first step (1100 of
    1500 bytes) and pay only their latency."""
    import dataclasses
    alpha, beta = 1e-4, 1e6
    system = round_system(alpha=alpha, beta=beta)
    bucket = dataclasses.replace(system.intra, burst_bytes=1500)
    shaped = dataclasses.replace(system, intra=bucket, inter=bucket)
    bounds = [(0, 250), (250, 250), (250, 250), (250, 250)]      # 1000 bytes, one shard
    assert exchange.ring_time(shaped, bounds, 4, kind) == \
        pytest.approx(3 * alpha + 1000 / beta)
    # the old rule (no refill within the collective) priced every step at the rate
    assert exchange.ring_time(system, bounds, 4, kind) == pytest.approx(3 * (alpha + 1000 / beta))


def test_the_ring_s_senders_are_the_code_s_schedule():
    """Which rank sends which shard at each step is ringnet.comm.schedules.ring_steps: with
    shards of 1000, 0, 0, 0 bytes and an idle start, the all-gather's first sender is the
    shard's owner (rank 0, its own shard first), the reduce-scatter's is rank 1; either way
    the shard passes each link once, so from full buckets every step is its latency."""
    import dataclasses
    from ringnet.comm.schedules import ring_steps
    assert ring_steps(0, 4)[1][0][0] == 0 and ring_steps(1, 4)[0][0][0] == 0
    alpha, beta = 1e-4, 1e6
    system = round_system(alpha=alpha, beta=beta)
    bucket = dataclasses.replace(system.intra, burst_bytes=1000)
    shaped = dataclasses.replace(system, intra=bucket, inter=bucket)
    bounds = [(0, 250), (250, 250), (250, 250), (250, 250)]
    for kind in ("rs", "ag"):
        assert exchange.ring_time(shaped, bounds, 4, kind, after_idle=True) == \
            pytest.approx(3 * alpha)
    # tokens carried from the reduce-scatter (senders 1, 2, 3) to the all-gather (senders
    # 0, 1, 2): rank 1 sent at the reduce-scatter's step 0 and has refilled three latencies
    # (300 bytes) and the all-gather's step 0 (100) since, so its step pays 600 bytes at the
    # rate; during that step rank 2 refills to the full 1000
    tokens = [1000.0] * 4
    rs = exchange._ring_items(shaped, bounds, 4, "rs", tokens=tokens)
    ag = exchange._ring_items(shaped, bounds, 4, "ag", tokens=tokens)
    assert sum(t for _, t in rs) == pytest.approx(3 * alpha)
    assert sum(t for _, t in ag) == pytest.approx(3 * alpha + 600 / beta)


def test_the_rooted_routes_meet_the_links_token_buckets():
    """Tree and master on links with token buckets of 1500 bytes (100 us per message,
    1 MB/s): a transfer's bytes that the buckets of both ends cover pass at the wire's
    speed. Master, N = 2, 1000 bytes: from full buckets the reduce and the broadcast are
    each their latency; from empty ones the reduce pays all but the 100 bytes its latency
    refilled, and the broadcast meets the root's link to the worker refilled during the
    reduce. Tree, N = 3: the root's link to it takes both children's 1000 bytes at once and
    covers 1500 of them, and so does its link from it in the broadcast."""
    import dataclasses
    alpha, beta = 1e-4, 1e6
    system = round_system(alpha=alpha, beta=beta)
    bucket = dataclasses.replace(system.intra, burst_bytes=1500)
    shaped = dataclasses.replace(system, intra=bucket, inter=bucket)
    assert exchange.master_time(shaped, 2, 1000, 250, after_idle=True) == \
        pytest.approx((alpha, alpha))
    assert exchange.master_time(shaped, 2, 1000, 250) == \
        pytest.approx((alpha + 900 / beta, alpha))
    assert exchange.tree_time(shaped, 3, 1000, 250, after_idle=True) == \
        pytest.approx((alpha + 500 / beta, alpha + 500 / beta))
    # without a bucket, as before: every byte at the rate
    assert exchange.tree_time(system, 3, 1000, 250, after_idle=True) == \
        pytest.approx((alpha + 2000 / beta, alpha + 2000 / beta))
    assert exchange.master_time(system, 2, 1000, 250, after_idle=True) == \
        pytest.approx((alpha + 1000 / beta, alpha + 1000 / beta))


def test_inter_node_hop_sets_the_ring_pace():
    slow = pm.Link("slow", 2 * ALPHA, BETA / 10)
    system = round_system(ranks_per_node=2)
    system.inter = slow
    bounds = shard_bounds(1000, 4)
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * slow.time(1000))
    system.ranks_per_node = 4
    assert exchange.ring_time(system, bounds, 4, "ag") == pytest.approx(3 * (ALPHA + 1000 / BETA))


def test_tree_and_master_times_hand_computed(monkeypatch):
    system = round_system()
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
    add = round_system(add=1e-6)                                    # + two adds of 250 per piece
    reduce, _ = exchange.tree_time(add, 3, nbytes, 1000)
    assert reduce == pytest.approx(4 * (ALPHA + 2 * nbytes / 4 / BETA) + 2 * 250e-6)
