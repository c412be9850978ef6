"""Ratios of things timed alternately (bench layers --vs torch, bench comm): the ratio and how far it
moves, from samples taken in pairs."""
import json
import types

import numpy as np
import pytest

from ringnet.bench import layers, paired_quartiles
from ringnet.models import build_model


def test_paired_quartiles_divide_each_step_by_its_partner():
    # every pair 0.5 apart, though both sides move 4x: the ratio does not move
    assert paired_quartiles([10, 20, 30, 40], [20, 40, 60, 80]) == [0.5, 0.5]
    # ratios 0.8 .. 1.2 in shuffled order: the quartiles of the five ratios (linear: 0.9, 1.1)
    ours, theirs = [1.2, 0.8, 3.0, 2.2, 0.9], [1.0, 1.0, 3.0, 2.0, 1.0]
    assert paired_quartiles(ours, theirs) == pytest.approx([0.9, 1.1])
    # pairs are by index: the same values paired otherwise give other quartiles
    assert paired_quartiles(ours, theirs[::-1]) != pytest.approx([0.9, 1.1])


def test_step_times_pairs_each_step_with_the_torch_step_after_it(monkeypatch):
    """With a scripted clock: ratio = median(ours) / median(torch), quartiles of the pairs."""
    pytest.importorskip("torch")
    iters = 5
    ours = [0.010, 0.030, 0.011, 0.020, 0.012]
    theirs = [0.020, 0.050, 0.010, 0.040, 0.016]
    durations = [0.5, 0.5, 0.5, 0.5] + [d for pair in zip(ours, theirs) for d in pair]  # 2 warm-ups
    clock = {"now": 0.0, "i": 0}

    def perf_counter():
        # three readings per step: before ours, between, after torch's
        now = clock["now"]
        phase = clock["i"] % 3
        if phase in (0, 1):
            clock["now"] += durations.pop(0)
        clock["i"] += 1
        return now
    monkeypatch.setattr(layers, "time", types.SimpleNamespace(
        perf_counter=perf_counter, process_time=layers.time.process_time))
    model = build_model("lenet", dtype="float32", seed=0)
    x, y = layers._batch(model, 2, 0)
    result = layers.step_times(model, x, y, iters, vs_torch=True)
    assert result["step_ms"] == pytest.approx(np.median(ours) * 1e3)
    assert result["torch_step_ms"] == pytest.approx(np.median(theirs) * 1e3)
    assert result["ratio_vs_torch"] == pytest.approx(np.median(ours) / np.median(theirs))
    ratios = np.array(ours) / np.array(theirs)
    assert result["ratio_quartiles"] == pytest.approx(list(np.percentile(ratios, [25, 75])))


def test_bench_comm_pairs_each_iteration_with_natives(monkeypatch, capsys):
    """bench comm (one rank, scripted clock): x native is the ratio of the medians, its
    quartiles those of native's time over auto's in the same iteration."""
    from ringnet.bench import comm
    native = [10e-6, 12e-6, 30e-6, 11e-6, 13e-6]
    auto = [9e-6, 15e-6, 20e-6, 11e-6, 10e-6]
    durations = [5e-6, 5e-6] + [d for pair in zip(native, auto) for d in pair]  # 1 warm-up
    clock = {"now": 0.0, "calls": 0}

    def perf_counter():
        # two readings per timed call: its start, then its end after the scripted duration
        if clock["calls"] % 2:
            clock["now"] += durations.pop(0) * comm.repetitions(8)
        clock["calls"] += 1
        return clock["now"]
    monkeypatch.setattr(comm, "time", types.SimpleNamespace(perf_counter=perf_counter))
    assert comm.main(["--algos", "native,auto", "--sizes", "8", "--iters", "5", "--warmup", "1",
                      "--transport", "mpi", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = next(r for r in doc["rows"] if r["algo"] == "auto")
    assert row["vs_native"] == pytest.approx(np.median(native) / np.median(auto))
    assert row["vs_native_quartiles"] == pytest.approx(
        list(np.percentile(np.array(native) / np.array(auto), [25, 75])))
    assert not durations                       # every scripted iteration was timed
