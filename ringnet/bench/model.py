"""python -m ringnet.bench model: predicted step time, speedup and efficiency of every mode, N = 1..1024.

The prediction is built from three measured or stated inputs and the exchange each
mode runs in the code:

* **compute** — per-layer forward/backward time as ``fixed + per_sample * batch``,
  the SGD update time per parameter and the element-wise add of a reduction, measured
  here inside real single-mode training steps (``--compute here``: ``ringnet.train``'s
  own set-up and step, each layer timed between the model's ``layer_hook`` calls, so
  the profile is what a training step does on this CPU, its caches included), read from a JSON file
  (``--compute FILE``, written by ``--save-compute``), or a stated GPU roofline
  (``--compute k40`` / ``h100``);
* **traffic** — the bytes and messages of every collective a step runs, from the
  code's own sizes: ``model.num_params``, ``shard_bounds`` (the ring's shards), the
  split-fc FC blocks (``fc_blocks``) and its conversion-layer buffers;
* **links** — one latency α and bandwidth β per hop, intra-node and inter-node, from
  spec-sheet profiles (``LINKS``) or calibrated on this machine by timing the ring
  communicator under mpirun (profile ``local``).

How each mode is timed (as ``ringnet/comm`` and ``ringnet/parallel`` run it):

=========  ==================================================================
ring       reduce-scatter: N-1 lockstep steps of one shard (P/N) plus its add;
           update of one shard; all-gather: N-1 steps of one shard.
tree       binary heap (children 2v+1, 2v+2): a rank receives both children
           at once (sharing its link) and adds, piece by piece
           (``pipeline_pieces``); the root updates all P; the broadcast relays
           each piece to both children at once.
master     the root receives all N-1 gradients at once per piece (sharing its
           link) and adds them in rank order, updates all P, and sends N-1
           copies at once from its one link.
split-fc   conv part on B/N samples; conversion layer all-gathers (B, F+1)
           features+labels; each FC layer computes out/N rows on B samples and
           all-gathers them; backward reduce-scatters the input gradients;
           conv gradients go round the ring as above (conv parameters only).
auto       (all-reduce table only) the algorithm ``ringnet.comm.auto`` picks,
           by its rounds and bytes.
=========  ==================================================================

Delay 1 runs the exchange on the communication stream beside the next step's compute;
delay 0 runs it in the code's buckets (``backward_buckets``), each starting when the
backward of its first layer ends. The step is laid out layer by layer (``Timeline``)
and the stream's transfers, adds and update are walked beside it (``_simulate``): on a
GPU transfers overlap and the adds/update share the device; on the CPU with driven
progress a transfer is noticed at the next layer boundary (the training thread tests
it there), and with a polling thread the exchange moves at a measured fraction ρ of its
blocking speed and steals a measured fraction κ of the core. Where the code has a choice
(progress mode, bucket size, concurrent rooted receives) the model reads it from the
code (``code_facts``). Ranks beyond the cores share them: compute takes
``s(N) = max(1, N / cores)`` times as long (``cores``: measured with each model's own step
at its per-rank batch on every rank at once against one alone, waits that sleep; on a quiet
machine the cores the ranks share, :func:`usable_cores`, and never more), and a rank that
blocks on a peer finds it descheduled: a wait of ``scheduling_wait`` once per step and on
each blocking message, from slices the calibration measures (zero while every rank has a
core). While every rank has a core, a delay-0 step also waits for its slowest rank: its
compute is lengthened by the calibration's ``imbalance``, the mean over steps of the
slowest rank's step against the ranks' mean (delay 1 has a step of slack for it). On the CPU
a message is a wait (latency α) and a copy (bytes / β) that the rank's own core makes
inside an MPI call: with driven progress that call is the training thread's test at a
layer boundary, so the copy delays the compute (on a GPU the copy engine moves it).
"""
import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import time

from ringnet.bench.layers import layer_times  # first: pins BLAS threads before NumPy loads

import numpy as np  # noqa: E402

from ringnet.bench import run_json  # noqa: E402
from ringnet.errors import ArgumentParser, UsageError  # noqa: E402
from ringnet.models import MODELS, build_model  # noqa: E402

__all__ = ["Link", "LINKS", "GPUS", "System", "ComputeProfile", "measure_compute",
           "roofline_compute", "load_compute", "ring_phase_bytes", "traffic", "messages",
           "buckets", "code_facts", "facts", "allreduce_time", "predict", "sweep", "crossovers",
           "validation_rows", "diagnose", "main"]

DEFAULT_MODELS = ("lenet", "cifar10_quick")
DEFAULT_NP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _mode_rows():
    """(mode, delay) in the order tables print them: every mode of the registry at its
    default delay, and the ring also at delay 0 (what the delayed update buys)."""
    from ringnet.parallel import MODES as REGISTRY
    rows = []
    for mode in REGISTRY.values():
        rows.append((mode.name, mode.default_delay))
        if mode.name == "ring":
            rows.append(("ring", 1 - mode.default_delay))
    return tuple(rows)


MODES = _mode_rows()
DEFAULT_PROFILES = ("pcie3/eth-10g", "pcie5/ib-hdr", "nvlink4/ib-hdr")
# The research's setting: 4 GPUs, Caffe's per-GPU batches (LeNet 64, cifar10_quick 100).
PAPER = {"lenet": (64, 3.77), "cifar10_quick": (100, 3.79)}
PAPER_NP = 4


# -- links ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Link:
    """One hop: a message of ``n`` bytes takes ``alpha_s + n / beta_Bps`` seconds."""
    name: str
    alpha_s: float
    beta_Bps: float
    source: str = ""

    def time(self, nbytes):
        """Return the seconds one message of ``nbytes`` takes on this hop."""
        return self.alpha_s + nbytes / self.beta_Bps if nbytes else 0.0


# β: per direction, from the spec sheets named in ``source``. α is never on a spec sheet:
# it is the hardware latency named there plus SOFTWARE_ALPHA_S, the per-message cost of
# ringnet's Python-level isendrecv + wait (stated, not measured; ``local`` measures its own).
SOFTWARE_ALPHA_S = 15e-6
# name: (hardware latency s, beta B/s per direction, source of both)
_LINK_SPECS = {
    "pcie3": (5e-6, 15.75e9, "PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b = 15.75 GB/s per direction (PCI-SIG "
                             "PCIe Base Specification 3.0); GPU peer copy latency ~5 us"),
    "pcie5": (5e-6, 63.0e9, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63.0 GB/s per direction (PCI-SIG PCIe "
                            "Base Specification 5.0)"),
    "nvlink4": (3e-6, 450e9, "NVLink 4 on H100 SXM: 900 GB/s total per GPU = 450 GB/s per direction (NVIDIA H100 "
                             "Tensor Core GPU datasheet)"),
    "ib-hdr": (0.6e-6, 25e9, "InfiniBand HDR: 200 Gb/s per port = 25 GB/s per direction, sub-0.6 us latency "
                             "(NVIDIA ConnectX-6 VPI adapter product brief)"),
    "eth-10g": (25e-6, 1.25e9, "10 Gigabit Ethernet: 10 Gb/s = 1.25 GB/s per direction (IEEE 802.3ae); ~25 us "
                               "TCP small-message latency through the kernel stack"),
}
LINKS = {name: Link(name, latency + SOFTWARE_ALPHA_S, beta, source)
         for name, (latency, beta, source) in _LINK_SPECS.items()}


# -- compute ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ComputeProfile:
    """Per-layer times ``a + b * batch`` (seconds) per model, update and add costs.

    ``layers[model]`` is ``[(layer name, (fwd_a, fwd_b), (bwd_a, bwd_b))]``;
    ``overhead[model]`` is the rest of a training step (loss, Python) as ``(a, b)``.
    ``method``: for a profile measured here, :data:`TRAINING_STEPS` or
    :data:`ISOLATED_LAYERS` (empty for stated GPU profiles and files without it);
    ``steps_ms``: the median training step each batch's layers were timed in.
    """
    name: str
    device: str                      # "cpu" or "gpu"
    layers: dict
    overhead: dict
    update_s_per_param: float
    update_s_per_call: float
    add_s_per_elem: float
    add_s_per_call: float
    source: str = ""
    method: str = ""                 # how a profile measured here was taken
    steps_ms: dict = dataclasses.field(default_factory=dict)  # model -> {batch: step ms}

    def layer(self, model, name, batch, share=1.0):
        """Return (forward s, backward s) of one layer on ``batch`` samples (``share`` of its rows)."""
        for lname, (fa, fb), (ba, bb) in self.layers[model]:
            if lname == name:
                return (fa + fb * batch) * share, (ba + bb * batch) * share
        raise KeyError(f"compute profile {self.name} has no layer {name!r} of model {model}")

    def step_compute(self, model, batch, names=None, share=1.0):
        """Return forward+backward seconds of the named layers (default all) on ``batch``."""
        total = 0.0
        for lname, (fa, fb), (ba, bb) in self.layers[model]:
            if names is None or lname in names:
                total += (fa + fb * batch + ba + bb * batch) * share
        return total

    def overhead_s(self, model, batch):
        a, b = self.overhead[model]
        return max(0.0, a + b * batch)

    def update(self, n_params, calls=1):
        """Return seconds of SGD on ``n_params`` parameters in ``calls`` optimizer calls."""
        return n_params * self.update_s_per_param + calls * self.update_s_per_call if n_params else 0.0

    def add(self, n_elems):
        """Return seconds of one in-place add of ``n_elems`` elements."""
        return n_elems * self.add_s_per_elem + self.add_s_per_call if n_elems else 0.0

    def to_json(self):
        return {"name": self.name, "device": self.device, "source": self.source,
                "method": self.method,
                "steps_ms": {m: {str(b): v for b, v in d.items()} for m, d in self.steps_ms.items()},
                "update_ns_per_param": self.update_s_per_param * 1e9,
                "update_us_per_call": self.update_s_per_call * 1e6,
                "add_ns_per_element": self.add_s_per_elem * 1e9,
                "add_us_per_call": self.add_s_per_call * 1e6,
                "models": {m: {"overhead_ms": [a * 1e3, b * 1e3] for a, b in [self.overhead[m]]}
                           | {"layers": [{"layer": n, "forward_ms": [fa * 1e3, fb * 1e3],
                                          "backward_ms": [ba * 1e3, bb * 1e3]}
                                         for n, (fa, fb), (ba, bb) in self.layers[m]]}
                           for m in self.layers}}


TRAINING_STEPS = "training steps"      # layer times taken inside single-mode training steps
ISOLATED_LAYERS = "isolated layers"    # each layer timed on its own call (older profiles)


def profile_method(data):
    """How a compute profile (its ``to_json()`` dict) was measured: records written before
    profiles said so timed the layers alone."""
    if data.get("device") != "cpu":
        return data.get("method") or "stated"
    return data.get("method") or ISOLATED_LAYERS


_ZERO_COMPUTE = ComputeProfile("zero", "cpu", {}, {}, 0.0, 0.0, 0.0, 0.0, "no compute (link fits)")


def compute_from_json(data, source=""):
    """Return the ComputeProfile a ``to_json()`` dict describes (times: [fixed ms, ms per sample])."""
    layers, overhead = {}, {}
    for model, entry in data["models"].items():
        layers[model] = [(row["layer"], tuple(v / 1e3 for v in row["forward_ms"]),
                          tuple(v / 1e3 for v in row["backward_ms"]))
                         for row in entry["layers"]]
        overhead[model] = tuple(v / 1e3 for v in entry.get("overhead_ms", (0.0, 0.0)))
    return ComputeProfile(data.get("name", source), data.get("device", "gpu"),
                          layers, overhead, data["update_ns_per_param"] * 1e-9,
                          data.get("update_us_per_call", 0.0) * 1e-6,
                          data["add_ns_per_element"] * 1e-9,
                          data.get("add_us_per_call", 0.0) * 1e-6, data.get("source", source),
                          data.get("method", ""),
                          {m: {int(b): v for b, v in d.items()}
                           for m, d in data.get("steps_ms", {}).items()})


def load_compute(path):
    """Read a compute profile written by ``--save-compute``."""
    try:
        with open(path) as f:
            return compute_from_json(json.load(f), path)
    except OSError as exc:
        raise UsageError(f"cannot read compute profile {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"compute profile {path} is not a ringnet compute profile ({exc!r}); "
                         "write one with `python -m ringnet.bench model --save-compute FILE`") from None


def _fit(batches, times):
    """Least-squares (a, b) of t = a + b * batch, with a >= 0 and b >= 0."""
    slope, icept = np.polyfit(np.asarray(batches, float), np.asarray(times, float), 1)
    if slope < 0:
        return float(np.mean(times)), 0.0
    if icept < 0:
        return 0.0, float(np.dot(batches, times) / np.dot(batches, batches))
    return float(icept), float(slope)


def _median_time(fn, iters):
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _training_steps(name, batch, dtype, seed):
    """Set up one single-mode run of ``python -m ringnet.train`` (its own ``setup``: data
    set, loader with its prefetch thread, model, optimizer, strategy) in this process and
    return ``step()``: run the next training step, return its marks and spans."""
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import set_dropout_step, setup
    cfg = TrainConfig(model=name, mode="single", dataset="synthetic", batch_size=batch,
                      steps=1 << 30, dtype=dtype, device="cpu", seed=seed, quiet=True,
                      progress=False)
    cfg, _, _, model, strategy, loader = setup(cfg, MPI.COMM_SELF)
    marks = []
    layer_done, loss_backward = strategy._layer_done, model.loss_layer.backward

    def hook(phase, index):          # after each layer, before the strategy's own hook
        marks.append((phase, index, time.perf_counter()))
        layer_done(phase, index)

    def loss_done(*args, **kwargs):
        out = loss_backward(*args, **kwargs)
        marks.append(("loss", -1, time.perf_counter()))
        return out
    strategy._layer_done, model.loss_layer.backward = hook, loss_done

    def batches():
        epoch = 0
        while True:
            yield from loader.epoch(epoch)
            epoch += 1
    data, it = batches(), [0]

    def step():
        x, labels = next(data)
        marks.clear()
        set_dropout_step(model, it[0])
        strategy.step(x, labels, it[0])
        it[0] += 1
        return list(marks)
    return model, step


def _split_step(n_layers, marks, spans):
    """One step's hook marks and spans -> (forward s per layer, backward s per layer,
    rest s: loss and the step's glue, update s). The marks telescope: the layer times,
    the rest and the update add up to the step span."""
    fwd = {i: t for phase, i, t in marks if phase == "forward"}
    bwd = {i: t for phase, i, t in marks if phase == "backward"}
    loss = next(t for phase, _, t in marks if phase == "loss")
    (c0, cd), (_, ud), (_, sd) = spans["compute"], spans["update"], spans["step"]
    last = n_layers - 1
    forward = [fwd[0] - c0] + [fwd[i] - fwd[i - 1] for i in range(1, n_layers)]
    backward = [bwd[i] - (bwd[i + 1] if i < last else loss) for i in range(n_layers)]
    rest = (loss - fwd[last]) + (c0 + cd - bwd[0]) + (sd - cd - ud)
    return forward, backward, rest, ud


def _step_medians(rows):
    """[(forward list, backward list, rest, update, step)] of several steps -> the parts'
    medians (forward..., backward..., rest, update) scaled to add up to the median step,
    then the median step. On a loaded machine each step loses its core in a few of its
    parts; medians part by part would leave that out of the total."""
    cols = [float(np.median(col))
            for col in zip(*[f + bw + [rest, upd] for f, bw, rest, upd, _ in rows])]
    total = float(np.median([row[-1] for row in rows]))
    return [c * total / max(sum(cols), 1e-12) for c in cols] + [total]


def measure_compute(models, batches=(16, 32, 64), rounds=4, steps=6, dtype="float32", seed=0):
    """Time every layer inside real training steps here; fit the profile ``a + b * batch``.

    Each batch size runs its own single-mode training (``ringnet.train``'s set-up and
    ``strategy.step``: the same buffers, order, data loader and optimizer as a training
    run), in blocks of ``steps`` consecutive steps (the first of each block, which follows
    another model's block, is not kept), the batch sizes taking turns ``rounds`` times so
    that a change of the machine's load hits them alike. A layer's time is the interval
    between the model's ``layer_hook`` calls, so the layers, the rest of the step (loss,
    the strategy's glue) and the update add up to the step; their medians over the steps
    are scaled to add up to the median step. The update's cost per
    parameter comes from these steps' updates (every parameter, after the backward),
    its cost per call and the reduction's add from small and large calls timed alone.
    """
    from ringnet import stats
    from ringnet.optim import SGD, LRPolicy
    layers, overhead, updates, steps_ms = {}, {}, [], {}
    spans = {}

    def listen(event):
        if event.name in ("compute", "update", "step"):
            spans[event.name] = (event.start, event.duration)
    unsubscribe = stats.subscribe(listen)
    # the training loop's errstate: overflow on random data is not warned about
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for name in models:
                runs = {batch: _training_steps(name, batch, dtype, seed) for batch in batches}
                kept = {batch: [] for batch in batches}
                for _ in range(rounds):
                    for batch, (model, step) in runs.items():
                        for k in range(steps):
                            spans.clear()
                            marks = step()
                            if k:
                                kept[batch].append(_split_step(len(model.layers), marks,
                                                               dict(spans)) + (spans["step"][1],))
                model = runs[batches[0]][0]
                n = len(model.layers)
                med = {b: _step_medians(kept[b]) for b in batches}
                layers[name] = [(model.layers[i][0], _fit(batches, [med[b][i] for b in batches]),
                                 _fit(batches, [med[b][n + i] for b in batches]))
                                for i in range(n)]
                overhead[name] = _fit(batches, [med[b][2 * n] for b in batches])
                updates.append((model.num_params,
                                float(np.median([med[b][2 * n + 1] for b in batches]))))
                steps_ms[name] = {b: 1e3 * med[b][2 * n + 2] for b in batches}
    finally:
        unsubscribe()
    # update per call and the add: one large and one small call timed alone
    big, small = 1 << 20, 1 << 10
    costs = {}
    for n in (big, small):
        w, g = np.ones(n, np.dtype(dtype)), np.full(n, 1e-3, np.dtype(dtype))
        sgd = SGD(n, LRPolicy("fixed", 1e-3), momentum=0.9, weight_decay=5e-4, dtype=dtype)
        costs[("upd", n)] = _median_time(lambda: sgd.step(w, g, 0), 24)
        costs[("add", n)] = _median_time(lambda: np.add(w, g, out=w), 24)
    per_add = max((costs[("add", big)] - costs[("add", small)]) / (big - small), 0.0)
    per_call = max(costs[("upd", small)] - small * max(
        (costs[("upd", big)] - costs[("upd", small)]) / (big - small), 0.0), 0.0)
    # in the step the update finds its arrays out of cache: its per-parameter cost there
    per_param = max(0.0, float(np.median([(t - per_call) / p for p, t in updates])))
    return ComputeProfile(
        "here", "cpu", layers, overhead, per_param, per_call, per_add,
        max(costs[("add", small)] - small * per_add, 0.0),
        f"measured on this machine in training steps (single mode), {dtype}, 1 BLAS thread, "
        f"batches {list(batches)}", method=TRAINING_STEPS, steps_ms=steps_ms)


def isolated_compute(models, batches=(16, 64), iters=8, dtype="float32", seed=0):
    """Time every layer alone (``bench layers``' code) at two batch sizes; fit the profile.

    The older way, kept to compare against :func:`measure_compute` (``--compute
    here-isolated``): each layer is timed on its own call, outside a training step.

    The batch sizes alternate pass by pass, so a change of the machine's load hits both
    alike; the rest of a step (the loss) is timed directly, not as a difference. Each batch
    size has its own model instance: a layer keeps its work buffers (padded input, im2col
    columns, their views) while the shapes repeat, as they do in training, where the batch
    never changes; one instance fed both sizes in turn would rebuild them on every call.
    """
    from ringnet.optim import SGD, LRPolicy
    layers, overhead = {}, {}
    for name in models:
        rng = np.random.default_rng(seed)
        data = {}
        for batch in batches:
            model = build_model(name, dtype=dtype, seed=seed)
            x = rng.normal(size=(batch,) + model.input_shape).astype(model.dtype)
            y = rng.integers(0, model.num_classes, size=batch)
            model.loss_and_grad(x, y)                                   # warm-up
            data[batch] = (model, x, y)
        passes = {batch: [] for batch in batches}
        losses = {batch: [] for batch in batches}
        for _ in range(iters):
            for batch, (model, x, y) in data.items():
                passes[batch].append(layer_times(model, x, 1))
                logits = model.forward(x, train=True)
                t0 = time.perf_counter()
                model.loss_layer.forward(logits, y)
                model.loss_layer.backward()
                losses[batch].append(time.perf_counter() - t0)
        rows = []
        for i, (lname, _, _) in enumerate(passes[batches[0]][0]):
            fwd = _fit(batches, [np.median([p[i][1] for p in passes[b]]) / 1e3 for b in batches])
            bwd = _fit(batches, [np.median([p[i][2] for p in passes[b]]) / 1e3 for b in batches])
            rows.append((lname, fwd, bwd))
        layers[name] = rows
        overhead[name] = _fit(batches, [float(np.median(losses[b])) for b in batches])
    # update and add: one large and one small call give per element and per call
    big, small = 1 << 20, 1 << 10
    costs = {}
    for n in (big, small):
        w, g = np.ones(n, np.dtype(dtype)), np.full(n, 1e-3, np.dtype(dtype))
        sgd = SGD(n, LRPolicy("fixed", 1e-3), momentum=0.9, weight_decay=5e-4, dtype=dtype)
        costs[("upd", n)] = _median_time(lambda: sgd.step(w, g, 0), 3 * iters)
        costs[("add", n)] = _median_time(lambda: np.add(w, g, out=w), 3 * iters)
    per_upd = (costs[("upd", big)] - costs[("upd", small)]) / (big - small)
    per_add = (costs[("add", big)] - costs[("add", small)]) / (big - small)
    return ComputeProfile(
        "here", "cpu", layers, overhead, max(per_upd, 0.0),
        max(costs[("upd", small)] - small * per_upd, 0.0), max(per_add, 0.0),
        max(costs[("add", small)] - small * per_add, 0.0),
        f"measured on this machine, layers timed alone, {dtype}, 1 BLAS thread, batches "
        f"{list(batches)}, one model per batch", method=ISOLATED_LAYERS)


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


# -- the system ----------------------------------------------------------------------------
@dataclasses.dataclass
class System:
    """Where the ranks run: links per hop, ranks per node, and CPU contention.

    ``cores`` is None for GPUs (compute and transfers do not share a core). On a CPU
    machine (profile ``local``) it is the cores the job's ranks get: N / (the calibration's
    compute with all N ranks busy against one alone, timed with waits that sleep), so on a
    quiet machine the cores of its CPU affinity, and on a shared one what the load leaves
    (records of the older worker, whose waits spun, use the affinity). Ranks beyond them
    share them: each rank's compute takes N / cores times as long (a rank whose stream
    sleeps, as with driven progress, keeps one busy thread);
    ``steal`` is the fraction of its rank's core a polling delay-1 exchange takes while it
    runs, and ``rate`` the fraction of its blocking speed that exchange makes meanwhile
    (measured; ``calibrated`` holds them per calibrated N). ``imbalance`` (per model, only
    where every rank has a core): the slowest rank's step against the ranks' mean, step by
    step with all ranks busy; a delay-0 step ends with its slowest rank.
    """
    name: str
    intra: Link
    inter: Link
    ranks_per_node: int
    compute: ComputeProfile
    cores: float = None
    steal: float = 0.0
    rate: float = 1.0
    rooted: dict = None              # local: mode -> Link calibrated on that communicator
    calibrated: dict = None
    ranks_here: int = 1              # ranks of this job on one node (set per prediction)
    model_cores: dict = None         # local: model -> cores measured with its own step
    wait_s: float = 0.0              # a step's first wait for peers descheduled (N > cores)
    imbalance: dict = None           # local, a core per rank: model -> slowest rank's step / mean
    msg_wait_s: float = 0.0          # each blocking message's wait for them

    def hop(self, a, b):
        """Return the Link between ranks a and b (ranks fill nodes in order)."""
        same = a // self.ranks_per_node == b // self.ranks_per_node
        return self.intra if same else self.inter

    def at(self, n):
        """Return the system an N-rank job sees (local: the calibration nearest N)."""
        if not self.calibrated:
            return self
        near = min(self.calibrated, key=lambda k: (abs(math.log2(k) - math.log2(max(n, 1))), k))
        c = self.calibrated[near]
        link = Link(f"local@{near}", c["alpha_s"], c["beta_Bps"], "calibrated here")
        rooted = {mode: Link(f"local-{mode}@{near}", v["alpha_s"], v["beta_Bps"], "calibrated here")
                  for mode, v in c.get("rooted", {}).items()}
        # ranks beyond the cores: a blocking wait finds its peer descheduled (the slices the
        # calibration measured, scaled to this N by the closed form); each message likewise
        cores_here = c.get("raw", {}).get("cores") or usable_cores()
        wait = scheduling_wait(n, cores_here, c.get("slice_s", 0.0))
        per_msg = scheduling_wait(n, cores_here, c.get("msg_slice_s", 0.0))
        return dataclasses.replace(self, intra=link, inter=link, rate=c["rate"], rooted=rooted,
                                   cores=c.get("cores") or usable_cores(), steal=c["steal"],
                                   model_cores=c.get("model_cores") or None, wait_s=wait,
                                   imbalance=(c.get("imbalance") or None) if n <= cores_here
                                   else None,
                                   msg_wait_s=per_msg)

    def contention(self, n, model=None):
        """Return the compute slowdown of N ranks busy at once on this node: max(1, N / cores),
        ``cores`` measured with ``model``'s own step where the calibration timed it."""
        if self.cores is None:
            return 1.0
        cores = (self.model_cores or {}).get(model) or self.cores
        return max(1.0, min(n, self.ranks_per_node) / cores)


def scheduling_wait(n, cores, slice_s):
    """Mean wait of a rank that blocks on a peer when N busy ranks share ``cores`` cores.

    Round robin with time slices ``slice_s``: a peer runs a share cores/N of the time and
    is otherwise off for (N/cores - 1) slices; met at a random moment it is off with
    probability 1 - cores/N, for half an off period on average:
    (1 - cores/N) (N/cores - 1) slice / 2. Zero while every rank has a core (N <= cores;
    GPUs, cluster nodes with a core per rank).
    """
    if not cores or n <= cores or not slice_s:
        return 0.0
    return (1 - cores / n) * (n / cores - 1) * slice_s / 2


def usable_cores():
    """The cores the job's ranks on this node share: this process's CPU affinity, or the
    machine's cores where the launcher bound each rank to one of its own
    (:func:`ringnet.comm.auto.node_cores`)."""
    from ringnet.comm.auto import node_cores
    return node_cores()


def make_system(spec, compute, ranks_per_node, calibration=None):
    """Return the System for a profile string ``INTRA[/INTER]`` or ``local``."""
    if spec == "local":
        if calibration is None:
            raise UsageError("profile 'local' needs a calibration (--calibrate or --calibration FILE)")
        # from the raw timings when present, so a saved calibration follows this code
        records = {int(k): (_calibration_record(int(k), v["raw"], compute.add_s_per_elem)
                            if "raw" in v and compute is not None else v)
                   for k, v in calibration["by_np"].items()}
        system = System("local", None, None, 1 << 30, compute, calibrated=records)
        return system.at(min(records))
    names = spec.split("/")
    if len(names) > 2 or any(n not in LINKS for n in names):
        raise UsageError(f"unknown profile {spec!r}: use INTRA[/INTER] with names from "
                         f"{', '.join(LINKS)}, or local")
    return System(spec, LINKS[names[0]], LINKS[names[-1]], ranks_per_node, compute)


# -- traffic: the code's own sizes ---------------------------------------------------------
def _shard_bounds(length, size):
    from ringnet.comm.base import shard_bounds
    return shard_bounds(length, size)


def ring_phase_bytes(bounds, itemsize):
    """Return bytes each rank sends in one ring reduce-scatter and one all-gather over ``bounds``.

    Reduce-scatter step k: rank r sends shard (r-k-1) mod N, so over N-1 steps every
    shard but its own; all-gather step k sends shard (r-k) mod N: every shard but r+1's.
    """
    n = len(bounds)
    sizes = [b - a for a, b in bounds]
    total = sum(sizes)
    if n == 1:
        return [0], [0]
    rs = [(total - sizes[r]) * itemsize for r in range(n)]
    ag = [(total - sizes[(r + 1) % n]) * itemsize for r in range(n)]
    return rs, ag


def _tree_children(v, n):
    return [c for c in (2 * v + 1, 2 * v + 2) if c < n]


def split_fc_plan(model, n, batch):
    """Return split-fc's collectives for one step: [(name, kind, bounds)] in element counts.

    ``kind`` is "ag" (ring all-gather) or "rs" (ring reduce-scatter); sizes are those of
    the strategy's buffers: the conversion layer's (B, F+1) features+labels and (B, F)
    feature gradient in sample blocks, each FC block's (out, B) output in row blocks,
    each later block's (in, B) input gradient, and the conv prefix.
    """
    from ringnet.parallel.fc_slices import fc_blocks
    blocks = fc_blocks(model)
    first = blocks[0][0]
    conv = model.param_offsets()[f"{first}.weight"][0]
    local = batch // n
    features = blocks[0][1].in_features
    row = features + 1                        # features plus the label as one number
    plan = [("conversion: features+labels", "ag",
             [(r * local * row, (r + 1) * local * row) for r in range(n)])]
    out_bounds = []
    for name, layer, _ in blocks:
        ob = [(a * batch, b * batch) for a, b in _shard_bounds(layer.out_features, n)]
        out_bounds.append(ob)
        plan.append((f"{name} output", "ag", ob))
    for k in range(len(blocks) - 1, 0, -1):
        plan.append((f"{blocks[k][0]} input gradient", "rs", out_bounds[k - 1]))
    plan.append(("conversion: feature gradient", "rs",
                 [(r * local * features, (r + 1) * local * features) for r in range(n)]))
    plan.append(("conv gradients", "rs", _shard_bounds(conv, n)))
    plan.append(("conv weights", "ag", _shard_bounds(conv, n)))
    return plan, conv, blocks


def _overlapped_block(label, blocks):
    """Return the FC block whose dW/db a backward reduce-scatter of the plan runs beside."""
    if label == "conversion: feature gradient":
        return blocks[0][0]
    if label.endswith(" input gradient"):
        return label[:-len(" input gradient")]
    return None


def traffic(model, mode, n, batch):
    """Return the bytes each of N ranks sends in one step of ``mode`` (a list of N ints)."""
    itemsize = model.dtype.itemsize
    p = model.num_params
    if n == 1 or mode == "single":
        return [0] * n
    if mode == "ring":
        rs, ag = ring_phase_bytes(_shard_bounds(p, n), itemsize)
        return [a + b for a, b in zip(rs, ag)]
    if mode == "tree":
        # reduce: every non-root sends P once; broadcast: every rank sends P per child
        return [p * itemsize * ((v > 0) + len(_tree_children(v, n))) for v in range(n)]
    if mode == "master":
        return [(n - 1) * p * itemsize] + [p * itemsize] * (n - 1)
    if mode == "split-fc":
        plan, _, _ = split_fc_plan(model, n, batch)
        sent = [0] * n
        for _, kind, bounds in plan:
            rs, ag = ring_phase_bytes(bounds, itemsize)
            for r in range(n):
                sent[r] += (ag if kind == "ag" else rs)[r]
        return sent
    raise ValueError(f"unknown mode {mode!r}")


def _region_parts(model, mode, n, delay):
    """The replicated region's size and the parts its exchange runs in (the code's buckets)."""
    if mode == "split-fc":
        size, stop = model.param_offsets()[f"{_first_fc(model)}.weight"][0], model.fc_start()
    else:
        size, stop = model.num_params, len(model.layers)
    parts = [(lo, hi) for lo, hi, _ in buckets(model, stop)] if not delay and n > 1 else []
    return size, parts or [(0, size)]


def _first_fc(model):
    from ringnet.parallel.fc_slices import fc_blocks
    return fc_blocks(model)[0][0]


def messages(model, mode, n, batch, delay=0):
    """Return the messages (non-empty sends) each of N ranks posts in one step of ``mode``.

    From the code's sizes and structure: the ring's 2(N-1) steps per part (a step with an
    empty shard sends nothing), the rooted communicators' pieces (``pipeline_pieces``), the
    delay-0 buckets (``backward_buckets``), split-fc's activation collectives.
    """
    if n == 1 or mode == "single":
        return [0] * n
    itemsize = model.dtype.itemsize
    count = [0] * n

    def ring(bounds, phases=("rs", "ag")):
        for r in range(n):
            for k in range(n - 1):
                if "rs" in phases:
                    a, b = bounds[(r - k - 1) % n]
                    count[r] += b > a
                if "ag" in phases:
                    a, b = bounds[(r - k) % n]
                    count[r] += b > a

    size, parts = _region_parts(model, mode, n, delay)
    for lo, hi in parts:
        if mode in ("ring", "split-fc"):
            ring([(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo)
                  for a, b in _shard_bounds(size, n)])
            continue
        pieces = len(_pieces(hi - lo, itemsize, mode, n)) if _rooted_concurrent() else 1
        for v in range(n):
            if mode == "tree":
                count[v] += pieces * ((v > 0) + len(_tree_children(v, n)))
            else:
                count[v] += pieces * (n - 1 if v == 0 else 1)
    if mode == "split-fc":
        plan, _, _ = split_fc_plan(model, n, batch)
        for label, kind, bounds in plan:
            if not label.startswith("conv "):
                ring(bounds, (kind,))
    return count


# -- timing ----------------------------------------------------------------------------------
def _pieces(length, itemsize, mode, n):
    """Return the element ranges a rooted transfer of ``length`` elements is cut into, as
    the communicator of ``mode`` at ``n`` ranks cuts them (its own ``pieces`` rule; one
    piece where the code has none)."""
    try:
        from ringnet.comm.master_slave import MasterSlaveCommunicator
        from ringnet.comm.tree import TreeCommunicator
    except ImportError:
        return [(0, length)] if length else []
    comm = TreeCommunicator if mode == "tree" else MasterSlaveCommunicator
    return comm.pieces(length, itemsize, n)


# What the code does where it has a choice; a saved validation record replaces it with
# what the code it measured did (see ``code_facts``).
_FACTS = None


def code_facts():
    """The behaviour of the code the model follows: how CPU streams progress, the delay-0
    bucket size, whether rooted communicators receive concurrently in pieces."""
    if _FACTS is not None:
        return dict(_FACTS)
    from ringnet.comm.base import RootedCommunicator
    try:
        from ringnet.comm.stream import progress_mode
        progress = progress_mode()
    except ImportError:
        progress = "poll"               # a thread that polls its own transfers
    try:
        from ringnet.parallel.plans import bucket_bytes
        size = bucket_bytes()
    except ImportError:
        size = 0
    try:
        from ringnet.config import TrainConfig
        compensation = TrainConfig(model="lenet", mode="ring", delay=1).resolved(2).delay_compensation
    except Exception:                   # noqa: BLE001 - a config that cannot say: the plain one
        compensation = "none"
    return {"progress": progress, "bucket_bytes": size,
            "rooted_concurrent": hasattr(RootedCommunicator, "_gather_sum"),
            "delay_compensation": compensation}


@contextlib.contextmanager
def facts(values):
    """Predict as the code described by ``values`` (a ``code_facts()`` dict) ran."""
    global _FACTS
    saved, _FACTS = _FACTS, dict(values)
    try:
        yield
    finally:
        _FACTS = saved


# The code before any of these facts were recorded: threads that poll, no buckets, rooted
# communicators receiving one sender after the other.
OLD_FACTS = {"progress": "poll", "bucket_bytes": 0, "rooted_concurrent": False}


# Element-wise passes of the delay-1 step boundary (the delayed update's own count).
from ringnet.parallel.delayed_update import BOUNDARY_PASSES  # noqa: E402
# Element-wise passes of one CPU SGD step with momentum and weight decay (optim.SGD.step):
# the profile's update cost per parameter, over this, is one pass over cold arrays.
SGD_PASSES = 6


def boundary_s(compute, elems, compensation):
    """Seconds of the delay-1 step boundary's element-wise work on ``elems`` parameters: its
    passes (``BOUNDARY_PASSES``) at the cost of one pass of the in-step update."""
    return BOUNDARY_PASSES.get(compensation, 2) * elems * compute.update_s_per_param / SGD_PASSES


def _describe_facts(values):
    buckets_text = (f"delay-0 buckets of {values['bucket_bytes'] // 1024} KiB"
                    if values["bucket_bytes"] else "no delay-0 buckets")
    rooted = ("tree/master receive all senders at once, in pipeline pieces"
              if values["rooted_concurrent"] else "tree/master receive one sender at a time")
    return (f"CPU streams {values['progress']}, {buckets_text}, {rooted}, delay 1 with "
            f"{values.get('delay_compensation', 'lookahead')} compensation")


def _rooted_concurrent():
    """True when a rooted communicator receives from all its senders at once (piece by piece)."""
    return code_facts()["rooted_concurrent"]


def _ring_time(system, bounds, itemsize, kind):
    """Seconds of one ring reduce-scatter ("rs", with adds) or all-gather ("ag") over ``bounds``."""
    return sum(seconds for _, seconds in _ring_items(system, bounds, itemsize, kind))


def _ring_items(system, bounds, itemsize, kind):
    """The ring collective as the stream runs it: [("msg", s) and ("cpu", s) for the adds]."""
    n = len(bounds)
    if n == 1:
        return []
    # lockstep: every step waits for the largest shard on the slowest hop of the ring; a
    # step whose shards are all empty sends nothing (the transport skips zero-byte sides)
    shard = max(b - a for a, b in bounds)
    if shard == 0:
        return []
    hop = system.intra if n <= system.ranks_per_node else system.inter
    items = []
    for _ in range(n - 1):
        items += _message(hop, shard * itemsize, system.msg_wait_s)
        if kind == "rs":
            items.append(("cpu", system.compute.add(shard)))
    return items


def _message(link, nbytes, peer_s=0.0):
    """One message as the stream meets it: a wait for the peer ("msg", the latency), the
    copy of its bytes ("copy", bytes / beta), and where ranks outnumber the cores the wait
    for a descheduled peer ("peer"; beside compute the calibrated rate already holds it)."""
    if not nbytes:
        return []
    return [("msg", link.alpha_s), ("copy", nbytes / link.beta_Bps)] + ([("peer", peer_s)] if peer_s else [])


def _without_latency(system):
    """The same system with every hop's latency zero (what remains: bytes and adds)."""
    def flat(link):
        return dataclasses.replace(link, alpha_s=0.0)
    return dataclasses.replace(system, intra=flat(system.intra), inter=flat(system.inter))


def _tree_time(system, n, nbytes, elems):
    """Seconds of a tree reduce (to the root) plus broadcast (to the last leaf).

    Heap of the code (children 2v+1, 2v+2). With the pipelined communicator every rank
    receives both children's piece j at once (sharing its link), adds them and sends the
    sum up while piece j+1 arrives; the broadcast relays piece by piece, a rank sending
    each piece to both children at once. Without it (one piece, children one after the
    other) the same recursion runs with serial receives.
    """
    if n <= 1:
        return 0.0, 0.0
    itemsize = max(1, nbytes // max(elems, 1))
    concurrent = _rooted_concurrent()
    pieces = [b - a for a, b in _pieces(elems, itemsize, "tree", n)] if concurrent else [elems]
    ready = [[0.0] * len(pieces) for _ in range(n)]     # piece j's partial ready to go up
    for v in range(n - 1, -1, -1):                      # children before parents
        kids = _tree_children(v, n)
        link = add = 0.0
        for j, e in enumerate(pieces):
            if not kids:
                continue
            size = e * itemsize
            if concurrent:
                link = max(link, max(ready[c][j] for c in kids)) \
                    + max(system.hop(c, v).alpha_s for c in kids) \
                    + sum(size / system.hop(c, v).beta_Bps for c in kids)
                add = max(add, link) + len(kids) * system.compute.add(e)
            else:
                for c in kids:
                    link = max(link, ready[c][j], add) + system.hop(c, v).time(size)
                    add = link + system.compute.add(e)
            ready[v][j] = add
    reduce = ready[0][-1]
    have = [[0.0] * len(pieces) for _ in range(n)]       # piece j arrived at v
    for v in range(n):                                   # parents before children
        kids = _tree_children(v, n)
        out = 0.0
        for j, e in enumerate(pieces):
            if not kids:
                continue
            out = max(out, have[v][j]) + max(system.hop(v, c).alpha_s for c in kids) \
                + sum(e * itemsize / system.hop(v, c).beta_Bps for c in kids)
            for c in kids:
                have[c][j] = out
    return reduce, max(h[-1] for h in have)


def _master_time(system, n, nbytes, elems):
    """Seconds of the master's reduce (N-1 gradients into the root) and broadcast.

    Pipelined communicator: the root posts every worker's piece j at once (they share its
    link) and adds them in rank order while piece j+1 arrives; it sends each piece to all
    workers at once. Without it: one worker after the other.
    """
    if n <= 1:
        return 0.0, 0.0
    itemsize = max(1, nbytes // max(elems, 1))
    workers = range(1, n)
    alpha = max(system.hop(w, 0).alpha_s for w in workers)
    if not _rooted_concurrent():
        reduce = sum(system.hop(w, 0).time(nbytes) + system.compute.add(elems) for w in workers)
        return reduce, alpha + sum(nbytes / system.hop(0, w).beta_Bps for w in workers)
    link = add = out = 0.0
    for a, b in _pieces(elems, itemsize, "master", n):
        size = (b - a) * itemsize
        link += alpha + sum(size / system.hop(w, 0).beta_Bps for w in workers)
        add = max(add, link) + (n - 1) * system.compute.add(b - a)
        out += alpha + sum(size / system.hop(0, w).beta_Bps for w in workers)
    return add, out


def auto_algorithms():
    """The all-reduce algorithms of the code's ``auto`` communicator, or () where it has none."""
    try:
        from ringnet.comm.auto import ALGORITHMS
    except ImportError:
        return ()
    return tuple(ALGORITHMS)


def allreduce_time(system, algorithm, nbytes, n, itemsize=4):
    """Seconds of one all-reduce of ``nbytes`` over N ranks by ``algorithm`` (``auto``: the
    algorithm the code's ``AutoCommunicator`` picks for this size and N, with its own rule).

    The ring runs as the model's ring; auto's other algorithms by their rounds, the bytes
    the busiest rank sends and the bytes it adds (``ringnet.comm.auto.terms``, the table
    the code's choice is made from), each round one message time on this link.
    """
    if n <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "auto":
        from ringnet.comm.auto import choose
        algorithm = choose(nbytes, n)
    elems = max(1, nbytes // itemsize)
    if algorithm == "ring":
        bounds = _shard_bounds(elems, n)
        return _ring_time(system, bounds, itemsize, "rs") + _ring_time(system, bounds, itemsize, "ag")
    from ringnet.comm.auto import terms
    rounds, sent, added = terms(algorithm, nbytes, n)
    link = system.intra if n <= system.ranks_per_node else system.inter
    cp = system.compute
    return rounds * (link.alpha_s + cp.add_s_per_call) + sent / link.beta_Bps \
        + added / itemsize * cp.add_s_per_elem


def allreduce_rows(system, model, nps):
    """Rows {model, profile, np, bytes, picked, auto_ms, ring_ms} for the whole gradient."""
    if "ring" not in auto_algorithms():
        return []
    from ringnet.comm.auto import choose
    nbytes = model.num_params * model.dtype.itemsize
    rows = []
    for n in nps:
        if n < 2:
            continue
        sys_n = system.at(n)
        rows.append({"model": model.name, "profile": system.name, "np": n, "bytes": nbytes,
                     "picked": choose(nbytes, n),
                     "auto_ms": 1e3 * allreduce_time(sys_n, "auto", nbytes, n, model.dtype.itemsize),
                     "ring_ms": 1e3 * allreduce_time(sys_n, "ring", nbytes, n, model.dtype.itemsize)})
    return rows


@dataclasses.dataclass
class Prediction:
    """One predicted step: its parts in seconds and the bytes per rank. ``update_s`` is the
    weights' work: this rank's update and, at delay 1, the step boundary's passes."""
    step_s: float
    compute_s: float
    comm_s: float
    update_s: float
    exposed_s: float
    bytes_mean: float
    bytes_max: int


def _exchange_items(system, model, mode, n, size, part, update_s):
    """The exchange of ``part`` = [lo, hi) of a region of ``size`` elements, as the stream runs
    it: [("msg", seconds) for each wait on a transfer, ("cpu", seconds) for adds and update].

    ring: reduce-scatter over the region's shard bounds clipped to the part (as the code's
    bucket plans clip them), then the update of this rank's share, then all-gather; tree
    and master: reduce, the root's update, broadcast, each cut into the waits the code makes.
    """
    itemsize = model.dtype.itemsize
    lo, hi = part
    if n == 1:
        return [("cpu", update_s)]
    if mode == "ring":
        bounds = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo)
                  for a, b in _shard_bounds(size, n)]
        return (_ring_items(system, bounds, itemsize, "rs") + [("cpu", update_s)]
                + _ring_items(system, bounds, itemsize, "ag"))
    if system.rooted and mode in system.rooted:     # local: the link fitted on this communicator
        link = system.rooted[mode]
        system = dataclasses.replace(system, intra=link, inter=link)
    elems = hi - lo
    timing = _tree_time if mode == "tree" else _master_time
    reduce, bcast = timing(system, n, elems * itemsize, elems)
    moved = timing(_without_latency(system), n, elems * itemsize, elems)
    waits = _rooted_waits(mode, n, elems, itemsize)

    peer = [("peer", system.msg_wait_s)] if system.msg_wait_s else []

    def cut(total, copied):
        return ([("msg", max(0.0, total - copied) / waits), ("copy", copied / waits)] + peer) * waits
    return cut(reduce, moved[0]) + [("cpu", update_s)] + cut(bcast, moved[1])


def _rooted_waits(mode, n, elems, itemsize):
    """Waits on the critical path of a rooted reduce or broadcast (each may sleep until progressed)."""
    pieces = len(_pieces(elems, itemsize, mode, n)) if _rooted_concurrent() else 1
    depth = max(1, math.ceil(math.log2(n + 1)) - 1) if mode == "tree" else 1
    return max(1, pieces * depth)


def buckets(model, stop_layer):
    """The code's delay-0 buckets of ``model.layers[:stop_layer]``: [(lo, hi, layer)] in the
    order the backward completes them, or [] where the code has none (or they are off)."""
    size = code_facts()["bucket_bytes"]
    if not size:
        return []
    from ringnet.parallel.plans import backward_buckets
    return list(backward_buckets(model, stop_layer, size))


def _progress(system):
    """How the stream's transfers progress beside the compute: gpu, driven, poll or block."""
    if system.cores is None:
        return "gpu"
    return code_facts()["progress"]


@dataclasses.dataclass
class Timeline:
    """One step's compute on the training thread: where it calls the streams' progress.

    ``points``: times of the layer boundaries (the strategy's hook progresses the
    streams there); ``dense``: intervals in which the thread waits in MPI itself (a
    blocking collective), which progresses the streams all along; ``ready``: the time
    the backward of each layer index ends; ``end``: when the compute ends.
    """
    points: list
    dense: list
    ready: dict
    end: float

    def next_progress(self, t, shift):
        """First time >= t at which the training thread progresses (compute delayed by ``shift``)."""
        for a, b in self.dense:
            if a + shift <= t <= b + shift:
                return t
        later = [p + shift for p in self.points if p + shift >= t]
        later += [a + shift for a, _ in self.dense if a + shift >= t]
        return min(later) if later else t


def _layer_timeline(cp, model, segments, slow):
    """Build a Timeline from [("fwd"|"bwd", layer index, batch, share) | ("dense", seconds)]."""
    t, points, dense, ready = 0.0, [], [], {}
    for seg in segments:
        if seg[0] == "dense":
            dense.append((t, t + seg[1]))
            t += seg[1]
            continue
        kind, index, batch, share = seg
        fwd, bwd = cp.layer(model.name, model.layers[index][0], batch, share)
        t += (fwd if kind == "fwd" else bwd) * slow
        points.append(t)
        if kind == "bwd":
            ready[index] = t
    return Timeline(points, dense, ready, t)


def _simulate(system, timeline, ops, progress):
    """Step time when ``ops`` [(ready time, items)] run in order on the stream beside the compute.

    A transfer is a wait ("msg") and a copy ("copy"); together they take its blocking time.
    The copy is the rank's own core's work inside MPI: with driven progress the training
    thread's test makes it, so it delays the compute. How the wait ends depends on
    ``progress``, as the code runs it: ``driven`` (the stream's thread sleeps until the training thread tests the
    transfer at a layer boundary, or all along while it waits in MPI, or at the end of the
    step when it waits for the stream), ``poll``/``block`` (the stream's thread polls: the
    transfer moves at the calibrated ``rate`` of its blocking speed and takes ``steal`` of
    the core meanwhile), ``gpu`` (transfers overlap the compute). The stream's adds and
    update are work on the rank's core (or device): they delay the compute unless a spare
    core is free.
    """
    n_spare = progress != "gpu" and system.cores is not None and system.cores >= 2 * system.ranks_here
    shift, t = 0.0, 0.0
    rate, steal = max(system.rate, 1e-3), min(system.steal, 0.9)
    for ready, items in ops:
        t = max(t, ready + shift)
        for kind, seconds in items:
            computing = t < timeline.end + shift
            if kind == "peer":                  # beside compute the calibrated rate holds it
                if not computing:
                    t += seconds
                continue
            if kind == "cpu":
                if computing and not n_spare:
                    shift += seconds
                t += seconds
                continue
            if not computing or progress == "gpu":
                t += seconds
            elif progress == "driven":
                # the copy is the training thread's work; the transfer moves at the rate the
                # calibration measured beside compute progressed at layer boundaries (1 where
                # none was measured) and is noticed at the next boundary
                if kind == "copy":
                    shift += seconds
                span, left = seconds / rate, timeline.end + shift - t
                if span <= left:
                    t = timeline.next_progress(t + span, shift)
                else:                           # the compute ends first: the rest at full speed
                    t += left + seconds - rate * left
            else:                               # poll, block: the calibrated rate and steal
                span = seconds / rate
                left = timeline.end + shift - t
                if span * (1 - steal) <= left:
                    shift += steal * span
                    t += span
                else:                           # the compute ends first: the rest at full speed
                    busy = left / (1 - steal)
                    shift += steal * busy
                    t += busy + seconds - rate * busy
    return max(timeline.end + shift, t), shift


def predict(system, model, mode, delay, n, batch):
    """Predict one step of ``mode`` at N ranks; ``batch`` is the global batch (B/N per rank)."""
    if mode not in ("single", "ring", "tree", "master", "split-fc"):
        raise ValueError(f"unknown mode {mode!r}")
    if mode == "single":
        n, delay = 1, 0
    system = system.at(n)
    system = dataclasses.replace(system, ranks_here=min(n, system.ranks_per_node))
    cp = system.compute
    name, itemsize = model.name, model.dtype.itemsize
    slow = system.contention(n, name)
    sent = traffic(model, mode, n, batch)
    bytes_mean, bytes_max = float(np.mean(sent)), int(max(sent))
    progress = _progress(system)
    layers = range(len(model.layers))

    if mode == "split-fc":
        plan, conv, blocks = split_fc_plan(model, n, batch)
        fc_start = model.fc_start()
        fc_names = {lname for lname, _ in model.layers[fc_start:]}
        share = max(max(b - a for a, b in _shard_bounds(layer.out_features, n)) / layer.out_features
                    for _, layer, _ in blocks)
        fc_compute = (cp.step_compute(name, batch, fc_names, share) + cp.overhead_s(name, batch)) * slow
        fc_rows = sum(max(b - a for a, b in _shard_bounds(layer.out_features, n))
                      * (layer.in_features + 1) for _, layer, _ in blocks)
        fc_update = cp.update(fc_rows, 2 * len(blocks)) * slow
        # The activation collectives block the training thread. On a GPU the strategy
        # overlaps each backward reduce-scatter with the same block's dW/db (about half
        # the layer's backward), the conversion layer's also with the FC update.
        hidden = {}
        if system.cores is None:
            for bname, _, _ in blocks:
                hidden[bname] = 0.5 * cp.layer(name, bname, batch, share)[1] * slow
            hidden[blocks[0][0]] += fc_update
        act = 0.0
        for label, kind, bounds in plan:
            if label.startswith("conv "):
                continue
            t = _ring_time(system, bounds, itemsize, kind)
            block = _overlapped_block(label, blocks)
            act += max(0.0, t - hidden.get(block, 0.0)) if block else t
        local = batch / n
        segments = ([("fwd", i, local, 1.0) for i in layers[:fc_start]]
                    + [("dense", fc_compute + act + fc_update)]
                    + [("bwd", i, local, 1.0) for i in reversed(layers[:fc_start])])
        timeline = _layer_timeline(cp, model, segments, slow)
        compute = timeline.end - act - fc_update
        region, bucket_list = conv, (buckets(model, fc_start) if not delay and n > 1 else [])
        fixed = fc_update
    else:
        local = batch / n
        segments = ([("fwd", i, local, 1.0) for i in layers]
                    + [("dense", cp.overhead_s(name, local) * slow)]
                    + [("bwd", i, local, 1.0) for i in reversed(layers)])
        timeline = _layer_timeline(cp, model, segments, slow)
        compute, act, fixed = timeline.end, 0.0, 0.0
        region = model.num_params
        bucket_list = buckets(model, len(model.layers)) if not delay and n > 1 else []

    def update_of(lo, hi):
        """The update of this rank's share of [lo, hi): its ring shard, or all of it on the root."""
        if mode in ("ring", "split-fc") and n > 1:
            owned = max(max(0, min(b, hi) - max(a, lo)) for a, b in _shard_bounds(region, n))
        else:
            owned = hi - lo
        return cp.update(owned) * slow

    xmode = "ring" if mode in ("split-fc", "single") else mode
    whole = _exchange_items(system, model, xmode, n, region, (0, region), update_of(0, region))
    comm = sum(t for kind, t in whole if kind in ("msg", "copy", "peer"))
    # delay 1: the step boundary's element-wise passes over the region, on the training
    # thread after it waited for the previous exchange and before it starts this one
    boundary = (boundary_s(cp, region, code_facts().get("delay_compensation", "lookahead")) * slow
                if delay and mode != "single" else 0.0)
    update = update_of(0, region) + fixed + boundary
    ops = []
    if delay and n > 1:
        ops = [(0.0, whole)]
    elif bucket_list:
        ops = [(timeline.ready[layer], _exchange_items(system, model, xmode, n, region, (lo, hi),
                                                       update_of(lo, hi)))
               for lo, hi, layer in bucket_list]
    if ops:
        step, shift = _simulate(system, timeline, ops, progress)
        compute += shift                # the stream's work the compute waited for on its core
    else:
        step = timeline.end + sum(t for _, t in whole)
    step += boundary
    if n > 1:
        # ranks beyond the cores: the first wait for peers after the rank's own compute finds
        # some descheduled (measured once per step: the waits that follow in the same step
        # meet peers already in step, and pay the per-message part in the link's latency)
        step += system.wait_s
        # a core per rank: at delay 0 every step ends when its slowest rank's compute does
        # (delay 1 has a step of slack for it); where ranks share cores the wait for
        # descheduled peers above stands for it (System.at keeps no imbalance there)
        if not delay:
            step += compute * ((system.imbalance or {}).get(name, 1.0) - 1.0)
    return Prediction(step, compute, comm + act, update,
                      max(0.0, step - compute - update), bytes_mean, bytes_max)


# -- sweeps, crossovers ---------------------------------------------------------------------
def sweep(system, model, nps, batch, scaling, modes=MODES):
    """Return prediction rows for every (mode, delay) and N; speedup over single at N=1."""
    base = predict(system, model, "single", 0, 1, batch).step_s
    rows = []
    for mode, delay in modes:
        for n in nps:
            if mode == "single" and n != 1:
                continue
            global_batch = batch * n if scaling == "weak" else batch
            if scaling == "strong" and batch % n:
                continue
            if mode == "split-fc" and not _splittable(model, n):
                continue
            pred = predict(system, model, mode, delay, n, global_batch)
            # weak scaling: N ranks do N times the work of one step at N=1
            speedup = base / pred.step_s * (n if scaling == "weak" else 1)
            rows.append({"model": model.name, "mode": mode, "delay": delay, "np": n,
                         "profile": system.name, "step_ms": pred.step_s * 1e3,
                         "speedup": speedup, "efficiency": speedup / n,
                         "comm_ms": pred.comm_s * 1e3, "bytes_per_rank": pred.bytes_mean})
    return rows


def _splittable(model, n):
    from ringnet.parallel.fc_slices import fc_blocks
    return all(layer.out_features >= n for _, layer, _ in fc_blocks(model))


def crossovers(system, model, batch, scaling, max_np, modes=MODES):
    """Return rows {faster, than, from_np}: the smallest N where one mode's time per image
    drops below another's, searched on powers of two and refined by bisection."""
    def per_image(mode_delay, n):
        gb = batch * n if scaling == "weak" else batch
        return predict(system, model, mode_delay[0], mode_delay[1], n, gb).step_s / gb

    def valid(n):
        return scaling == "weak" or (n <= batch and batch % n == 0)

    candidates = [md for md in modes if md[0] != "single"]
    grid = [n for n in (2 ** k for k in range(1, 31)) if n <= max_np and valid(n)]
    found = []
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            ns = [n for n in grid if all(_splittable(model, n) for m in (a, b) if m[0] == "split-fc")]
            prev = None
            for lo, hi in zip([None] + ns, ns):
                sign = per_image(a, hi) < per_image(b, hi)
                if prev is not None and sign != prev:
                    lo_n, hi_n = lo, hi
                    while hi_n - lo_n > 1:          # first N in (lo, hi] with the new order
                        mid = (lo_n + hi_n) // 2
                        if not valid(mid):
                            break
                        if (per_image(a, mid) < per_image(b, mid)) == sign:
                            hi_n = mid
                        else:
                            lo_n = mid
                    winner, loser = (a, b) if sign else (b, a)
                    found.append({"model": model.name, "profile": system.name,
                                  "faster": _label(*winner), "than": _label(*loser),
                                  "from_np": hi_n})
                prev = sign
    return found


def _label(mode, delay):
    return f"{mode} d{delay}"


# -- calibration on this machine (profile "local") -------------------------------------------
CALIBRATION_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
STREAM_SIZES = (512 << 10, 2 << 20)


def _calibrate_worker(iters, models=(), batch=0):
    """Under mpirun: time the ring communicator blocking and on its stream beside compute.

    Prints one JSON line on rank 0: the compute work unit alone and with every rank busy,
    each of ``models``' training step (forward, loss, backward) at the per-rank ``batch``
    alone and on every rank at once, blocking reduce-scatter+all-gather per size, per
    stream size the exchange's own duration and the work unit's time while it ran, and a
    small exchange (1 and 4 ring all-reduces of 4 KiB on the stream, waited for as
    training waits) entered idle and entered right after the work unit.
    """
    from mpi4py import MPI
    from ringnet.comm import (MasterSlaveCommunicator, MpiTransport, RingCommunicator,
                              TreeCommunicator)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    transport = MpiTransport(world)
    ring = RingCommunicator(transport)
    rooted = {"tree": TreeCommunicator(transport), "master": MasterSlaveCommunicator(transport)}
    model = build_model("lenet", seed=rank)
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(16,) + model.input_shape).astype(model.dtype)
    y = rng.integers(0, model.num_classes, size=16)

    def work():
        for _ in range(4):
            model.loss_and_grad(x, y)

    def idle_barrier():
        # sleeps while waiting, so an idle rank leaves its core to the others
        request = world.Ibarrier()
        while not request.Test():
            time.sleep(2e-4)

    def reduced(seconds, op):
        # element-wise over the ranks; sleeps while waiting (as idle_barrier), so a rank done
        # early does not spin on a core its slower peers need (a spinning MAX reduce made 4
        # ranks on 2 cores look 3.3x slower than one, where training, whose waits sleep,
        # runs them 2x slower)
        seconds = np.atleast_1d(np.asarray(seconds, dtype=np.float64))
        out = np.zeros_like(seconds)
        request = world.Iallreduce(seconds, out, op=op)
        while not request.Test():
            time.sleep(2e-4)
        return out

    def slowest(seconds):
        return float(reduced(seconds, MPI.MAX)[0])

    def mean_over_ranks(seconds):
        return float(reduced(seconds, MPI.SUM)[0]) / n

    work()
    solo, together = [], []
    for _ in range(iters):
        idle_barrier()
        if rank == 0:
            solo.append(_median_time(work, 1))
        idle_barrier()
        together.append(slowest(_median_time(work, 1)))
    # each model's own step at its per-rank batch: one rank alone (the others sleep), then
    # every rank at once (training's compute time is the mean over ranks)
    steps = {}
    for name in models:
        net = build_model(name, seed=rank)
        xb = rng.normal(size=(batch,) + net.input_shape).astype(net.dtype)
        yb = rng.integers(0, net.num_classes, size=batch)

        net.loss_and_grad(xb, yb)
        # steps back to back for at least STEPS_TIMED_S: several scheduler slices, so ranks
        # that share a core share it as in training (one short step may run unshared)
        calls = world.bcast(max(1, math.ceil(STEPS_TIMED_S / _median_time(
            lambda: net.loss_and_grad(xb, yb), 1))) if rank == 0 else None, root=0)

        def each_step():
            times = np.empty(calls)
            for i in range(calls):
                t0 = time.perf_counter()
                net.loss_and_grad(xb, yb)
                times[i] = time.perf_counter() - t0
            return times
        alone, all_ranks, imbalance = [], [], []
        for _ in range(DIRECT_SAMPLES * iters):
            idle_barrier()
            if rank == 0:
                alone.append(float(each_step().mean()))
            idle_barrier()
            times = each_step()
            mean = mean_over_ranks(float(times.mean()))
            all_ranks.append(mean)
            # a synchronous step waits for its slowest rank: the k-th steps' maximum over
            # the ranks against their mean
            imbalance.append(float(reduced(times, MPI.MAX).mean()) / mean)
        steps[name] = {"batch": batch, "calls": calls,
                       "solo_s": float(np.median(alone)) if rank == 0 else 0.0,
                       "together_s": float(np.median(all_ranks)),
                       "imbalance": float(np.median(imbalance))}
    def sizes_timed(exchange):
        """Median (over iters) of the slowest rank's time of ``exchange(buf)``, per size."""
        times = {}
        for size in CALIBRATION_SIZES:
            buf = np.ones(size // 4, np.float32)
            samples = []
            for _ in range(iters):
                idle_barrier()
                t0 = time.perf_counter()
                exchange(buf)
                samples.append(slowest(time.perf_counter() - t0))
            times[size] = float(np.median(samples))
        return times

    def ring_allreduce(buf):
        ring.reduce_scatter(buf)
        ring.allgather(buf)

    def rooted_allreduce(comm):
        def run(buf):
            comm.reduce(buf, root=0)
            comm.bcast(buf, root=0)
        return run

    blocking = sizes_timed(ring_allreduce)
    # the tree's and master's reduce + broadcast: their messages are fewer and larger
    by_mode = {mode: sizes_timed(rooted_allreduce(comm)) for mode, comm in rooted.items()}
    stream = ring.new_stream()
    streamed = {}
    try:                                 # progress at layer boundaries, as the strategies do
        from ringnet.comm.stream import progress_all
    except ImportError:
        progress_all = None
    if progress_all is not None and hasattr(model, "layer_hook"):
        model.layer_hook = lambda phase, index: progress_all()
    for size in STREAM_SIZES:
        buf = np.ones(size // 4, np.float32)
        spans, works = [], []

        def exchange(out):
            t0 = time.perf_counter()
            ring.reduce_scatter(buf)
            ring.allgather(buf)
            out.append(time.perf_counter() - t0)
        for _ in range(iters):
            idle_barrier()
            got = []
            t0 = time.perf_counter()
            handle = stream.submit(exchange, got)
            work()
            t_work = time.perf_counter() - t0
            handle.wait()
            spans.append(slowest(got[0]))
            works.append(slowest(t_work))
        streamed[size] = (float(np.median(spans)), float(np.median(works)))
    # waits for peers: a small exchange on the stream, waited for as training waits (the
    # waiting thread drives it), entered idle or right after the work unit; from the end
    # of the rank's own work to the exchange's end, mean over ranks
    small = np.ones(1024, np.float32)

    def exchanges(count):
        for _ in range(count):
            small.fill(1.0)
            ring.reduce_scatter(small)
            ring.allgather(small)
    waits = {}
    for _ in range(DIRECT_SAMPLES * iters):
        for count in LOADED_EXCHANGES:
            for kind in ("idle", "loaded"):
                idle_barrier()
                if kind == "loaded":
                    work()
                t0 = time.perf_counter()
                stream.submit(exchanges, count).wait()
                waits.setdefault(f"{kind}{count}", []).append(
                    mean_over_ranks(time.perf_counter() - t0))
    stream.close()
    if rank == 0:
        print(json.dumps({"np": n, "cores": usable_cores(), "solo_s": float(np.median(solo)),
                          "together_s": float(np.median(together)),
                          "blocking": blocking, "streamed": streamed,
                          "rooted": by_mode, "models": steps,
                          "waits": {k: float(np.median(v)) for k, v in waits.items()}}),
              flush=True)
    return 0


# exchanges in a row of the calibration's wait measurement (two counts: per wait, per message)
LOADED_EXCHANGES = (1, 4)
# the contention and the waits go into every step's prediction as measured (no fit smooths
# them): they take this many times --iters samples, a median that one slow moment moves less
DIRECT_SAMPLES = 2
# a model's steps are timed back to back for at least this long (a few scheduler slices)
STEPS_TIMED_S = 0.03


def _relative_lstsq(rows, rhs, seconds):
    """Least squares of the *relative* error: each timing weighted by 1 / its measured time.

    Timings on a shared machine scatter in proportion to their size, so plain least squares
    lets the large messages' scatter set the latency; split-fc's activation messages and
    the ring's steps at large N are small, and must count as much as the large ones.
    """
    weights = 1.0 / np.maximum(np.asarray(seconds, float), 1e-12)
    solution, *_ = np.linalg.lstsq(np.array(rows) * weights[:, None], np.array(rhs) * weights,
                                   rcond=None)
    return solution


def _fit_link(n, sizes_s, add_s_per_elem):
    """Fit (alpha, beta) of ring RS+AG times: t = 2(N-1) alpha + 2(N-1)/N S / beta + adds."""
    rows, rhs = [], []
    for size, seconds in sizes_s:
        adds = (n - 1) * add_s_per_elem * size / 4 / n
        rows.append([2 * (n - 1), 2 * (n - 1) / n * size])
        rhs.append(max(seconds - adds, 0.0))
    alpha, inv_beta = _relative_lstsq(rows, rhs, [t for _, t in sizes_s])
    if inv_beta <= 0:                      # latency-bound in the measured range
        inv_beta = 1e-12
    return max(float(alpha), 0.0), 1.0 / float(inv_beta)


def calibrate(nps, compute, mpirun="mpirun", iters=7, timeout=300, models=(), batch=64,
              scaling="weak"):
    """Run the calibration worker at each N under mpirun; return the ``local`` calibration.

    ``models``' steps are timed at the per-rank batch (``batch``, or batch / N for strong
    scaling) with every rank busy."""
    if shutil.which(mpirun) is None:
        raise UsageError(f"launcher {mpirun!r} not found; `pip install mpich` or pass --mpirun")
    by_np = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    for n in nps:
        per_rank = max(1, batch // n) if scaling == "strong" else batch
        cmd = [mpirun, "-np", str(n), sys.executable, "-m", "ringnet.bench", "model",
               "--calibrate-worker", "--iters", str(iters), "--batch-size", str(per_rank),
               "--models", ",".join(models)]
        raw = run_json(cmd, f"calibration at N={n}", env=env, timeout=timeout)
        by_np[n] = _calibration_record(n, raw, compute.add_s_per_elem)
    return {"by_np": by_np}


def _fit_rooted(mode, n, sizes_s, add_s_per_elem):
    """Fit (alpha, beta) of tree or master reduce+broadcast times with the model's own formulas."""
    timing = _tree_time if mode == "tree" else _master_time

    def coefficient(alpha, beta, size):
        link = Link("fit", alpha, beta)
        system = System("fit", link, link, 1 << 30, _ZERO_COMPUTE)
        return sum(timing(system, n, size, size // 4))
    rows, rhs = [], []
    for size, seconds in sizes_s:
        a = coefficient(1.0, 1e30, size)                  # messages on the critical path
        b = coefficient(0.0, 1.0, size)                   # bytes on the critical path
        adds = (n - 1) * add_s_per_elem * size / 4
        rows.append([a, b])
        rhs.append(max(seconds - adds, 0.0))
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-12)


def _calibration_record(n, raw, add_s_per_elem):
    """Turn one worker's timings into link, contention, and the stream's rate and steal."""
    blocking = sorted((int(k), v) for k, v in raw["blocking"].items())
    alpha, beta = _fit_link(n, blocking, add_s_per_elem) if n > 1 else (0.0, 1e30)
    together = raw["together_s"]
    rates, steals = [], []
    for size, (span, work) in sorted((int(k), v) for k, v in raw["streamed"].items()):
        alone = dict(blocking).get(size)
        overlap = min(span, work)
        if not alone or overlap <= 0:
            continue
        tail = max(0.0, span - work)            # ran after the compute, at blocking speed
        rates.append(min(1.0, max(1e-3, (alone - min(tail, alone)) / overlap)))
        steals.append(min(0.9, max(0.0, (work - together) / overlap)))
    rooted = {mode: dict(zip(("alpha_s", "beta_Bps"),
                             _fit_rooted(mode, n, sorted((int(k), v) for k, v in sizes.items()),
                                         add_s_per_elem)))
              for mode, sizes in raw.get("rooted", {}).items() if n > 1}
    slowdown = together / raw["solo_s"]
    # N busy ranks share at most the cores they may run on: ranks timed as a mean over
    # ranks that start and end apart (one finishing early frees a core for the rest) can
    # look as if they had more; a training step waits for its slowest rank
    physical = raw.get("cores") or math.inf
    if "cores" in raw:      # all ranks busy against one alone, waits that sleep: what N share
        cores = min(n / max(slowdown, 1e-9), physical)
    else:                   # older workers waited spinning (overstated), and named no cores
        cores = usable_cores()
    # each model's own step at its per-rank batch, every rank at once against one alone
    model_cores = {name: min(n / max(v["together_s"] / v["solo_s"], 1e-9), physical)
                   for name, v in raw.get("models", {}).items() if v.get("solo_s")}
    slice_s, msg_slice_s = _wait_slices(n, raw.get("cores"), raw.get("waits"))
    return {"alpha_s": alpha, "beta_Bps": beta, "rooted": rooted, "cores": cores,
            "slowdown": slowdown, "model_cores": model_cores,
            # each model's slowest rank per step against the mean (older records: none)
            "imbalance": {name: max(1.0, float(v["imbalance"]))
                          for name, v in raw.get("models", {}).items() if "imbalance" in v},
            "slice_s": slice_s, "msg_slice_s": msg_slice_s,
            "rate": float(np.mean(rates)) if rates else 1.0,
            "steal": float(np.mean(steals)) if steals else 0.0, "raw": raw}


def _describe_contention(n, record):
    """One line: each model's own step slowed with every rank busy, the waits for peers."""
    steps = record.get("raw", {}).get("models", {})
    words = [f"{name} step (batch {v['batch']}) with all ranks busy {v['together_s'] / v['solo_s']:.2f}x "
             "alone" + (f", slowest rank {v['imbalance']:.2f}x the mean" if "imbalance" in v else "")
             for name, v in steps.items() if v.get("solo_s")]
    cores = record.get("raw", {}).get("cores")
    if record.get("slice_s") or record.get("msg_slice_s"):
        words.append(f"wait for descheduled peers {1e3 * scheduling_wait(n, cores, record['slice_s']):.2f} "
                      f"ms per step, {1e6 * scheduling_wait(n, cores, record['msg_slice_s']):.0f} us per "
                      f"message (slices {1e3 * record['slice_s']:.1f} / {1e3 * record['msg_slice_s']:.2f} ms)")
    elif "waits" in record.get("raw", {}):
        words.append("no wait for descheduled peers (a core per rank)")
    return "; ".join(words) or "no per-model or wait timings (older calibration)"


def _wait_slices(n, cores, waits):
    """The scheduler slices (per blocking wait, per message) that the calibration's small
    exchanges entered right after compute imply, or (0, 0) where every rank has a core.

    The exchange of ``count`` ring all-reduces (2(N-1) messages each) entered after the
    work unit takes ``W + count 2(N-1) w`` longer than entered idle: ``W`` the wait for
    peers still descheduled when it starts, ``w`` each message's. Two counts give both;
    each is :func:`scheduling_wait` of a slice at this N, which is inverted here.
    """
    if not waits or not cores or n <= cores or any(
            f"{kind}{c}" not in waits for kind in ("idle", "loaded") for c in LOADED_EXCHANGES):
        return 0.0, 0.0
    lo, hi = LOADED_EXCHANGES[0], LOADED_EXCHANGES[-1]
    extra = {c: max(0.0, waits[f"loaded{c}"] - waits[f"idle{c}"]) for c in (lo, hi)}
    per_exchange = 2 * (n - 1)
    per_msg = max(0.0, (extra[hi] - extra[lo]) / ((hi - lo) * per_exchange))
    first = max(0.0, extra[lo] - lo * per_exchange * per_msg)
    unit = scheduling_wait(n, cores, 1.0)
    return first / unit, per_msg / unit


# -- validation: predicted against measured on this machine -----------------------------------
VALIDATION_NP = (1, 2, 4)
VALIDATION_MODES = tuple(md for md in MODES if md[0] != "single")


def validate(models, batch, steps, repeats, mpirun="mpirun", iters=7, timeout=600,
             nps=VALIDATION_NP):
    """Measure, in each of ``repeats`` rounds: the compute profile, the local calibration, and
    ``python -m ringnet.train`` (through ``bench scaling``) for every mode at each N.

    Returns a record that :func:`validation_rows` turns into predicted-beside-measured rows;
    each round's prediction uses that round's inputs (a shared machine's speed drifts)."""
    from ringnet.bench import scaling
    args = scaling._parser().parse_args([])
    args.batch_size, args.steps, args.mpirun, args.timeout = batch, steps, mpirun, timeout
    configs = [(m, "single", 0, 1) for m in models]
    configs += [(m, mode, delay, n) for m in models for n in nps for mode, delay in VALIDATION_MODES
                if mode != "split-fc" or _splittable(build_model(m), n)]
    rounds = []
    for round_ in range(repeats):
        compute = measure_compute(models)
        calibration = calibrate(tuple(n for n in nps if n > 1), compute, mpirun, iters,
                                models=models, batch=batch, scaling="strong")
        measured = []
        for i, (name, mode, delay, n) in enumerate(configs):
            args.model = name
            result = scaling.run_config(args, mode, delay, n)
            steps_run = max(int(result.get("steps") or steps), 1)
            measured.append({"model": name, "mode": mode, "delay": delay, "np": n,
                             "step_ms": result["step_ms"],
                             # per step, mean over ranks: where the time went
                             **{f"{part}_ms": 1e3 * result[f"{key}_s"] / steps_run
                                for part, key in (("compute", "compute"), ("exposed", "comm_wait"),
                                                  ("update", "update"), ("data", "data"))
                                if f"{key}_s" in result}})
            print(f"\r[round {round_ + 1}/{repeats}] {i + 1}/{len(configs)} ", end="",
                  file=sys.stderr, flush=True)
        rounds.append({"compute": compute.to_json(), "calibration": calibration,
                       "measured": measured})
    print(file=sys.stderr)
    return {"batch_size": batch, "steps": steps, "rounds": rounds, "code": code_facts(),
            "load_average": list(os.getloadavg())}


def validation_rows(record):
    """Return [{model, mode, delay, np, predicted_ms, measured_ms, error, errors, spread, parts}]:
    every configuration measured, none left out. ``predicted_ms``/``measured_ms`` are medians
    over the rounds; ``errors`` each round's own error (that round's prediction, from that
    round's profile and calibration, against that round's measurement) and ``error`` their
    median, so a drift of the machine between rounds is not mistaken for a model error;
    ``spread`` = (max - min) / median of the measured step."""
    with facts(record.get("code", OLD_FACTS)):       # as the code that was measured ran
        return _validation_rows(record)


def _validation_rows(record):
    batch = record["batch_size"]
    table = {}
    for rnd in record["rounds"]:
        compute = compute_from_json(rnd["compute"])
        system = make_system("local", compute, 1, rnd["calibration"])
        for m in rnd["measured"]:
            key = (m["model"], m["mode"], m["delay"], m["np"])
            pred = predict(system, build_model(m["model"]), m["mode"], m["delay"], m["np"], batch)
            entry = table.setdefault(key, {"predicted": [], "measured": [], "parts": []})
            entry["predicted"].append(pred.step_s * 1e3)
            entry["measured"].append(m["step_ms"])
            parts = {"compute": (pred.compute_s * 1e3, m.get("compute_ms")),
                     "exposed": (pred.exposed_s * 1e3, m.get("exposed_ms")),
                     "update": (pred.update_s * 1e3, m.get("update_ms")),
                     "data": (0.0, m.get("data_ms"))}
            entry["parts"].append(parts)
    rows = []
    for k, v in table.items():
        parts = {}
        for part in ("compute", "exposed", "update", "data"):
            pred = statistics.median(p[part][0] for p in v["parts"])
            got = [p[part][1] for p in v["parts"] if p[part][1] is not None]
            parts[part] = (pred, statistics.median(got) if got else None)
        # paired: each round's prediction against that round's measurement, then the median
        errors = [(p - m) / m for p, m in zip(v["predicted"], v["measured"])]
        rows.append({"model": k[0], "mode": k[1], "delay": k[2], "np": k[3],
                     "predicted_ms": statistics.median(v["predicted"]),
                     "measured_ms": statistics.median(v["measured"]),
                     "error": statistics.median(errors), "errors": errors,
                     "spread": (max(v["measured"]) - min(v["measured"]))
                     / statistics.median(v["measured"]), "parts": parts})
    return rows


def _error(row):
    """A validation row's error: the median of its rounds' paired errors (records reprinted
    by older code: the error of the medians)."""
    if "error" in row:
        return row["error"]
    return (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]


def diagnose(row, rows):
    """Say where a validation row's error comes from: the part of the step (compute, exposed
    communication, update, data loading the model does not charge) that differs most, and
    how far the machine itself moved (the spread of this row's rounds; the N=1 rows of the
    same model, which all do the same work)."""
    err = _error(row)
    measured = {k: v for k, v in row["parts"].items() if v[1] is not None}
    words = []
    if measured:
        diffs = {k: p - m for k, (p, m) in measured.items()}
        worst = max(diffs, key=lambda k: abs(diffs[k]))
        what = {"compute": "compute (the profile or the contention at this N)",
                "exposed": "exposed communication (the link or the overlap)",
                "update": "the update", "data": "data loading (not modelled)"}[worst]
        words.append(f"{what}: predicted {measured[worst][0]:.1f} ms, measured "
                     f"{measured[worst][1]:.1f} ms")
    ones = [r["measured_ms"] for r in rows if r["model"] == row["model"] and r["np"] == 1]
    if len(ones) > 1:
        floor = (max(ones) - min(ones)) / statistics.median(ones)
        words.append(f"same-work N=1 rows of {row['model']} differ by {100 * floor:.0f}%")
    words.append(f"rounds of this row differ by {100 * row['spread']:.0f}%")
    return f"{_label(row['mode'], row['delay'])} N={row['np']} {100 * err:+.0f}%: " + "; ".join(words)


def paper_rows(compute_name, profile, dtype="float32"):
    """Predict the research's setting: 4 GPUs, Caffe's per-GPU batch, every mode."""
    compute = _compute(compute_name, tuple(PAPER), dtype)
    system = make_system(profile, compute, PAPER_NP)
    rows = []
    for name, (batch, reported) in PAPER.items():
        model = build_model(name, dtype=dtype)
        for row in sweep(system, model, (PAPER_NP,), batch, "weak"):
            row["reported_speedup"] = reported if (row["mode"], row["delay"]) == ("ring", 1) else None
            row["batch_per_gpu"] = batch
            rows.append(row)
    return rows, compute, system


def _compute(spec, models, dtype):
    if spec == "here":
        return measure_compute(models, dtype=dtype)
    if spec == "here-isolated":
        return isolated_compute(models, dtype=dtype)
    if spec in GPUS:
        return roofline_compute(spec, models, dtype)
    return load_compute(spec)


# -- output ---------------------------------------------------------------------------------
MARKDOWN_TABLES = ("predictions", "paper", "validation")
PAPER_LABELS = {"lenet": "LeNet / MNIST", "cifar10_quick": "cifar10_quick / CIFAR-10"}


def _minus(text):
    return text.replace("-", "\u2212")


def _ms(seconds_ms):
    """Milliseconds to three significant digits, never in exponent form."""
    return f"{seconds_ms:.3g}" if seconds_ms < 1000 else f"{seconds_ms:.0f}"


def markdown_predictions(rows, nps):
    """The predictions as one Markdown table: step ms and efficiency per mode, a row per
    (model, profile, N)."""
    from ringnet.bench.tables import markdown
    cols = [md for md in MODES if any((r["mode"], r["delay"]) == md for r in rows)]
    table = {}
    for r in rows:
        table.setdefault((r["model"], r["profile"]), {})[(r["mode"], r["delay"], r["np"])] = r
    out = []
    for (name, profile), got in table.items():
        for n in nps:
            cells = [got.get((md[0], md[1], n)) for md in cols]
            if any(cells):
                out.append([name, profile, n] + [f"{_ms(c['step_ms'])} ms, {c['efficiency']:.2f}"
                                                 if c else "\u2013" for c in cells])
    return markdown(["model", "profile", "N"] + [f"{_label(*md)} (step, efficiency)" for md in cols],
                    out)


def markdown_paper(rows):
    """The research's setting: predicted speedup per mode beside the reported one."""
    from ringnet.bench.tables import markdown
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["batch_per_gpu"]), {})[(r["mode"], r["delay"])] = r
    out = []
    for (name, batch), got in by.items():
        cells = [f"**{got[('ring', 1)]['speedup']:.2f}**"]
        cells += [f"{got[md]['speedup']:.2f}" if md in got else "\u2013"
                  for md in (("ring", 0), ("tree", 0), ("master", 0), ("split-fc", 0))]
        out.append([PAPER_LABELS.get(name, name), batch] + cells
                   + [f"{got[('ring', 1)]['reported_speedup']:.2f}"])
    return markdown(["model", "batch per GPU", "ring d1", "ring d0", "tree", "master", "split-fc",
                     "reported (ring d1)"], out)


def markdown_validation(rows):
    """Predicted / measured ms (error) per model and mode, a column per N; the error is the
    median of the rounds' paired errors."""
    from ringnet.bench.tables import markdown
    nps = sorted({r["np"] for r in rows})
    by = {}
    for r in rows:
        by.setdefault((r["model"], _label(r["mode"], r["delay"])), {})[r["np"]] = r
    out = []
    for (name, label), got in by.items():
        cells = []
        for n in nps:
            r = got.get(n)
            if r is None:
                cells.append("\u2013")
                continue
            err = 100 * _error(r)
            cells.append(_minus(f"{_ms(r['predicted_ms'])} / {_ms(r['measured_ms'])} ({err:+.0f}%)"))
        out.append([name, label] + cells)
    header = ["model", "mode"] + [f"N={n} predicted / measured ms" if i == 0 else f"N={n}"
                                  for i, n in enumerate(nps)]
    return markdown(header, out)


def _print_tables(rows, batch, scaling, nps):
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["profile"]), {})[(r["mode"], r["delay"], r["np"])] = r
    for (name, profile), table in by.items():
        cols = [md for md in MODES if any((md[0], md[1], n) in table for n in nps)]
        per = "per rank" if scaling == "weak" else "global"
        print(f"\n# {name}, profile {profile}, {scaling} scaling, batch {batch} {per}: "
              "step ms / speedup / efficiency")
        print(f"{'N':>5} " + " ".join(f"{_label(*md):>22}" for md in cols))
        for n in nps:
            cells = []
            for md in cols:
                r = table.get((md[0], md[1], n))
                cells.append(f"{r['step_ms']:9.3g} {r['speedup']:6.3g} {r['efficiency']:5.2f}"
                             if r else f"{'-':>22}")
            if any(c.strip() != "-" for c in cells):
                print(f"{n:>5} " + " ".join(f"{c:>22}" for c in cells))


def plot(rows, path, title):
    """Step time, speedup and efficiency against N: one row of panels per model."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    styles = ["-", "--", ":", "-."]
    colors = dict(zip([_label(*md) for md in MODES], plt.cm.tab10.colors))
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for i, name in enumerate(models):
        for j, (key, ylabel) in enumerate((("step_ms", "step time (ms)"), ("speedup", "speedup"),
                                            ("efficiency", "efficiency"))):
            ax = axes[i][j]
            for k, profile in enumerate(profiles):
                for md in MODES:
                    pts = sorted((r["np"], r[key]) for r in rows if r["model"] == name
                                 and r["profile"] == profile and (r["mode"], r["delay"]) == md)
                    if len(pts) < 2:
                        continue
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, styles[k % len(styles)], color=colors[_label(*md)],
                            marker=".", label=f"{_label(*md)}, {profile}")
            ax.set_xscale("log", base=2)
            if key != "efficiency":
                ax.set_yscale("log")
            ax.set_xlabel("ranks N")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{name}: {ylabel}")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * math.ceil(len(labels) / 4), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser():
    p = ArgumentParser(prog="python -m ringnet.bench model",
                       description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma list of models (default %(default)s)")
    p.add_argument("--np", type=int, nargs="+", default=list(DEFAULT_NP),
                   help="rank counts (default 1 2 4 ... 1024)")
    p.add_argument("--profile", action="append",
                   help=f"INTRA[/INTER] link profile from {', '.join(LINKS)}, or local "
                        f"(calibrated here); repeatable (default: {', '.join(DEFAULT_PROFILES)})")
    p.add_argument("--ranks-per-node", type=int, default=8,
                   help="ranks (GPUs) per node: hops between nodes use the INTER link (default 8)")
    p.add_argument("--compute", default="here",
                   help="per-layer times: here (measured now inside training steps), "
                        "here-isolated (each layer timed alone, the older way), k40 or h100 "
                        "(stated roofline), or a JSON file from --save-compute (default here)")
    p.add_argument("--save-compute", metavar="FILE", help="write the compute profile used as JSON")
    p.add_argument("--batch-size", type=int, default=64,
                   help="per-rank batch (weak scaling) or global batch (strong) (default 64)")
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak",
                   help="weak: the batch per rank stays fixed (Caffe's multi-GPU convention); "
                        "strong: the global batch stays fixed (default weak)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                   help="type of weights and activations (default float32)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate profile local here (mpirun at N=2 and 4, about 30 s)")
    p.add_argument("--calibration", metavar="FILE",
                   help="read the local calibration from FILE (written by --calibrate when given)")
    p.add_argument("--validate", action="store_true",
                   help="run ringnet.train at each --np given (default 1 2 4) for every mode "
                        "and print predicted beside measured step time; measures compute and "
                        "calibrates in every round (about 4 minutes a round)")
    p.add_argument("--validation", metavar="FILE",
                   help="with --validate: also write the measurements to FILE; without: read "
                        "them from FILE and print the validation again (predictions recomputed)")
    p.add_argument("--validate-steps", type=int, default=40,
                   help="optimizer steps per validation run (default 40)")
    p.add_argument("--validate-repeats", type=int, default=3,
                   help="validation rounds; each re-measures compute and calibration (default 3)")
    p.add_argument("--validate-batch", type=int, default=64,
                   help="global batch of the validation runs (default 64, as bench scaling)")
    p.add_argument("--paper-compute", default="k40",
                   help="compute profile of the research setting (default k40 roofline)")
    p.add_argument("--paper-profile", default="pcie3",
                   help="link profile of the research setting (default pcie3: 4 GPUs in one node)")
    p.add_argument("--max-crossover-np", type=int, default=1024,
                   help="search crossovers up to this N (default 1024)")
    p.add_argument("--plot", metavar="PNG", help="write step time, speedup and efficiency vs N")
    p.add_argument("--markdown", action="store_true",
                   help="print one table as Markdown (the README's): the one --table names")
    p.add_argument("--table", choices=MARKDOWN_TABLES, default="predictions",
                   help="with --markdown: predictions (step ms and efficiency per mode and N), "
                        "paper (the research's setting) or validation (predicted / measured; "
                        "needs --validate or --validation FILE) (default predictions)")
    p.add_argument("--json", action="store_true",
                   help='print one line {"predictions": [...], "validation": [...], "paper": [...]}')
    p.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"),
                   help="launcher for calibration and validation (default $MPIRUN or mpirun)")
    p.add_argument("--iters", type=int, default=7, help="calibration repetitions (median; default 7)")
    p.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv=None):
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.calibrate_worker:
        return _calibrate_worker(args.iters, [m for m in args.models.split(",") if m],
                                 args.batch_size)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise UsageError(f"unknown model(s) {unknown or args.models!r}: choose from {', '.join(MODELS)}")
    if any(n < 1 for n in args.np) or args.batch_size < 1 or args.ranks_per_node < 1:
        raise UsageError("--np, --batch-size and --ranks-per-node must be >= 1")
    if args.markdown and args.table == "validation" and not (args.validate or args.validation):
        raise UsageError("--table validation needs --validate or --validation FILE")
    if args.validate_steps < 3 or args.validate_repeats < 1 or args.validate_batch < 1:
        raise UsageError("--validate-steps must be >= 3, --validate-repeats and "
                         "--validate-batch >= 1")
    if args.max_crossover_np < 2:
        raise UsageError(f"--max-crossover-np must be >= 2, got {args.max_crossover_np}")
    nps = sorted(set(args.np))
    profiles = args.profile or list(DEFAULT_PROFILES)
    for spec in profiles:
        if spec != "local":
            make_system(spec, None, args.ranks_per_node)        # unknown names fail early
    for spec in (args.paper_profile,):
        make_system(spec, None, PAPER_NP)
    if args.paper_compute not in GPUS and args.paper_compute not in ("here", "here-isolated") \
            and not os.path.exists(args.paper_compute):
        raise UsageError(f"--paper-compute {args.paper_compute!r}: use here, "
                         f"{', '.join(GPUS)} or a profile file")

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    compute = _compute(args.compute, models, args.dtype)
    if args.save_compute:
        with open(args.save_compute, "w") as f:
            json.dump(compute.to_json(), f, indent=1)
    note = (lambda text: print(text, file=sys.stderr)) if args.json else print

    calibration = None
    if args.calibration and os.path.exists(args.calibration) and not args.calibrate:
        with open(args.calibration) as f:
            calibration = json.load(f)
    elif args.calibrate or "local" in profiles:
        if compute.device != "cpu":
            raise UsageError("profile local is this CPU machine: use --compute here")
        calibration = calibrate((2, 4), compute, args.mpirun, args.iters, models=models,
                                batch=args.batch_size, scaling=args.scaling)
        if args.calibration:
            with open(args.calibration, "w") as f:
                json.dump(calibration, f, indent=1)

    predictions, crosses, allreduces = [], [], []
    for spec in profiles:
        system = make_system(spec, compute, args.ranks_per_node, calibration)
        for name in models:
            model = build_model(name, dtype=args.dtype)
            rows = sweep(system, model, nps, args.batch_size, args.scaling)
            predictions += rows
            allreduces += allreduce_rows(system, model, nps)
            crosses += crossovers(system, model, args.batch_size, args.scaling,
                                  min(args.max_crossover_np, max(nps)))
    paper, paper_compute, paper_system = paper_rows(args.paper_compute, args.paper_profile, args.dtype)

    validation = []
    if args.validate:
        record = validate(models, args.validate_batch, args.validate_steps,
                          args.validate_repeats, args.mpirun, args.iters,
                          nps=VALIDATION_NP if args.np == list(DEFAULT_NP) else tuple(nps))
        if args.validation:
            with open(args.validation, "w") as f:
                json.dump(record, f, indent=1)
        validation = validation_rows(record)
    elif args.validation:
        try:
            with open(args.validation) as f:
                record = json.load(f)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read validation record {args.validation}: {exc}") from None
        validation = validation_rows(record)
        args.validate_batch, args.validate_steps = record["batch_size"], record["steps"]
        args.validate_repeats = len(record["rounds"])

    if args.plot:
        plot(predictions, args.plot, f"ringnet predicted scaling ({args.scaling}, batch "
                                     f"{args.batch_size}, compute {compute.name})")
    if args.markdown:
        if args.table == "predictions":
            print(markdown_predictions(predictions, nps))
        elif args.table == "paper":
            print(markdown_paper(paper))
        else:
            print(markdown_validation(validation))
        return 0
    if args.json:
        keys = ("model", "mode", "delay", "np", "profile", "step_ms", "speedup", "efficiency")
        print(json.dumps({
            "predictions": [{k: r[k] for k in keys} for r in predictions],
            "validation": [{k: r[k] for k in ("model", "mode", "delay", "np", "predicted_ms",
                                              "measured_ms")} for r in validation],
            "paper": [{"model": r["model"], "np": r["np"], "predicted_speedup": r["speedup"],
                       "reported_speedup": r["reported_speedup"]}
                      for r in paper if r["reported_speedup"] is not None]}))
        return 0

    print(f"# compute: {compute.name} ({compute.source})")
    print(f"# the code modelled: {_describe_facts(code_facts())}")
    for spec in profiles:
        if spec in ("local",):
            continue
        for part in dict.fromkeys(spec.split("/")):
            print(f"# link {part}: alpha {LINKS[part].alpha_s * 1e6:.1f} us, beta "
                  f"{LINKS[part].beta_Bps / 1e9:.2f} GB/s ({LINKS[part].source})")
    if calibration:
        for n, c in sorted((int(k), v) for k, v in calibration["by_np"].items()):
            c = _calibration_record(n, c["raw"], compute.add_s_per_elem) if "raw" in c else c
            print(f"# local at N={n}: alpha {c['alpha_s'] * 1e6:.1f} us, beta "
                  f"{c['beta_Bps'] / 1e9:.2f} GB/s; beside compute the stream moves at "
                  f"{c['rate']:.2f} of that speed; "
                  f"compute slowdown {max(1.0, n / c['cores']):.2f} (effective cores "
                  f"{c['cores']:.2f}; all ranks busy against one alone: {c['slowdown']:.2f}, "
                  f"{c['raw'].get('cores', '?')} cores here); "
                  f"stream steals {c['steal']:.2f} of a core; {_describe_contention(n, c)}")
    _print_tables(predictions, args.batch_size, args.scaling, nps)
    if allreduces:
        print("\n# all-reduce of the whole gradient by the auto communicator (the algorithm the code "
              "picks for the size and N) against the ring, on each profile")
        print(f"  {'model':14s} {'profile':15s} {'N':>5s} {'bytes':>9s} {'auto picks':>10s} "
              f"{'auto ms':>9s} {'ring ms':>9s}")
        for r in allreduces:
            print(f"  {r['model']:14s} {r['profile']:15s} {r['np']:>5d} {r['bytes']:>9d} "
                  f"{r['picked']:>10s} {r['auto_ms']:9.3g} {r['ring_ms']:9.3g}")
    if crosses:
        print("\n# crossovers (time per image): from N on, the first mode is faster")
        for c in crosses:
            print(f"  {c['model']:14s} {c['profile']:15s} {c['faster']:>11s} beats "
                  f"{c['than']:<11s} from N = {c['from_np']}")
    print(f"\n# research setting: {PAPER_NP} GPUs, compute {paper_compute.name} "
          f"({paper_compute.source}), link {args.paper_profile}, Caffe's per-GPU batch")
    print(f"  {'model':14s} {'batch/GPU':>9s} {'mode':>11s} {'step ms':>8s} {'speedup':>8s} "
          f"{'reported':>8s}")
    for r in paper:
        rep = f"{r['reported_speedup']:.2f}" if r["reported_speedup"] else "-"
        print(f"  {r['model']:14s} {r['batch_per_gpu']:>9d} {_label(r['mode'], r['delay']):>11s} "
              f"{r['step_ms']:8.3f} {r['speedup']:8.2f} {rep:>8s}")
    if validation:
        print(f"\n# validation on this machine: global batch {args.validate_batch}, "
              f"{args.validate_steps} steps, median of {args.validate_repeats} interleaved rounds; "
              f"the code measured: {_describe_facts(record.get('code', OLD_FACTS))}"
              + (f"; load average then {', '.join(f'{x:.1f}' for x in record['load_average'])}"
                 if record.get("load_average") else ""))
        methods = sorted({profile_method(rnd["compute"]) for rnd in record["rounds"]})
        print(f"# compute profile of each round: {', '.join(methods)}")
        print(f"  {'model':14s} {'mode':>11s} {'N':>3s} {'predicted ms':>12s} {'measured ms':>11s} "
              f"{'error':>7s} {'each round':>17s} {'spread':>7s}")
        errors = []
        for r in validation:
            err = _error(r)
            errors.append(abs(err))
            each = r.get("errors") or [err]
            span = (f"{100 * min(each):+.0f}..{100 * max(each):+.0f}%" if len(each) > 1
                    else "-")
            print(f"  {r['model']:14s} {_label(r['mode'], r['delay']):>11s} {r['np']:>3d} "
                  f"{r['predicted_ms']:12.2f} {r['measured_ms']:11.2f} {100 * err:+6.1f}% "
                  f"{span:>17s} {100 * r['spread']:6.0f}%")
        within = sum(e <= 0.15 for e in errors)
        print(f"  median |error| {100 * statistics.median(errors):.0f}%, {within} of {len(errors)} "
              f"within 15% (every configuration measured; error = median over rounds of each "
              f"round's prediction against its measurement); spread = (max - min) / median of "
              f"the measured rounds: {100 * statistics.median(r['spread'] for r in validation):.0f}% "
              "(median)")
        both = [r for r in validation
                if min(map(abs, r.get("errors") or [1.0])) <= 0.15 < max(map(abs, r.get("errors") or [0.0]))]
        if both:
            print(f"  {len(both)} row(s) within 15% in one round and outside in another: noise "
                  "decides them, not the model")
        off = [r for r, e in zip(validation, errors) if e > 0.15]
        if off:
            print("# where the model is off by more than 15%, and the part of the step that differs most")
            for r in off:
                print(f"  {r['model']:14s} {diagnose(r, validation)}")
        for i, rnd in enumerate(record["rounds"]):
            for n, c in sorted((int(k), v) for k, v in rnd["calibration"]["by_np"].items()):
                if "raw" in c:
                    c = _calibration_record(n, c["raw"], rnd["compute"]["add_ns_per_element"] * 1e-9)
                    print(f"# round {i + 1}, N={n}: {_describe_contention(n, c)}")
        print(f"# load average now: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
              "(timings on a loaded machine move by tens of percent)")
        if args.validate:
            where = args.validation or "FILE"
            print(f"\n# the README's validation table (reprinted by `python -m ringnet.bench model "
                  f"--compute k40 --np {' '.join(map(str, sorted({r['np'] for r in validation})))} "
                  f"--validation {where} --table validation --markdown`):")
            print(markdown_validation(validation))
    if args.plot:
        print(f"\n# plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    from ringnet.errors import run_main
    run_main(main)
