"""Compute profiles from the roofline (ringnet.perfmodel.roofline, compute): LeNet conv1's
FLOPs, a profile's round trip through its JSON file, a profile measured under a quota."""
import dataclasses
import json

import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import roofline
from ringnet.perfmodel.compute import compute_from_json
from ringnet.models import build_model


def test_roofline_flops_of_lenet_conv1():
    lenet = build_model("lenet")
    (_, conv1), (_, in_shape, out_shape) = lenet.layers[0], lenet.shapes[0]
    flops, _, _ = roofline._layer_work(conv1, in_shape, out_shape)
    assert flops == 2 * 1 * 5 * 5 * 20 * 24 * 24


def test_a_profile_measured_under_a_quota_keeps_it_and_runs_faster_with_a_core():
    """A profile timed busy under a CFS quota of q < 1 cores names q; its full-speed
    profile is every time times q (the thread ran q of the time), and reads back so."""
    compute = pm.roofline_compute("k40", ("lenet",))
    assert compute.quota is None and compute.full_speed() is compute
    assert compute.full_speed(0.5).step_compute("lenet", 64) == pytest.approx(
        0.5 * compute.step_compute("lenet", 64))
    held = dataclasses.replace(compute, quota=0.25)
    back = compute_from_json(json.loads(json.dumps(held.to_json())))
    assert back.quota == 0.25 and "quota" not in compute.to_json()
    fast = back.full_speed(0.5)                 # its own quota, not the one assumed
    assert fast.quota is None
    for name in ("lenet",):
        assert fast.step_compute(name, 32) == pytest.approx(0.25 * held.step_compute(name, 32))
        assert fast.overhead_s(name, 32) == pytest.approx(0.25 * held.overhead_s(name, 32))
    assert fast.update(1000) == pytest.approx(0.25 * held.update(1000))
    assert fast.add(1000) == pytest.approx(0.25 * held.add(1000))
    # measured where no quota held it below a core: as it is, whatever is assumed
    unheld = dataclasses.replace(held, quota=1.0)
    assert unheld.full_speed(0.5) is unheld


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
