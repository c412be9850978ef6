"""Stated GPU profiles (``--compute k40`` / ``h100``): per layer max(FLOPs / peak, bytes / bandwidth)."""
import numpy as np

from ringnet.perfmodel.compute import ComputeProfile
from ringnet.models import build_model

__all__ = ["GPUS", "GEMM_EFFICIENCY", "MEMORY_EFFICIENCY", "KERNEL_S", "roofline_compute"]


# GPU rooflines for --compute k40/h100: stated spec numbers, stated efficiencies.
GPUS = {
    "k40": dict(flops=4.29e12, bw=288e9,
                source="Tesla K40: 4.29 TFLOPS FP32 peak (with GPU Boost), 288 GB/s GDDR5 "
                       "(NVIDIA Tesla K40 board specification)"),
    "h100": dict(flops=67e12, bw=3.35e12,
                 source="H100 SXM: 67 TFLOPS FP32, 3.35 TB/s HBM3 (NVIDIA H100 datasheet)"),
}
GEMM_EFFICIENCY = 0.5     # of peak FLOPS reached by conv-as-GEMM and linear layers (stated)
MEMORY_EFFICIENCY = 0.7   # of peak bandwidth reached by element-wise and pooling kernels (stated)
KERNEL_S = 10e-6          # launch + CuPy dispatch per kernel (stated)


def _layer_work(layer, in_shape, out_shape):
    """Return (forward FLOPs, forward bytes, kernels) per sample of one layer; backward ~2x."""
    from ringnet.layers import Conv2d, Linear
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    moved = 4 * (n_in + n_out)
    if isinstance(layer, Conv2d):
        kh, kw = layer.kernel_size
        flops = 2 * layer.in_channels * kh * kw * n_out
        return flops, moved + 4 * layer.in_channels * kh * kw * int(np.prod(out_shape[1:])), 3
    if isinstance(layer, Linear):
        return 2 * layer.in_features * layer.out_features, moved, 2
    return 0, moved, 1


def roofline_compute(gpu, models, dtype="float32"):
    """Return a stated GPU profile: per layer max(FLOPs/peak, bytes/bandwidth) + kernel launches."""
    spec = GPUS[gpu]
    flops_s = spec["flops"] * GEMM_EFFICIENCY
    bw = spec["bw"] * MEMORY_EFFICIENCY
    layers, overhead = {}, {}
    for name in models:
        model = build_model(name, dtype=dtype)
        rows = []
        for (lname, layer), (_, in_shape, out_shape) in zip(model.layers, model.shapes):
            flops, moved, kernels = _layer_work(layer, in_shape, out_shape)
            per_sample = max(flops / flops_s, moved / bw)
            rows.append((lname, (kernels * KERNEL_S, per_sample),
                         (2 * kernels * KERNEL_S, 2 * per_sample)))
        layers[name] = rows
        overhead[name] = (4 * KERNEL_S, 0.0)          # loss forward/backward kernels
    itemsize = np.dtype(dtype).itemsize
    return ComputeProfile(
        gpu, "gpu", layers, overhead, 5 * itemsize / bw, KERNEL_S, 3 * itemsize / bw, KERNEL_S,
        f"roofline: {spec['source']}; {GEMM_EFFICIENCY:.0%} of peak FLOPS, "
        f"{MEMORY_EFFICIENCY:.0%} of peak bandwidth, {KERNEL_S * 1e6:.0f} us per kernel (stated)")
