"""The per-step budget of the GPU path (``python -m ringnet.bench budget``), measured on
the recording stand-in for CuPy without a GPU: kernel launches and host waits of one
single-mode training step (forward, loss, backward, SGD update).

LeNet's step is 25 launches and no host wait: 12 fused kernels, 11 GEMMs and 2
bias-gradient sums (34 before the biases went to the next layer's kernel, 50 before the
fused loss).
"""
import json

import numpy as np
import pytest

from ringnet.bench import budget
from ringnet.testing import recording_cupy
from ringnet.layers import cuda_kernels
from ringnet.models import build_model
from ringnet.optim import SGD

BUDGET = {  # model -> (most launches, most host waits) of one step
    "lenet": (25, 0),
    "cifar10_quick": (41, 0),
}


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_a_training_step_keeps_its_budget(name):
    result = budget.step_budget(name, batch_size=16)
    launches, waits = BUDGET[name]
    print(f"{name}: {result['launches']} launches, {result['host_waits']} host waits, "
          f"{result['allocations']} allocations")
    assert result["host_waits"] <= waits, [e for e in result["events"] if e[0] == "host_wait"]
    assert result["launches"] <= launches, result["phases"]
    kernels = {e[1] for e in result["events"] if e[0] == "kernel"}
    assert {"xent_rows", "xent_total", "ringnet_sgd_update", "im2col"} <= kernels  # GPU branches


@pytest.mark.parametrize("name", ["lenet", "cifar10_quick", "carnet"])
def test_the_stand_in_step_computes_what_the_numpy_step_computes(name):
    # Same weights and batch: the GPU branches on the stand-in (the kernels emulated, the
    # biases handed to the next layer's kernel) give the CPU step's loss and gradients.
    rec = budget.Recorder()
    rng = np.random.default_rng(0)
    cpu = build_model(name)
    x = rng.normal(size=(8,) + cpu.input_shape).astype(np.float32)
    y = rng.integers(0, cpu.num_classes, size=8)
    cpu.params[...] += rng.normal(scale=0.05, size=cpu.num_params).astype(np.float32)  # biases
    want = cpu.loss_and_grad(x, y)
    with budget.recording(rec):
        model = build_model(name, xp=rec)
        model.params[...] = cpu.params
        loss, correct = model.loss_and_grad(x, y)
        assert isinstance(loss, budget.DeviceArray) and not rec.totals()["host_waits"]
        assert float(loss) == pytest.approx(want[0], rel=1e-5) and int(correct) == want[1]
        assert rec.totals()["host_waits"] == 2
        np.testing.assert_allclose(model.grads, cpu.grads, rtol=1e-3, atol=1e-6)
        # the fused update against NumPy's, on the same gradients
        opt = SGD(model.num_params, 0.1, xp=rec, dtype=model.dtype)
        ref = SGD(cpu.num_params, 0.1, dtype=cpu.dtype)
        grads, params = np.array(model.grads), np.array(model.params)
        for _ in range(2):
            opt.step(model.params, model.grads, 0)
            ref.step(params, grads, 0)
        np.testing.assert_allclose(model.params, params, rtol=1e-5, atol=1e-7)
    assert cuda_kernels.launch is not None and recording_cupy._ACTIVE == []


def test_the_stand_in_counts_each_kind_of_operation():
    rec = budget.Recorder()
    with budget.recording(rec):
        a = rec.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))   # transfer
        b = a + 1                                                       # ufunc, allocation
        b += a                                                          # ufunc in place
        s = b.sum(axis=0)                                               # reduction
        rec.matmul(a, b.T)                                              # gemm
        a.T.reshape(-1)                                                 # copy (not a view)
        a.reshape(-1)                                                   # a view: nothing
        b[0] = 5                                                        # copy
        b[[0, 2]]                                                       # gather
        float(s[0])                                     # a 0-d copy, then a host wait
        rec.asnumpy(s)                                                  # host wait
    t = rec.totals()
    assert (t["transfers"], t["ufunc"], t["reduction"], t["gemm"]) == (1, 2, 1, 1)
    assert t["copy"] == 4 and t["host_waits"] == 2 and t["launches"] == 8
    assert float(s[0]) == 3 * 2 * 4 + 3 and not recording_cupy._ACTIVE    # no counting outside


def test_bench_budget_prints_a_table_and_json(capsys):
    assert budget.main(["--model", "lenet", "--batch-size", "8", "--phases"]) == 0
    out = capsys.readouterr().out
    assert "launches" in out and "lenet" in out and "loss" in out
    assert budget.main(["--model", "digits", "--batch-size", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"][0]["model"] == "digits" and data["models"][0]["host_waits"] == 0
    with pytest.raises(SystemExit):
        budget.main(["--help"])
