"""Helpers shared by the test modules (plain functions: import them from ``conftest``)."""
import os
import subprocess
import sys

import numpy as np

from ringnet.backend import to_numpy

# Child processes run with one BLAS thread: the machine is shared by the MPI ranks.
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")


def rel_error(a, b):
    """Return max |a - b| / max |b| (b is the reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(b))))


def flat_params(strategy):
    """Return the newest complete weights of ``strategy`` as a float64 host copy."""
    return np.array(to_numpy(strategy.eval_model().params), dtype=np.float64)


def simulate_delay1(model, batches, optimizer, delayed=None):
    """Run the delayed-update recurrence in one process; return (weights, losses).

    ``params[:delayed]`` (default: all) follows the delayed update,
    ``c_{t+1} = upd(c_t, Gc_t(c_{t-1}, f_t))`` with ``c_{-1} = c_0``; the rest
    (split-fc's FC part) is updated at once, ``f_{t+1} = upd(f_t, Gf_t(c_{t-1}, f_t))``.
    ``optimizer`` is one element-wise SGD over the whole flat vector.
    """
    n = model.num_params if delayed is None else delayed
    c_prev = c_cur = model.params[:n].copy()
    rest = model.params[n:].copy()
    losses = []
    for t, (x, y) in enumerate(batches):
        model.params[:n] = c_prev
        model.params[n:] = rest
        losses.append(model.loss_and_grad(x, y)[0])
        w = np.concatenate([c_cur, rest])
        optimizer.step(w, model.grads.copy(), t)
        c_prev, c_cur, rest = c_cur, w[:n], w[n:]
    return np.concatenate([c_cur, rest]), losses


def run_cli(*args, np_=None, module="ringnet.train", timeout=240):
    """Run ``python -m module args`` (under ``mpirun -np np_`` if given); return the CompletedProcess."""
    cmd = [sys.executable, "-m", module, *args]
    if np_:
        cmd = ["mpirun", "-np", str(np_), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)


def assert_one_line_error(proc, *needles):
    """Assert exit 2 with exactly one stderr line ``ringnet: error: ...`` containing ``needles``."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringnet: error:"), lines[0]
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
