"""python -m ringnet.bench layers: per-layer and full-step times, optionally against PyTorch CPU."""
import json
import os
import sys
import time

from ringnet.blas import pin_one_thread

_PINNED = pin_one_thread()      # the comparison is core for core

import numpy as np  # noqa: E402

from ringnet.bench import machine, options, paired_quartiles  # noqa: E402
from ringnet.errors import UsageError  # noqa: E402
from ringnet.cli import ArgumentParser
from ringnet.layers import (AvgPool2d, Conv2d, Dropout, Flatten, Linear, MaxPool2d,  # noqa: E402
                            ReLU)
from ringnet.models import build_model  # noqa: E402
from ringnet.optim import SGD, LRPolicy  # noqa: E402
from ringnet.perfmodel.profiling import layer_times  # noqa: E402

__all__ = ["main", "torch_model", "step_times", "step_flops", "layer_floors",
           "sgemm_rate", "memory_rate"]

DEFAULT_MODELS = ("lenet", "cifar10_quick")


def _median_ms(samples):
    return float(np.median(samples)) * 1e3


def _batch(model, batch_size, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size,) + model.input_shape).astype(model.dtype)
    y = rng.integers(0, model.num_classes, size=batch_size)
    return x, y


def _gemm_flops(layer, shape, batch_size):
    """Return one pass's GEMM FLOPs of a Conv2d or Linear layer (2 * outputs * fan-in),
    None for any other layer."""
    if isinstance(layer, Conv2d):
        kh, kw = layer.kernel_size
        o, ho, wo = shape.out_shape
        return 2 * batch_size * o * ho * wo * layer.in_channels * kh * kw
    if isinstance(layer, Linear):
        return 2 * batch_size * layer.in_features * layer.out_features
    return None


def layer_floors(model, batch_size, gemm_rate, bytes_rate):
    """Return [(name, forward floor ms, backward floor ms, unit)] for each layer: what its
    pass would take at the machine's own rates, so each layer's time reads against it.

    Conv2d and Linear (unit "GEMM"): the pass's GEMM FLOPs at ``gemm_rate`` (FLOP/s),
    forward one GEMM, backward two (the weight and input gradients; one for the first
    layer). A convolution through Fourier transforms can run below it, as it does fewer
    multiply-adds than the direct method. Every other layer (unit "memory") is bound by
    memory traffic: its input read and output written once per pass (backward: the output
    gradient read, the input gradient written) at ``bytes_rate`` (bytes/s, a large copy's
    rate); a Flatten is a view, floor 0.
    """
    out = []
    itemsize = np.dtype(model.dtype).itemsize
    for (name, layer), shape in zip(model.layers, model.shapes):
        flops = _gemm_flops(layer, shape, batch_size)
        if flops is not None:
            passes = 2 if layer.needs_dx else 1
            out.append((name, flops / gemm_rate * 1e3, passes * flops / gemm_rate * 1e3, "GEMM"))
            continue
        moved = 0 if isinstance(layer, Flatten) else \
            batch_size * (np.prod(shape.in_shape) + np.prod(shape.out_shape)) * itemsize
        out.append((name, moved / bytes_rate * 1e3, moved / bytes_rate * 1e3, "memory"))
    return out


def step_flops(model, batch_size):
    """Return the GEMM FLOPs of one training step (forward, weight and input gradients).

    Conv and Linear layers only, at their minimal count: 2 * outputs * fan-in per pass, the
    input gradient skipped for the first layer (it has none). Pools, ReLU, the loss and
    SGD are memory-bound and left out, so FLOPs / SGEMM rate is a lower bound.
    """
    total = 0
    for (name, layer), shape in zip(model.layers, model.shapes):
        one = _gemm_flops(layer, shape, batch_size)
        if one is not None:
            total += one * (3 if layer.needs_dx else 2)
    return total


def sgemm_rate(n=1024, repeats=5):
    """Return this core's float32 GEMM rate in FLOP/s: an n x n x n matmul, median CPU time."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=c)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        np.matmul(a, b, out=c)
        times.append(time.process_time() - t0)
    return 2.0 * n ** 3 / max(float(np.median(times)), 1e-9)


def memory_rate(mib=64, repeats=5):
    """Return bytes/s of one core copying a ``mib`` MiB float32 array (read + written),
    median of ``repeats``: the memory-bound layers' floor rate."""
    a = np.ones(mib << 18, dtype=np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        np.copyto(b, a)
        times.append(time.process_time() - t0)
    return 2.0 * a.nbytes / max(float(np.median(times)), 1e-9)


def torch_model(model):
    """Return a torch.nn.Sequential equal to ``model`` with its current weights (float32/64)."""
    _require_torch()
    import torch
    from torch import nn
    from collections import OrderedDict
    modules = []
    for name, layer in model.layers:
        if isinstance(layer, Conv2d):
            mod = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size,
                            layer.stride, layer.padding)
        elif isinstance(layer, MaxPool2d):
            mod = nn.MaxPool2d(layer.kernel_size, layer.stride, layer.padding, ceil_mode=True)
        elif isinstance(layer, AvgPool2d):
            mod = nn.AvgPool2d(layer.kernel_size, layer.stride, layer.padding, ceil_mode=True)
        elif isinstance(layer, Linear):
            mod = nn.Linear(layer.in_features, layer.out_features)
        elif isinstance(layer, ReLU):
            mod = nn.ReLU()
        elif isinstance(layer, Flatten):
            mod = nn.Flatten()
        elif isinstance(layer, Dropout):
            mod = nn.Dropout(layer.p)
        else:
            raise UsageError(f"no PyTorch equivalent for layer {name} ({layer!r})")
        modules.append((name, mod))
    net = nn.Sequential(OrderedDict(modules)).to(torch.float64 if model.dtype == np.float64
                                                 else torch.float32)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in model.state().items()})
    return net


def step_times(model, x, y, iters, vs_torch):
    """Time full training steps, interleaved with PyTorch's when asked; return a result dict."""
    lr = 0.001  # small, so many steps stay finite on random data
    sgd = SGD(model.num_params, LRPolicy("fixed", lr), momentum=0.9, xp=np, dtype=model.dtype)
    result = {"model": model.name, "batch_size": int(x.shape[0])}
    net = None
    if vs_torch:
        import torch
        torch.set_num_threads(1)
        net = torch_model(model)
        net.eval()  # dropout off for the agreement check only
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        with torch.no_grad():
            torch_loss = float(torch.nn.functional.cross_entropy(net(xt), yt))
        ours, _ = model.evaluate(x, y, batch_size=len(x))
        result["loss"], result["torch_loss"] = ours, torch_loss
        if not abs(ours - torch_loss) <= 1e-4 * max(1.0, abs(torch_loss)):
            raise RuntimeError(f"{model.name}: loss {ours} differs from PyTorch's {torch_loss} "
                               "on the same weights and batch")
        net.train()
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)

        def torch_step():
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(net(xt), yt)
            loss.backward()
            opt.step()

    def our_step(it):
        model.loss_and_grad(x, y)
        sgd.step(model.params, model.grads, it)

    # Wall time and this process's CPU time, step by step: on a shared machine the CPU
    # time leaves out the time the process waited for a core.
    ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
    for it in range(iters + 2):                    # two warm-up rounds, not recorded
        t0, c0 = time.perf_counter(), time.process_time()
        our_step(it)
        t1, c1 = time.perf_counter(), time.process_time()
        if net is not None:
            torch_step()
        t2, c2 = time.perf_counter(), time.process_time()
        if it >= 2:
            ours.append(t1 - t0)
            theirs.append(t2 - t1)
            ours_cpu.append(c1 - c0)
            theirs_cpu.append(c2 - c1)
    result["step_ms"] = _median_ms(ours)
    result["cpu_step_ms"] = _median_ms(ours_cpu)
    if net is not None:
        result["torch_step_ms"] = _median_ms(theirs)
        result["ratio_vs_torch"] = result["step_ms"] / result["torch_step_ms"]
        result["ratio_quartiles"] = paired_quartiles(ours, theirs)
        result["torch_cpu_step_ms"] = _median_ms(theirs_cpu)
        result["cpu_ratio_vs_torch"] = result["cpu_step_ms"] / result["torch_cpu_step_ms"]
    return result


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench layers",
                       description="Per-layer forward/backward times and full training "
                                   "steps (forward, loss, backward, SGD) on one BLAS thread.")
    options.add_models(p, "time", shown=" and ".join(DEFAULT_MODELS))
    options.add_batch_size(p, 64, "samples per step")
    p.add_argument("--iters", type=int, default=20, help="timed repetitions (default 20)")
    options.add_dtype(p)
    p.add_argument("--vs", choices=["torch"], help="also time the same net in PyTorch CPU, "
                                                   "interleaved step by step, and report the ratio")
    options.add_seed(p, 0, "seeds the weights and the batch")
    options.add_json(p, "print one JSON line instead of tables")
    options.add_markdown(p, "also print the step times")
    return p


def parse_args(argv):
    """Parse the benchmark's flags."""
    args = build_parser().parse_args(argv)
    if args.batch_size < 1 or args.iters < 1:
        raise UsageError("--batch-size and --iters must be >= 1")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.vs == "torch":
        _require_torch()
    return args


TORCH_HINT = ("--vs torch needs PyTorch, which is not installed: pip install -e \".[bench]\" "
              "(torch==2.13.0; the CPU build is enough)")


def _require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UsageError(TORCH_HINT) from None


def main(argv=None):
    """Run the benchmark; print tables or one JSON line."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run = machine.begin(out=sys.stderr if args.json else None)
    if not _PINNED and not args.json:
        print("note: NumPy was loaded before the benchmark, BLAS threads not pinned to 1")
    results = []
    rate, copy_rate = sgemm_rate(), memory_rate()
    load = os.getloadavg()
    if not args.json:
        print(f"single-core SGEMM (1024^3 float32): {rate / 1e9:.1f} GFLOP/s; "
              f"single-core copy (64 MiB): {copy_rate / 1e9:.1f} GB/s")
    for name in args.model or DEFAULT_MODELS:
        model = build_model(name, dtype=args.dtype, seed=args.seed)
        x, y = _batch(model, args.batch_size, args.seed)
        per_layer = layer_times(model, x, max(3, args.iters // 2), clock=time.process_time)
        result = step_times(model, x, y, args.iters, args.vs == "torch")
        floors = layer_floors(model, args.batch_size, rate, copy_rate)
        result["layers"] = [{"layer": n, "forward_ms": f, "backward_ms": b,
                             "forward_floor_ms": ff, "backward_floor_ms": bf, "floor": unit}
                            for (n, f, b), (_, ff, bf, unit) in zip(per_layer, floors)]
        flops = step_flops(model, args.batch_size)
        result["gflops_per_step"] = flops / 1e9
        result["floor_ms"] = flops / rate * 1e3
        result["cpu_step_vs_floor"] = result["cpu_step_ms"] / result["floor_ms"]
        results.append(result)
        if not args.json:
            print(f"{name}: batch {args.batch_size}, {args.dtype}, 1 BLAS thread, "
                  f"{model.num_params} parameters")
            print(f"  {'layer':10s} {'forward ms':>11s} {'floor':>7s} {'x':>6s} "
                  f"{'backward ms':>12s} {'floor':>7s} {'x':>6s}   (CPU time; floor: GEMM "
                  "FLOPs at the SGEMM rate, or bytes at the copy rate)")
            fused = {i: model.layers[j][0] for i, j in model._fused.items()
                     if isinstance(model.layers[i][1], ReLU)}
            for i, ((n, f, b), (_, ff, bf, unit)) in enumerate(zip(per_layer, floors)):
                ratio = lambda t, floor: f"{t / floor:6.2f}" if floor > 0 else f"{'-':>6s}"
                print(f"  {n:10s} {f:11.3f} {ff:7.3f} {ratio(f, ff)} {b:12.3f} {bf:7.3f} "
                      f"{ratio(b, bf)}   {unit}"
                      + (f" (applied by {fused[i]})" if i in fused else ""))
            line = f"  step (fwd+loss+bwd+SGD): {result['step_ms']:.2f} ms"
            if "torch_step_ms" in result:
                line += (f"   PyTorch: {result['torch_step_ms']:.2f} ms   "
                         f"ratio {result['ratio_vs_torch']:.2f} (steps paired: "
                         f"{result['ratio_quartiles'][0]:.2f}-{result['ratio_quartiles'][1]:.2f}, "
                         f"quartiles)   "
                         f"(loss {result['loss']:.6f} vs {result['torch_loss']:.6f})")
            print(line)
            line = f"  CPU time per step: {result['cpu_step_ms']:.2f} ms"
            if "torch_cpu_step_ms" in result:
                line += (f"   torch {result['torch_cpu_step_ms']:.2f} ms   "
                         f"CPU-time ratio {result['cpu_ratio_vs_torch']:.2f}")
            print(line)
            line = (f"  floor: {flops / 1e9:.2f} GFLOP of GEMMs per step at the SGEMM rate = "
                    f"{result['floor_ms']:.2f} ms; this step's CPU time is "
                    f"{result['cpu_step_vs_floor']:.2f}x the floor")
            if "torch_cpu_step_ms" in result:
                line += f", torch's {result['torch_cpu_step_ms'] / result['floor_ms']:.2f}x"
            print(line, flush=True)
    if args.json:
        keys = ("model", "step_ms", "torch_step_ms", "ratio_vs_torch", "ratio_quartiles", "cpu_step_ms",
                "torch_cpu_step_ms", "cpu_ratio_vs_torch", "gflops_per_step", "floor_ms",
                "cpu_step_vs_floor")
        run.end(out=sys.stderr)
        print(json.dumps({"load_average": list(load), "sgemm_gflops": rate / 1e9,
                          "copy_gbytes_per_s": copy_rate / 1e9,
                          "models": [{k: r[k] for k in keys if k in r} | {"layers": r["layers"]}
                                     for r in results]} | run.facts()))
        return 0
    if args.markdown:
        from ringnet.bench.tables import layers_table
        print(layers_table(results))
    run.end()
    return 0
