"""Profile ``local``: the calibration worker's timings under mpirun turned into links,
contention, the stream's rate and steal, and the waits for descheduled peers."""
import math
import os
import shlex
import shutil
import sys

import numpy as np

from ringnet.perfmodel.compute import ZERO_COMPUTE
from ringnet.perfmodel.exchange import master_time, tree_time
from ringnet.perfmodel.links import Link, tbf_burst_bytes
from ringnet.perfmodel.system import System, scheduling_wait, usable_cores
from ringnet.perfmodel.worker import LOADED_EXCHANGES
from ringnet.errors import UsageError
from ringnet.jobs import run_json

__all__ = ["calibrate", "calibration_record", "describe_contention"]


# The CFS period of hpc/cluster.sh's node quotas (--cpu-period's default), taken for
# calibrations whose worker did not record the period
QUOTA_PERIOD_S = 0.01


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


def _fit_shaped_link(n, sizes_s, add_s_per_elem):
    """Fit (alpha, beta) of ring RS+AG times over links shaped by a token bucket (tc tbf,
    ``hpc/cluster.sh --link``): a message up to the bucket's burst passes at the wire's
    speed, the rest at the shaped rate, so one straight line through every size (the
    relative fit of :func:`_fit_link`) takes the small messages' speed for the bandwidth
    (279 MB/s fitted on a 1 Gbit/s link, 125 MB/s). Here beta is the slope between the two
    largest sizes, where the rate decides, and alpha the smallest per-message time of the
    small sizes, which pass within the burst (their bytes at the wire's speed included:
    the least any message costs)."""
    timed = sorted(sizes_s)
    per_byte = 2 * (n - 1) / n

    def net(size, seconds):
        return max(seconds - (n - 1) * add_s_per_elem * size / 4 / n, 0.0)
    (s1, t1), (s2, t2) = timed[-2], timed[-1]
    slope = (net(s2, t2) - net(s1, t1)) / (per_byte * (s2 - s1))
    if slope <= 0:
        return _fit_link(n, sizes_s, add_s_per_elem)
    small = [net(s, t) / (2 * (n - 1)) for s, t in timed[:-2]]
    return (min(small) if small else 0.0), 1.0 / slope


def calibrate(nps, compute, mpirun="mpirun", iters=7, timeout=300, models=(), batch=64,
              scaling="weak", per_node=None):
    """Run the calibration worker at each N under mpirun; return the ``local`` calibration.

    ``models``' steps are timed at the per-rank batch (``batch``, or batch / N for strong
    scaling) with every rank busy. ``mpirun``: the launcher's command line (``srun
    --mpi=pmi2`` on a cluster); ``per_node``: the ranks placed that many to a node (None: as
    the launcher likes)."""
    from ringnet.cluster import launch_prefix, placed
    if shutil.which(shlex.split(mpirun)[0]) is None:
        raise UsageError(f"launcher {mpirun!r} not found; `pip install mpich` or pass --mpirun")
    by_np = {}
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    for n in nps:
        per_rank = max(1, batch // n) if scaling == "strong" else batch
        cmd = [*launch_prefix(mpirun, placed(n, per_node)), sys.executable, "-m", "ringnet.bench", "model",
               "--calibrate-worker", "--iters", str(iters), "--batch-size", str(per_rank),
               "--models", ",".join(models)]
        raw = run_json(cmd, f"calibration at N={n}", env=env, timeout=timeout)
        if per_node:
            raw["placement"] = {"per_node": per_node, "launcher": mpirun,
                                "shaped": shaped_links()}
        by_np[n] = calibration_record(n, raw, compute.add_s_per_elem)
    return {"by_np": by_np}


def _fit_rooted(mode, n, sizes_s, add_s_per_elem, burst=0.0):
    """Fit (alpha, beta) of tree or master reduce+broadcast times with the model's own formulas.

    ``burst``: the links are shaped by token buckets of that many bytes, which the worker's
    timings meet full (each follows a barrier that sleeps): the bytes on the critical path
    are counted as the model counts them there, less what the buckets pass at the wire's
    speed. At zero latency that count is the bytes' time at 1 B/s whatever the rate (the
    buckets refill by the rate times times that scale as its inverse), so the fit stays
    linear: messages times alpha plus those bytes over beta."""
    timing = tree_time if mode == "tree" else master_time

    def coefficient(alpha, beta, size):
        link = Link("fit", alpha, beta, burst_bytes=burst)
        system = System("fit", link, link, 1 << 30, ZERO_COMPUTE)
        return sum(timing(system, n, size, size // 4, after_idle=True))
    rows, rhs = [], []
    for size, seconds in sizes_s:
        a = coefficient(1.0, 1e30, size)                  # messages on the critical path
        b = coefficient(0.0, 1.0, size)                   # bytes on the critical path
        adds = (n - 1) * add_s_per_elem * size / 4
        rows.append([a, b])
        rhs.append(max(seconds - adds, 0.0))
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-12)


def _fit_cpu(n, cpu_by_size):
    """CPU time of a ring all-reduce (reduce-scatter + all-gather, 2(N-1) messages and
    2(N-1)/N of the buffer sent per rank) per size, fitted as per message + per byte sent:
    {"per_msg_s", "per_byte_s"}, neither negative; None without timings or at N = 1."""
    points = sorted((int(k), float(v)) for k, v in (cpu_by_size or {}).items())
    if n < 2 or not points:
        return None
    msgs = 2 * (n - 1)
    rows = np.array([[msgs, 2 * (n - 1) / n * size] for size, _ in points], float)
    cpu = np.array([max(0.0, v) for _, v in points])
    (per_msg, per_byte), *_ = np.linalg.lstsq(rows, cpu, rcond=None)
    if per_msg < 0 or len(points) == 1:         # through the origin: bytes alone
        per_msg, per_byte = 0.0, float(rows[:, 1] @ cpu / (rows[:, 1] @ rows[:, 1]))
    if per_byte < 0:                            # a constant per message
        per_msg, per_byte = float(cpu.mean() / msgs), 0.0
    return {"per_msg_s": float(per_msg), "per_byte_s": float(per_byte)}


def calibration_record(n, raw, add_s_per_elem):
    """Turn one worker's timings into link, contention, the stream's rate and steal, and
    the CPU time transfers cost (per message and per byte sent)."""
    blocking = sorted((int(k), v) for k, v in raw["blocking"].items())
    shaped = raw.get("placement", {}).get("shaped")
    fit = _fit_shaped_link if shaped else _fit_link
    burst = tbf_burst_bytes(shaped) if shaped else 0.0
    alpha, beta = fit(n, blocking, add_s_per_elem) if n > 1 else (0.0, 1e30)
    together = raw["together_s"]
    rates, steals = _stream_rates(dict(blocking), raw["streamed"], together)
    # the tree's and master's reduce + broadcast beside the same compute, against their own
    # blocking times (older records: none, and the ring's rate stands for them)
    rooted_rate = {}
    for mode, sizes in (raw.get("streamed_rooted") or {}).items():
        alone = {int(k): v for k, v in (raw.get("rooted") or {}).get(mode, {}).items()}
        got, _ = _stream_rates(alone, sizes, together)
        if got:
            rooted_rate[mode] = float(np.mean(got))
    rooted = {mode: dict(zip(("alpha_s", "beta_Bps"),
                             _fit_rooted(mode, n, sorted((int(k), v) for k, v in sizes.items()),
                                         add_s_per_elem, burst)))
              for mode, sizes in raw.get("rooted", {}).items() if n > 1}
    slowdown = together / raw["solo_s"]
    # N busy ranks share at most the cores they may run on: ranks timed as a mean over
    # ranks that start and end apart (one finishing early frees a core for the rest) can
    # look as if they had more; a training step waits for its slowest rank
    # (placed so many to a node on a cluster: the nodes' cores together)
    per_node = (raw.get("placement") or {}).get("per_node")
    physical = (raw.get("cores") or math.inf) * (-(-n // per_node) if per_node else 1)
    if "cores" in raw:      # all ranks busy against one alone, waits that sleep: what N share
        cores = min(n / max(slowdown, 1e-9), physical)
    else:                   # older workers waited spinning (overstated), and named no cores
        cores = usable_cores()
    # each model's own step at its per-rank batch, every rank at once against one alone
    model_cores = {name: min(n / max(v["together_s"] / v["solo_s"], 1e-9), physical)
                   for name, v in raw.get("models", {}).items() if v.get("solo_s")}
    slice_s, msg_slice_s = _wait_slices(n, raw.get("cores") and physical, raw.get("waits"))
    # a node held to a CFS quota under a core (hpc/cluster.sh --cpus-per-node 0.5), and its
    # period (records before the worker read it: hpc/cluster.sh's default)
    held = (raw.get("quota") or 1) < 1
    return {"alpha_s": alpha, "beta_Bps": beta, "rooted": rooted, "cores": cores,
            "cores_total": None if physical == math.inf else physical,
            "quota": raw["quota"] if held else None,
            "quota_period_s": (raw.get("quota_period_s") or QUOTA_PERIOD_S) if held else None,
            "slowdown": slowdown, "model_cores": model_cores,
            # each model's slowest rank per step against the mean (older records: none)
            "imbalance": {name: max(1.0, float(v["imbalance"]))
                          for name, v in raw.get("models", {}).items() if "imbalance" in v},
            "slice_s": slice_s, "msg_slice_s": msg_slice_s,
            "rate": float(np.mean(rates)) if rates else 1.0,
            "rooted_rate": rooted_rate or None,
            "steal": float(np.mean(steals)) if steals else 0.0,
            # the CPU a transfer costs its rank's process: on the training thread's blocking
            # waits, and on the stream's thread beside compute (older records: none)
            "cpu_blocking": _fit_cpu(n, raw.get("blocking_cpu")),
            "cpu_stream": _fit_cpu(n, raw.get("streamed_cpu")),
            "delayed_rate": _delayed_rates(n, raw),
            # what a wait's sleeping poll costs, and the machines the nodes ran on (older
            # records: none)
            "polls": raw.get("polls"), "hosts": raw.get("hosts"), "raw": raw}


def _stream_rates(alone, streamed, together):
    """The rates and steals of the exchanges timed on the stream beside the work unit
    (``streamed``: {size: (span, work)}) against the same exchanges alone (``alone``:
    {size: seconds}): the part of it not left for after the work (its tail, at blocking
    speed) moved during their overlap; the work's excess over ``together`` (every rank
    busy, no exchange) is what the stream took from it."""
    rates, steals = [], []
    for size, (span, work) in sorted((int(k), v) for k, v in streamed.items()):
        own = alone.get(size)
        overlap = min(span, work)
        if not own or overlap <= 0:
            continue
        tail = max(0.0, span - work)            # ran after the compute, at blocking speed
        rates.append(min(1.0, max(1e-3, (own - min(tail, own)) / overlap)))
        steals.append(min(0.9, max(0.0, (work - together) / overlap)))
    return rates, steals


def _delayed_rates(n, raw):
    """Per model, the rate (a fraction of its blocking speed) at which the delayed exchange
    moved beside one step of the model, from the worker's ``delayed`` loop: a step of
    compute ``C`` (the model's step with every rank busy, ``together_s``) beside an
    exchange that alone takes ``E`` took ``T``; the exchange moved ``r C`` of itself during
    the compute and the rest at its blocking speed after it, so ``T = C + E - r C`` and
    ``r = (C + E - T) / C``, within [0.01, 1]. An exchange hidden whole beside the step
    gives E / C, the least rate that hides it, which prices that step alike; a loop no
    longer than the step says nothing of r, and that model gets none. None at N = 1 and in
    older records."""
    if n < 2 or not raw.get("delayed"):
        return None
    rates = {}
    for name, v in raw["delayed"].items():
        step = (raw.get("models") or {}).get(name, {}).get("together_s")
        alone, loop = v.get("alone_s"), v.get("loop_s")
        if not step or not alone or not loop or loop <= step:
            continue
        rates[name] = min(1.0, max(0.01, (step + alone - loop) / step))
    return rates or None


def shaped_links(environ=None):
    """The rate the cluster's links are shaped to (``hpc/cluster.sh``'s ``cluster`` file
    beside ``$SLURM_CONF`` or ``$HYDRA_HOST_FILE``: ``rate=1gbit``), or None: unshaped, or
    no cluster."""
    from ringnet.cluster import cluster_files
    for path in cluster_files("cluster", environ):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("rate="):
                        return line.strip().partition("=")[2] or None
        except OSError:
            continue
    return None


def describe_contention(n, record):
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
