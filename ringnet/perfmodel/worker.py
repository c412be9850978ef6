"""The calibration worker, run under mpirun (``python -m ringnet.bench model --calibrate-worker``):
time the ring communicator blocking and on its stream beside compute, one JSON line on rank 0."""
import json
import math
import os
import time

import numpy as np

from ringnet.perfmodel.compute import median_time
from ringnet.perfmodel.system import usable_cores
from ringnet.models import build_model

__all__ = ["calibrate_worker", "CALIBRATION_SIZES", "STREAM_SIZES", "LOADED_EXCHANGES",
           "DIRECT_SAMPLES", "STEPS_TIMED_S", "QUOTA_STEPS_TIMED_S", "steps_timed_s"]

CALIBRATION_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)
STREAM_SIZES = (512 << 10, 2 << 20)


def calibrate_worker(iters, models=(), batch=0):
    """Under mpirun: time the ring communicator blocking and on its stream beside compute.

    Prints one JSON line on rank 0: the cores and the CFS quota (``quota``, cores, or None,
    and its period ``quota_period_s``) of rank 0's node, the compute work unit alone and
    with every rank busy, each of ``models``' training step (forward, loss, backward) at
    the per-rank ``batch`` alone and on every rank at once, blocking reduce-scatter+all-gather per size (and the
    CPU time each rank's process spent in it), per stream size the exchange's own duration,
    the work unit's time while it ran and the stream thread's CPU time (and the first two
    for the tree's and the master's reduce + broadcast, ``streamed_rooted``), and a
    small exchange (1 and 4 ring all-reduces of 4 KiB on the stream, waited for as
    training waits) entered idle and entered right after the work unit, and per model the
    delayed step as training runs it (its gradient's all-reduce on the stream beside one
    step, then waited for) against that all-reduce alone; what a wait's sleeping poll
    costs (``polls``, :func:`sleeping_polls`) and the machines the ranks ran on
    (``hosts``, :func:`host_share`).
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

    from ringnet.placement import cpu_period_s, cpu_quota
    quota, period = cpu_quota(), cpu_period_s()
    polls = sleeping_polls(transport, mean_over_ranks)
    hosts = host_share(world)
    work()
    solo, together = [], []
    for _ in range(iters):
        idle_barrier()
        if rank == 0:
            solo.append(median_time(work, 1))
        idle_barrier()
        together.append(slowest(median_time(work, 1)))
    # each model's own step at its per-rank batch: one rank alone (the others sleep), then
    # every rank at once (training's compute time is the mean over ranks)
    steps, nets = {}, {}
    for name in models:
        net = build_model(name, seed=rank)
        xb = rng.normal(size=(batch,) + net.input_shape).astype(net.dtype)
        yb = rng.integers(0, net.num_classes, size=batch)

        net.loss_and_grad(xb, yb)
        # steps back to back for at least STEPS_TIMED_S: several scheduler slices, so ranks
        # that share a core share it as in training (one short step may run unshared); on a
        # node held to a quota, many of its periods (QUOTA_STEPS_TIMED_S)
        calls = world.bcast(max(1, math.ceil(steps_timed_s(quota) / median_time(
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
        nets[name] = (net, xb, yb, calls)
        steps[name] = {"batch": batch, "calls": calls,
                       "solo_s": float(np.median(alone)) if rank == 0 else 0.0,
                       "together_s": float(np.median(all_ranks)),
                       "imbalance": float(np.median(imbalance))}
    def timed(exchange, buf, cpu=False):
        """Median (over iters) of the slowest rank's time of ``exchange(buf)``, entered
        together; with ``cpu``, also the CPU time the rank's thread spent in it (median over
        iters of the mean over ranks), else None: the exchange blocks the calling thread, as
        split-fc's collectives block the training thread, whose waits train times the same
        way (``time.thread_time``). The process's CPU clock would add whatever else the
        process runs meanwhile, and Linux counts a thread busy on another CPU only at its
        scheduler ticks: a 25 us exchange read 4 ms beside such a thread."""
        samples, spent = [], []
        for _ in range(iters):
            idle_barrier()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            exchange(buf)
            t1 = time.perf_counter()
            spent.append(time.thread_time() - c0)
            samples.append(slowest(t1 - t0))
        return (float(np.median(samples)),
                float(np.median([mean_over_ranks(c) for c in spent])) if cpu else None)

    def sizes_timed(exchange, cpu=None):
        """:func:`timed` per size; ``cpu`` (a dict): also the CPU time, per size."""
        times = {}
        for size in CALIBRATION_SIZES:
            times[size], spent = timed(exchange, np.ones(size // 4, np.float32), cpu is not None)
            if cpu is not None:
                cpu[size] = spent
        return times

    def ring_allreduce(buf):
        ring.reduce_scatter(buf)
        ring.allgather(buf)

    def rooted_allreduce(comm):
        def run(buf):
            comm.reduce(buf, root=0)
            comm.bcast(buf, root=0)
        return run

    blocking_cpu = {}
    blocking = sizes_timed(ring_allreduce, blocking_cpu)
    # the tree's and master's reduce + broadcast: their messages are fewer and larger
    by_mode = {mode: sizes_timed(rooted_allreduce(comm)) for mode, comm in rooted.items()}
    stream = ring.new_stream()
    try:                                 # progress at layer boundaries, as the strategies do
        from ringnet.comm.stream import progress_all
    except ImportError:
        progress_all = None

    def progressed(net):
        """Progress the streams after each of ``net``'s layers, as the strategies do."""
        if progress_all is not None and hasattr(net, "layer_hook"):
            net.layer_hook = lambda phase, index: progress_all()
    progressed(model)

    def beside_work(allreduce):
        """Per size of STREAM_SIZES, ``allreduce`` on the stream beside the work unit:
        ({size: (span, work)}, {size: the stream thread's CPU}), medians over iters."""
        spans_by, cpu_by = {}, {}
        for size in STREAM_SIZES:
            buf = np.ones(size // 4, np.float32)
            spans, works, cpus = [], [], []

            def exchange(out):
                t0 = time.perf_counter()
                allreduce(buf)
                out.append(time.perf_counter() - t0)
            for _ in range(iters):
                idle_barrier()
                got = []
                c0, own0 = time.process_time(), time.thread_time()
                t0 = time.perf_counter()
                handle = stream.submit(exchange, got)
                work()
                t_work = time.perf_counter() - t0
                handle.wait()
                # the stream thread's CPU: the process's less this (training) thread's
                cpus.append((time.process_time() - c0) - (time.thread_time() - own0))
                spans.append(slowest(got[0]))
                works.append(slowest(t_work))
            spans_by[size] = (float(np.median(spans)), float(np.median(works)))
            cpu_by[size] = float(np.median([mean_over_ranks(c) for c in cpus]))
        return spans_by, cpu_by
    streamed, streamed_cpu = beside_work(ring_allreduce)
    # the tree's and master's reduce + broadcast beside the same work: their hops forward
    # other pieces than the ring's (the master's none), so they wait otherwise for a CPU
    streamed_rooted = {mode: beside_work(rooted_allreduce(comm))[0]
                       for mode, comm in rooted.items()}
    # the delayed step as training runs it: each model's gradient exchanged on the stream
    # beside one step of the model at its per-rank batch, then waited for, step after step
    # (``loop_s``, the ranks' mean), against that exchange alone, blocking (``alone_s``). On a
    # node held to a quota the exchange moves at another rate beside one such step than
    # beside compute back to back (the streamed sizes above): the calibration's
    # ``delayed_rate`` (:func:`~ringnet.perfmodel.calibration.calibration_record`)
    delayed = {}
    for name, (net, xb, yb, count) in nets.items():
        progressed(net)
        grad = np.ones(net.num_params, np.float32)
        alone, _ = timed(ring_allreduce, grad)
        idle_barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            handle = stream.submit(ring_allreduce, grad)
            net.loss_and_grad(xb, yb)
            handle.wait()
        delayed[name] = {"bytes": int(grad.nbytes), "calls": count,
                         "alone_s": alone,
                         "loop_s": mean_over_ranks((time.perf_counter() - t0) / count)}
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
        print(json.dumps({"np": n, "cores": usable_cores(), "quota": quota,
                          "quota_period_s": period, "polls": polls, "hosts": hosts,
                          "solo_s": float(np.median(solo)),
                          "together_s": float(np.median(together)),
                          "blocking": blocking, "streamed": streamed,
                          "streamed_rooted": streamed_rooted,
                          "blocking_cpu": blocking_cpu, "streamed_cpu": streamed_cpu,
                          "rooted": by_mode, "models": steps, "delayed": delayed,
                          "waits": {k: float(np.median(v)) for k, v in waits.items()}}),
              flush=True)
    return 0


# sleeping polls timed in a row (their pauses ramped as a wait's are: about 8 ms in all)
POLLS_TIMED = 40


def sleeping_polls(transport, mean_over_ranks):
    """What one sleeping poll of the training thread's wait costs (past its spin, on a peer
    held up): {"cpu_s": its CPU, "extra_s": its wall time beyond the pause it asked for},
    means over :data:`POLLS_TIMED` polls ramped as the wait ramps them, and over the ranks.
    The polls look at a receive nothing matches, as a wait on a held peer does."""
    from mpi4py import MPI
    from ringnet.comm.mpi_transport import MAX_PAUSE_S
    buf = np.empty(1, np.float32)
    requests = [MPI.COMM_SELF.Irecv(buf, source=0, tag=31)]
    pause = asked = 0.0
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(POLLS_TIMED):
        transport._test(requests)
        pause = transport._sleep_poll(pause, MAX_PAUSE_S, True)
        asked += pause
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    requests[0].Cancel()
    requests[0].Wait()
    return {"cpu_s": mean_over_ranks(cpu / POLLS_TIMED),
            "extra_s": mean_over_ranks((wall - asked) / POLLS_TIMED)}


def host_share(world):
    """{"hosts": the machines the ranks run on (by their kernels' boot ids: nodes that a
    cluster emulates on one machine share one), "cpus": rank 0's machine's CPUs}."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    boots = world.allgather(boot)
    hosts = len(set(boots)) if None not in boots else world.Get_size()
    return {"hosts": hosts, "cpus": os.cpu_count()}


# exchanges in a row of the calibration's wait measurement (two counts: per wait, per message)
LOADED_EXCHANGES = (1, 4)
# the contention and the waits go into every step's prediction as measured (no fit smooths
# them): they take this many times --iters samples, a median that one slow moment moves less
DIRECT_SAMPLES = 2
# a model's steps are timed back to back for at least this long (a few scheduler slices)
STEPS_TIMED_S = 0.03
# ... and on a node held to a CFS quota under a core, at least this long: a step timed
# alone right after an idle wait starts with its period's budget unspent, and one started
# on every node at once meets the others' at the same moment of their periods; steps back
# to back over many periods run at the rate the quota allows, as training's do
QUOTA_STEPS_TIMED_S = 0.25


def steps_timed_s(quota):
    """How long a model's steps are timed back to back: :data:`STEPS_TIMED_S`, or
    :data:`QUOTA_STEPS_TIMED_S` where a CFS quota under a core (``quota``, cores) holds the
    rank's node."""
    return QUOTA_STEPS_TIMED_S if quota is not None and quota < 1 else STEPS_TIMED_S
