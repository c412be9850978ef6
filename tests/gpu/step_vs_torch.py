"""Each model's training step on the GPU beside PyTorch's CUDA step for the same net and batch.

Usage: python tests/gpu/step_vs_torch.py [--iters N] [--layers] [--out FILE]
       (needs a GPU; torch optional)

Three steps are timed interleaved (forward, backward, SGD with momentum), each ended by a
device synchronisation: ours eager (``--cuda-graphs off``), ours replayed as a CUDA graph
(``--cuda-graphs on``: :class:`ringnet.graphs.GraphStep`, whose capture is checked bit for
bit against the eager step, or the run fails) and PyTorch's eager CUDA step; medians in ms
and the ratios to PyTorch's. None of the three reads its loss on the host inside the step:
each leaves it on the device and the synchronisation ends the step. Before timing, both nets give the
same loss on the same weights and batch (float32, relative 1e-4), or the run fails. TF32 is
off in PyTorch for the whole script (its convolutions use TF32 by default on Ampere and
later, about 1e-3 relative), so both compute in float32; each result says so (``torch_tf32``).

``--layers`` adds, per layer, the host time its forward and backward calls take (Python
and kernel launches) beside the device time between CUDA events around them: where the
host time is the larger, the layer is launch-bound and fewer, larger kernels would help.
"""
import argparse
import json
import sys
import time

import numpy as np

from ringnet import graphs
from ringnet.backend import check_gpu, cupy, gpu_available
from ringnet.bench.layers import torch_model
from ringnet.layers import gemm
from ringnet.models import MODELS, build_model
from ringnet.optim import SGD, LRPolicy


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None, "torch not installed"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA"
    torch.backends.cuda.matmul.allow_tf32 = False        # float32 as ours, not TF32
    torch.backends.cudnn.allow_tf32 = False
    return torch, None


def time_model(name, iters, batch_size=64, lr=0.001):
    host = build_model(name, dtype="float32", seed=0)
    model = build_model(name, dtype="float32", seed=0, xp=cupy)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size,) + host.input_shape).astype(np.float32)
    y = rng.integers(0, host.num_classes, size=batch_size)
    xg, yg = cupy.asarray(x), cupy.asarray(y)
    sgd = SGD(model.num_params, LRPolicy("fixed", lr), momentum=0.9, xp=cupy, dtype="float32")
    result = {"model": name, "batch_size": batch_size}
    torch, why = _torch_cuda()
    step_torch = None
    if torch is not None:
        net = torch_model(host).cuda()
        xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
        net.eval()
        with torch.no_grad():
            theirs = float(torch.nn.functional.cross_entropy(net(xt), yt))
        ours, _ = model.evaluate(xg, yg, batch_size=batch_size)
        result["loss"], result["torch_loss"] = float(ours), theirs
        result["torch_tf32"] = "off" if not (torch.backends.cuda.matmul.allow_tf32 or
                                             torch.backends.cudnn.allow_tf32) else "on"
        if not abs(float(ours) - theirs) <= 1e-4 * max(1.0, abs(theirs)):
            raise RuntimeError(f"{name}: loss {ours} differs from PyTorch's {theirs}")
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)

        def step_torch():
            opt.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(net(xt), yt).backward()
            opt.step()
            torch.cuda.synchronize()
    else:
        result["torch"] = why

    def step_ours(it):
        assert not gemm.enabled()                        # CuPy's matmul, as graphs off
        model.loss_and_grad(xg, yg)
        sgd.step(model.params, model.grads, it)
        cupy.cuda.get_current_stream().synchronize()

    gmodel = build_model(name, dtype="float32", seed=0, xp=cupy)
    gsgd = SGD(gmodel.num_params, LRPolicy("fixed", lr), momentum=0.9, xp=cupy, dtype="float32")
    graph = graphs.GraphStep(gmodel, gsgd, graphs.CudaGraphs(cupy), strict=True)

    def step_graph(it):
        graph.step(xg, yg, it)                           # the cuBLAS route inside it
        cupy.cuda.get_current_stream().synchronize()

    ours, replayed, theirs = [], [], []
    warm = graphs.WARMUP + 3             # kernel compilation and the capture, not kept
    for it in range(iters + warm):
        t0 = time.perf_counter()
        step_ours(it)
        t1 = time.perf_counter()
        step_graph(it)
        t2 = time.perf_counter()
        if step_torch is not None:
            step_torch()
        t3 = time.perf_counter()
        if it >= warm:
            ours.append(t1 - t0)
            replayed.append(t2 - t1)
            theirs.append(t3 - t2)
    graph.close()
    result["step_ms"] = 1e3 * float(np.median(ours))
    result["graph_step_ms"] = 1e3 * float(np.median(replayed))
    result["graph_replays"] = graph.replays
    if step_torch is not None:
        result["torch_step_ms"] = 1e3 * float(np.median(theirs))
        result["ratio_vs_torch"] = result["step_ms"] / result["torch_step_ms"]
        result["graph_ratio_vs_torch"] = result["graph_step_ms"] / result["torch_step_ms"]
    return result


def layer_profile(name, iters, batch_size=64):
    """Per layer: median host ms of the forward/backward call and device ms between events."""
    model = build_model(name, dtype="float32", seed=0, xp=cupy)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.normal(size=(batch_size,) + model.input_shape).astype(np.float32))
    y = cupy.asarray(rng.integers(0, model.num_classes, size=batch_size))
    rows = {lname: {"fwd_host": [], "fwd_gpu": [], "bwd_host": [], "bwd_gpu": []}
            for lname, _ in model.layers}

    def timed(fn, arg, host, gpu):
        begin, end = cupy.cuda.Event(), cupy.cuda.Event()
        begin.record()
        t0 = time.perf_counter()
        out = fn(arg)
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(begin, end) / 1e3)
        return out

    for it in range(iters + 3):
        keep = it >= 3
        h = model.as_input(x)
        for lname, layer in model.layers:
            r = rows[lname] if keep else {k: [] for k in rows[lname]}
            h = timed(lambda a, layer=layer: layer.forward(a, True), h, r["fwd_host"], r["fwd_gpu"])
        model.loss_layer.forward(h, y)
        d = model.loss_layer.backward()
        for lname, layer in reversed(model.layers):
            r = rows[lname] if keep else {k: [] for k in rows[lname]}
            d = timed(layer.backward, d, r["bwd_host"], r["bwd_gpu"])
    return [{"layer": lname, **{k: 1e3 * float(np.median(v)) for k, v in r.items()}}
            for lname, r in rows.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the JSON list here")
    parser.add_argument("--layers", action="store_true",
                        help="also time each layer's forward and backward (host vs device ms)")
    args = parser.parse_args(argv)
    if not gpu_available():
        print("step_vs_torch: no usable CUDA GPU", file=sys.stderr)
        return 3
    check_gpu()
    results = [time_model(name, args.iters) for name in MODELS]
    for r in results:
        ratio = f"{r['ratio_vs_torch']:.2f}" if "ratio_vs_torch" in r else r.get("torch", "")
        gratio = f"{r['graph_ratio_vs_torch']:.2f}" if "graph_ratio_vs_torch" in r else ""
        print(f"{r['model']:>14}  ringnet {r['step_ms']:8.2f} ms  graphs on "
              f"{r['graph_step_ms']:8.2f} ms  torch {r.get('torch_step_ms', float('nan')):8.2f} ms"
              f"  ratio {ratio}  graphs on {gratio} (target <= 0.5)"
              + (f"  torch TF32 {r['torch_tf32']}" if "torch_tf32" in r else ""))
    if args.layers:
        for r in results:
            r["layers"] = layer_profile(r["model"], args.iters)
            print(f"{r['model']}: per layer, ms  (host = Python + launches, gpu = device time)")
            print(f"  {'layer':<10} {'fwd host':>9} {'fwd gpu':>9} {'bwd host':>9} {'bwd gpu':>9}")
            for row in r["layers"]:
                print(f"  {row['layer']:<10} {row['fwd_host']:9.3f} {row['fwd_gpu']:9.3f} "
                      f"{row['bwd_host']:9.3f} {row['bwd_gpu']:9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
