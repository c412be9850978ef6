"""Helpers shared by the test modules (plain functions: import them from ``conftest``)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from ringnet.backend import to_numpy

# Child processes run with one BLAS thread: the machine is shared by the MPI ranks.
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")

LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_", "HYDRA_", "OMPI_")


def launcher_free_env(*also):
    """``os.environ`` without the MPI launcher's variables (and those starting with any of
    ``also``): a nested ``mpirun`` from a test that may itself be an MPI singleton."""
    drop = LAUNCHER_PREFIXES + also
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def rel_error(a, b):
    """Return max |a - b| / max |b| (b is the reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(1e-30, np.max(np.abs(b))))


def flat_params(strategy):
    """Return the newest complete weights of ``strategy`` as a float64 host copy."""
    return np.array(to_numpy(strategy.eval_model().params), dtype=np.float64)


# The delay compensation ``lookahead``'s constants at momentum 0.9 (every delay-1 test
# here uses 0.9), written here, not read from ringnet: k = A (4A + 2 (1 - mu)) / (A + 1 - mu),
# A = 2 (1 + mu) = 3.8, i.e. 58.52 / 3.9.
LOOKAHEAD = (15.005128205128205, 2.0)      # (k, c)


def simulate_delay1(model, batches, optimizer, delayed=None, lookahead=None, warmup=0):
    """Run the delayed-update recurrence in one process; return (weights, losses).

    ``params[:delayed]`` (default: all) follows the delayed update,
    ``c_{t+1} = upd(c_t, Gc_t(p_t, f_t))`` with ``p_t = c_{t-1}`` and ``c_{-1} = c_0``;
    the rest (split-fc's FC part) is updated at once, ``f_{t+1} = upd(f_t, Gf_t(p_t, f_t))``.
    ``optimizer`` is one element-wise SGD over the whole flat vector.

    ``lookahead = (k, c)``: the compensation, written out: the delayed part computes at
    ``p_t = c_{t-1} + c (c_{t-1} - c_{t-2})`` and is updated with momentum
    ``1 - (1 - mu)/k`` and lr ``lr/k``: ``v <- mu' v + lr' (g + wd w)``, ``w <- w - v``.
    ``warmup`` W (with ``lookahead``): steps t < W are synchronous with mu and lr (the
    delayed part computes at ``c_t``), step W computes at ``c_W`` too, and the compensated
    recurrence continues from the momentum the warm-up left, the delayed part's divided by
    k (what it still carries the weights kept, ringnet.parallel.delayed_update).
    """
    n = model.num_params if delayed is None else delayed
    c_prev2 = c_prev = c_cur = model.params[:n].copy()
    rest = model.params[n:].copy()
    k, c = lookahead if lookahead is not None else (1.0, 0.0)
    mu = np.full(model.num_params, optimizer.momentum)
    mu[:n] = 1 - (1 - optimizer.momentum) / k
    scale = np.ones(model.num_params)
    scale[:n] = 1 / k
    v = np.zeros(model.num_params)
    losses = []
    for t, (x, y) in enumerate(batches):
        synchronous = lookahead is not None and t <= warmup
        model.params[:n] = c_cur if synchronous else c_prev + c * (c_prev - c_prev2)
        model.params[n:] = rest
        losses.append(model.loss_and_grad(x, y)[0])
        w = np.concatenate([c_cur, rest])
        if lookahead is None:
            optimizer.step(w, model.grads.copy(), t)
        else:
            m, s = (optimizer.momentum, 1.0) if t < warmup else (mu, scale)
            if t == warmup > 0:     # the switch: the delayed part's momentum times 1/k
                v[:n] *= (1 - mu[:n]) / (1 - optimizer.momentum)
            v = m * v + s * optimizer.lr_policy(t) * (model.grads + optimizer.weight_decay * w)
            w = w - v
        c_prev2, c_prev, c_cur, rest = c_prev, c_cur, w[:n], w[n:]
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


# -- the suite's own output (tests/run.sh) ------------------------------------------------

def _world():
    """(rank, size) of this pytest process: 0, 1 outside mpirun."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.hookimpl(hookwrapper=True)
def pytest_terminal_summary(terminalreporter):
    """One line of MPI facts on rank 0 instead of pytest-mpi's 20-line section on every rank."""
    if terminalreporter.config.getoption("--with-mpi", default=False):
        for plugin in terminalreporter.config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "MPIPlugin":
                plugin._is_testing_mpi = False      # the flag that prints its section
        rank, size = _world()
        if rank == 0 and size > 1:
            from mpi4py import MPI
            vendor, version = MPI.get_vendor()
            terminalreporter.write_line(f"MPI: {vendor} {'.'.join(map(str, version))}, "
                                        f"{size} ranks")
    yield


_WORKER = []
_SHORT_BASETEMP = []


@pytest.hookimpl(tryfirst=True)        # before pytest's tmp_path factory reads --basetemp
def pytest_configure(config):
    # a pytest-xdist worker has ``workerinput``; its environment's PYTEST_XDIST_WORKER would
    # also reach the pytest a test runs in a child process
    _WORKER[:] = [hasattr(config, "workerinput")]
    if not _WORKER[0] and not config.option.basetemp:
        # a short one: the clusters of tests/hpc keep their state in a test's tmp_path, and
        # SLURM's sockets there must fit a Unix socket's 107 bytes (hpc/cluster.sh refuses
        # a longer folder); pytest's default (/tmp/pytest-of-USER/pytest-N/, and xdist's
        # popen-gwN/ under it) leaves no room. The workers take folders under this one.
        import tempfile
        config.option.basetemp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        _SHORT_BASETEMP.append(config.option.basetemp)


def pytest_unconfigure(config):
    import shutil
    for path in _SHORT_BASETEMP:
        shutil.rmtree(path, ignore_errors=True)


def _xdist_worker():
    """Whether this process is one of pytest-xdist's workers (tests/run.sh's serial stage
    runs its tests on two): the controller reports, sums up and checks for them."""
    return bool(_WORKER and _WORKER[0])


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:             # without pytest-xdist the tests run in one process
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class _ClusterTogether(LoadScopeScheduling):
        """pytest-xdist's load balancing, one test at a time, except that the tests of
        tests/hpc go to one worker, one after another: they start, use and stop the
        emulated clusters and SLURM of this machine. (xdist's own ``--dist loadgroup``
        marks a group in the test id, which pytest 9 keeps elsewhere.)"""

        def _split_scope(self, nodeid):
            return "tests/hpc" if nodeid.startswith("tests/hpc/") else nodeid

    def pytest_xdist_make_scheduler(config, log):
        return _ClusterTogether(config, log)


def pytest_runtest_logreport(report):
    """With $RINGNET_TEST_SKIPS, rank 0 appends "<ranks> <test id>" of every skipped test to
    that file: CI reruns exactly those once it has installed what lets more of them run."""
    path = os.environ.get("RINGNET_TEST_SKIPS")
    if path and report.skipped and report.when in ("setup", "call") and not _xdist_worker():
        rank, size = _world()
        if rank == 0:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{size} {report.nodeid}\n")


def _stray_candidates():
    import glob
    import tempfile
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "ringnet-*")))


def pytest_sessionstart(session):
    session.config._ringnet_tmp_before = _stray_candidates()


def pytest_sessionfinish(session, exitstatus):
    """A one-process run fails when it left ``ringnet-*`` files or folders in the temporary
    folder (tests write under pytest's tmp_path, which pytest cleans)."""
    if (_world()[1] != 1 or _xdist_worker()
            or not hasattr(session.config, "_ringnet_tmp_before")):
        return
    left = sorted(_stray_candidates() - session.config._ringnet_tmp_before)
    if left:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"tests left {len(left)} file(s) in the temporary folder: {', '.join(left[:5])}",
            red=True)
        session.exitstatus = 1
