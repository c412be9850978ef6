"""python -m ringnet.bench budget: kernel launches, allocations and host waits per training step.

One training step of single mode (forward, loss, backward, the SGD update of the whole
flat buffer) runs on a *recording stand-in* for CuPy: an array module that is NumPy
underneath (so every value is computed, and checked, as on the CPU) but whose arrays are
"device arrays", so the layers take their GPU branches. Each operation that would launch
work on a GPU is counted where CuPy would launch it:

=============  ==============================================================
kind           counted for
=============  ==============================================================
``kernel``     a fused CUDA kernel (:func:`ringnet.layers.cuda_kernels.launch`, a CuPy
               ElementwiseKernel)
``ufunc``      an element-wise operation (``a + b``, ``xp.exp``, ``y += b``)
``reduction``  ``sum``, ``max``, ``argmax``, ``mean`` ...
``gemm``       ``matmul`` (one cuBLAS call)
``copy``       a device-to-device copy: ``copy``, ``astype`` to another dtype,
               ``ascontiguousarray`` of a non-contiguous array, ``copyto``, an
               assignment into an array, a gather by an index array, a fill
``transfer``   host to device (``xp.asarray`` of a host array): not a launch
=============  ==============================================================

*allocations* are the new device buffers (an output without ``out=``, ``empty``,
``zeros``, a copy); views cost nothing. *host waits* are the reads of a device value on
the host (``float``, ``int``, ``bool``, ``.item()``, ``.get()``, ``asnumpy``): each one
stops the host until the GPU has caught up, and none fits in a CUDA graph. One array
operation counts once; where CuPy itself makes several launches of one call (a fancy
index, ``take_along_axis``) the count is a lower bound. The step is measured after one
warm-up step, as in training (kernels compiled, layer buffers made).

    python -m ringnet.bench budget                  # every model
    python -m ringnet.bench budget --model lenet --json
"""
import collections
import json
import sys

import numpy as np

from ringnet.bench import machine, options
from ringnet.cli import ArgumentParser
from ringnet import graphs, models, optim
from ringnet.layers import gemm
from ringnet.testing.recording_cupy import (CaptureError, DeviceArray, DeviceMemory,
                                            FreedMemoryError, MemoryPool, Recorder, recording)

__all__ = ["DeviceArray", "Recorder", "CaptureError", "FreedMemoryError", "DeviceMemory",
           "MemoryPool", "recording", "step_budget", "graph_budget", "main"]


def _training(recorder, name, batch_size, dtype, seed):
    """Return (model, SGD, x, y): model ``name`` on the stand-in with the budgets' optimizer
    and one seeded batch (host arrays)."""
    model = models.build_model(name, dtype=dtype, xp=recorder, seed=seed)
    opt = optim.SGD(model.num_params, 0.01, momentum=0.9, weight_decay=5e-4,
                    xp=recorder, dtype=model.dtype)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size,) + model.input_shape).astype(model.dtype)
    y = rng.integers(0, model.num_classes, size=batch_size)
    return model, opt, x, y


def step_budget(name, batch_size=64, dtype="float32", seed=0):
    """Return the counts of one single-mode training step of model ``name`` on the stand-in:
    {"model", "batch_size", totals (see :meth:`Recorder.totals`), "phases": {phase: totals},
    "events": [[kind, name, allocations, where]]}. ``where`` is the layer and pass
    ("conv1 forward"), "loss", "update" or "input"."""
    recorder = Recorder()
    with recording(recorder):
        model, opt, x, y = _training(recorder, name, batch_size, dtype, seed)
        names = [n for n, _ in model.layers]

        def hook(phase, index):            # called after each layer: name what comes next
            if phase == "forward":
                recorder.where = f"{names[index + 1]} forward" if index + 1 < len(names) else "loss"
            else:
                recorder.where = f"{names[index - 1]} backward" if index else "loss: reads"
        loss_backward = model.loss_layer.backward

        def backward():
            dlogits = loss_backward()
            recorder.where = f"{names[-1]} backward"
            return dlogits
        model.loss_layer.backward = backward
        model.layer_hook = hook
        for it in range(2):                             # warm-up, then the measured step
            recorder.events.clear()
            recorder.where = f"input, {names[0]} forward"
            _, _ = model.loss_and_grad(x, y)
            recorder.where = "update"
            opt.step(model.params, model.grads, it)
        model.layer_hook = None
    events = list(recorder.events)
    phases = collections.OrderedDict()
    for event in events:
        phases.setdefault(event[3], []).append(event)
    return {"model": name, "batch_size": batch_size, "dtype": dtype, **recorder.totals(events),
            "phases": {w: recorder.totals(e) for w, e in phases.items()},
            "events": [list(e) for e in events]}


def graph_budget(name, batch_size=64, dtype="float32", seed=0):
    """Return what one single-mode step launches under ``--cuda-graphs`` on the stand-in:
    {"model", "captured": launches inside the graph, "outside": totals (see
    :meth:`Recorder.totals`) of what the step issues besides the graph's one launch}."""
    recorder = Recorder()
    with recording(recorder):
        model, opt, x, y = _training(recorder, name, batch_size, dtype, seed)
        was = gemm.enabled()
        try:
            step = graphs.GraphStep(model, opt, graphs.StandinGraphs(recorder))
            for it in range(graphs.WARMUP + 2):            # warm-up, capture, one replay
                recorder.events.clear()
                step.step(x, y, it)
        finally:
            gemm.enable(was)
    return {"model": name, "batch_size": batch_size, "dtype": dtype,
            "captured": sum(len(graph) for graph in step.graph),   # single mode: one graph
            "replays": step.replays, "outside": recorder.totals()}


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench budget", description=__doc__.split("\n\n")[0],
                       epilog="Counts come from a stand-in for CuPy, on NumPy: no GPU needed.")
    options.add_models(p, "count", shown="every model")
    options.add_batch_size(p, 64, "global batch of the step")
    options.add_dtype(p)
    p.add_argument("--phases", action="store_true", help="print the counts per layer and pass")
    options.add_json(p, "print one JSON line (with every event)")
    return p


def main(argv=None):
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    run = machine.begin(out=sys.stderr if args.json else None)
    results = [step_budget(name, args.batch_size, args.dtype) for name in args.model or models.MODELS]
    graphed = [graph_budget(name, args.batch_size, args.dtype) for name in args.model or models.MODELS]
    if args.json:
        run.end(out=sys.stderr)
        print(json.dumps({"batch_size": args.batch_size, "dtype": args.dtype, "models": results,
                          "cuda_graphs": graphed} | run.facts()))
        return 0
    head = f"{'':16s} {'launches':>8s} {'kernel':>6s} {'ufunc':>6s} {'reduce':>6s} " \
           f"{'gemm':>5s} {'copy':>5s} {'allocs':>6s} {'host waits':>10s} {'transfers':>9s}"
    print(f"per training step (single mode), batch {args.batch_size}, {args.dtype}, "
          f"on the recording stand-in for CuPy")
    print(head)

    def row(label, t):
        print(f"{label:16s} {t['launches']:8d} {t['kernel']:6d} {t['ufunc']:6d} "
              f"{t['reduction']:6d} {t['gemm']:5d} {t['copy']:5d} {t['allocations']:6d} "
              f"{t['host_waits']:10d} {t['transfers']:9d}")
    for result in results:
        row(result["model"], result)
        if args.phases:
            for where, totals in result["phases"].items():
                row("  " + where, totals)
    print("with --cuda-graphs, once captured: one graph launch, and besides it")
    for result in graphed:
        row(result["model"], result["outside"])
        print(f"{'':16s} (the graph holds {result['captured']} launches)")
    run.end()
    return 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
