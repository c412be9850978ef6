"""Compute profiles from the roofline (ringnet.perfmodel.roofline, compute): LeNet conv1's
FLOPs, and a profile's round trip through its JSON file."""
import json

import pytest

from ringnet import perfmodel as pm
from ringnet.perfmodel import roofline
from ringnet.models import build_model


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
