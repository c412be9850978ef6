"""Step predictions (ringnet.perfmodel.prediction): delay 0 adds, delay 1 overlaps; the wait
for peers is paid once per step; delay-0 buckets start during the backward; delay 1's
boundary passes are charged on the training thread; the code facts the model assumes are
the code's (ringnet.perfmodel.codefacts)."""
import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import codefacts, sends
from ringnet.models import build_model

from tests.perfmodel.helpers import layer_parts, round_system


def test_delay0_adds_and_delay1_overlaps():
    system = round_system(update=1e-9)
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


def test_wait_for_peers_is_paid_once_per_step():
    lenet = build_model("lenet")
    system = round_system()
    base = {(m, d): pm.predict(system, lenet, m, d, 4, 64).step_s
            for m, d in (("ring", 0), ("ring", 1), ("tree", 0), ("master", 0), ("split-fc", 0))}
    system.wait_s = 5e-3
    for (mode, delay), step in base.items():
        got = pm.predict(system, lenet, mode, delay, 4, 64).step_s
        # once per step, in every mode
        assert got - step == pytest.approx(5e-3), (mode, delay)
    # one rank: nothing to wait for
    assert pm.predict(system, lenet, "ring", 0, 1, 64).step_s == \
        pytest.approx(pm.predict(round_system(), lenet, "ring", 0, 1, 64).step_s)


def test_buckets_start_during_the_backward(monkeypatch):
    lenet = build_model("lenet")
    system = round_system(alpha=1e-6, beta=1e8)         # bandwidth-bound: 4.3 ms per shard step
    system.compute.layers["lenet"] = [(name, (fa * 1e3, fb * 1e3), (ba * 1e3, bb * 1e3))
                                      for name, (fa, fb), (ba, bb) in system.compute.layers["lenet"]]
    monkeypatch.setattr(sends, "buckets", lambda model, stop: [])
    whole = pm.predict(system, lenet, "ring", 0, 4, 64)
    steps = 6 * (1e-6 + 107770 * 4 / 1e8)          # 2(N-1) steps of one 107770-element shard
    assert whole.step_s == pytest.approx(whole.compute_s + steps, rel=1e-9)
    # one bucket per layer with parameters, last layers first: the ip1 and ip2 buckets'
    # exchanges run while the conv layers' backward goes on
    parts = layer_parts(lenet)
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


def test_delay1_boundary_passes_are_charged_on_the_training_thread():
    # one pass of the in-step update per parameter = 1 ns: the look-ahead's boundary makes 4
    # passes over the gradient region, the plain recurrence 2, delay 0 and single none
    lenet = build_model("lenet")
    system = round_system(update=pm.SGD_PASSES * 1e-9)
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
