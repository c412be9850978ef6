"""Compute profiles measured through training steps (ringnet.perfmodel.profiling): a step's
split telescopes to the step, the parts add up to the median step, the layer costs of a
clock the test controls come back exactly, and the isolated profile keeps one model per batch.
"""
import io

import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import profiling
from ringnet.models import build_model


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
    monkeypatch.setattr(time, "thread_time", clock)     # the compute spans' CPU time too

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

    # measured in a control group held to a quarter of a core: the profile says so
    from ringnet import placement
    monkeypatch.setattr(placement, "cpu_quota", lambda: 0.25)
    shown = io.StringIO()
    compute = pm.measure_compute(["lenet"], batches=(16, 32, 64), rounds=2, steps=3, progress=shown)
    assert compute.quota == 0.25
    for held, named in ((None, 1.0), (1.0, 1.0), (2.5, 1.0), (0.5, 0.5)):
        monkeypatch.setattr(placement, "cpu_quota", lambda held=held: held)
        assert profiling._quota() == named
    # what it is measuring, as it goes: a line per model and round
    assert shown.getvalue().split("\r")[1:] == [
        f"measuring the compute here: lenet (1/1), round {r}/2 " for r in (1, 2)]
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
        # the training thread's CPU time in forward, loss and backward (not the update)
        compute_s = 3 * sum(fwd_s(i, b) for i in range(n)) + loss_s(b)
        assert compute.compute_cpu_ms["lenet"][b] == pytest.approx(1e3 * compute_s, rel=1e-6)
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


def test_under_a_quota_the_parts_add_up_to_the_mean_step():
    # steps of one work under a CFS quota end at whole periods: 20 or 30 ms. Their median
    # (20) is one of the two; the mean (24) is the rate the quota allows, and the parts
    # are scaled to it
    rows = [([1.0], [2.0], 1.0, 1.0, s) for s in (20.0, 30.0, 20.0, 20.0, 30.0)]
    assert profiling._step_medians(rows)[-1] == 20.0
    got = profiling._step_medians(rows, mean=True)
    assert got == pytest.approx([4.8, 9.6, 4.8, 4.8, 24.0])
    assert sum(got[:-1]) == pytest.approx(got[-1])


def test_under_a_quota_a_hold_in_most_steps_of_one_part_is_left_out_of_the_split():
    # a quota's hold (here 5 ms) lands where the step's budget runs out: with steps of one
    # length it lands in the same part step after step (the "rest", in 4 of 5 steps). Its
    # median holds it; the least time each part took leaves it out, so the parts keep the
    # proportions of their own work (1 : 2 : 1 : 1) and are scaled to the mean step
    rows = [([1.0], [2.0], 1.0 + hold, 1.0, 5.0 + hold)
            for hold in (5.0, 5.0, 0.0, 5.0, 5.0)]
    median = profiling._step_medians(rows)
    assert median[2] == 6.0                     # the median keeps the hold in the rest
    got = profiling._step_medians(rows, mean=True)
    assert got == pytest.approx([1.8, 3.6, 1.8, 1.8, 9.0])
    assert sum(got[:-1]) == pytest.approx(got[-1])


def test_the_profile_takes_the_mean_step_only_under_a_quota(monkeypatch):
    from ringnet import placement
    asked = []
    step_medians = profiling._step_medians

    def spy(rows, mean=False):
        asked.append(mean)
        return step_medians(rows, mean)
    monkeypatch.setattr(profiling, "_step_medians", spy)
    for held, mean in ((None, False), (0.5, True)):
        asked.clear()
        monkeypatch.setattr(placement, "cpu_quota", lambda held=held: held)
        pm.measure_compute(["lenet"], batches=(16, 32), rounds=1, steps=2)
        assert asked == [mean, mean]
