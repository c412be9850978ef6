"""Compute profiles: per-layer times ``a + b * batch``, update and add costs, and their JSON form."""
import dataclasses
import json
import time

import numpy as np

from ringnet.errors import UsageError

__all__ = ["ComputeProfile", "TRAINING_STEPS", "ISOLATED_LAYERS", "profile_method",
           "compute_from_json", "load_compute"]


@dataclasses.dataclass
class ComputeProfile:
    """Per-layer times ``a + b * batch`` (seconds) per model, update and add costs.

    ``layers[model]`` is ``[(layer name, (fwd_a, fwd_b), (bwd_a, bwd_b))]``;
    ``overhead[model]`` is the rest of a training step (loss, Python) as ``(a, b)``.
    ``method``: for a profile measured here, :data:`TRAINING_STEPS` or
    :data:`ISOLATED_LAYERS` (empty for stated GPU profiles and files without it);
    ``steps_ms``: the median training step each batch's layers were timed in;
    ``compute_cpu_ms``: the median CPU time of those steps' training thread in their
    forward and backward (the ``compute`` span), the work a run's own ``compute_cpu_s``
    counts: a run that took more CPU time for the same work ran on a slower machine.
    ``quota``: the cores the CFS quota of the control group it was measured in granted,
    where that was under one (:func:`ringnet.placement.cpu_quota`): its times are those of
    a thread held to that share of a core (:meth:`full_speed`); 1.0 where none held it to
    less than a core; None for stated profiles and those measured before profiles said.
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
    quota: float = None              # measured under a CFS quota of this many cores
    compute_cpu_ms: dict = dataclasses.field(default_factory=dict)  # model -> {batch: ms}

    def scaled(self, factor):
        """The same profile with every time multiplied by ``factor``."""
        return dataclasses.replace(
            self, layers={m: [(n, (fa * factor, fb * factor), (ba * factor, bb * factor))
                              for n, (fa, fb), (ba, bb) in rows] for m, rows in self.layers.items()},
            overhead={m: (a * factor, b * factor) for m, (a, b) in self.overhead.items()},
            update_s_per_param=self.update_s_per_param * factor,
            update_s_per_call=self.update_s_per_call * factor,
            add_s_per_elem=self.add_s_per_elem * factor, add_s_per_call=self.add_s_per_call * factor)

    def full_speed(self, quota=None):
        """The profile of a thread with a core of its own: a profile measured busy under a
        quota of q < 1 cores ran q of the time, so its CPU time is q times its wall time.
        ``quota``: the one to assume where the profile names none (a profile measured
        without a quota names 1.0 and is returned as it is)."""
        q = self.quota if self.quota is not None else quota
        if q is None or q >= 1:
            return self
        return dataclasses.replace(self.scaled(q), quota=None)

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
                **({"quota": self.quota} if self.quota is not None else {}),
                **({"compute_cpu_ms": {m: {str(b): v for b, v in d.items()}
                                       for m, d in self.compute_cpu_ms.items()}}
                   if self.compute_cpu_ms else {}),
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


ZERO_COMPUTE = ComputeProfile("zero", "cpu", {}, {}, 0.0, 0.0, 0.0, 0.0, "no compute (link fits)")


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
                           for m, d in data.get("steps_ms", {}).items()},
                          data.get("quota"),
                          {m: {int(b): v for b, v in d.items()}
                           for m, d in data.get("compute_cpu_ms", {}).items()})


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


def fit_batch_times(batches, times):
    """Least-squares (a, b) of t = a + b * batch, with a >= 0 and b >= 0."""
    slope, icept = np.polyfit(np.asarray(batches, float), np.asarray(times, float), 1)
    if slope < 0:
        return float(np.mean(times)), 0.0
    if icept < 0:
        return 0.0, float(np.dot(batches, times) / np.dot(batches, batches))
    return float(icept), float(slope)


def median_time(fn, iters):
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))
