"""python -m ringnet.bench comm: nccl-tests style all-reduce table for ring/tree/master/auto/native.

Each row's ``x native`` is the native MPI_Allreduce time over the algorithm's time (the
bus-bandwidth ratio: both move the same buffer); the ``native`` row is the bare mpi4py call
(the transport's allreduce_native for CuPy buffers or NCCL). The ``auto`` row also names
the algorithm that ran (``native`` where auto delegated to MPI's own call) and says PASS
or FAIL against its target: at least TARGET x native at every size; no verdict while the
machine is busy (:mod:`ringnet.bench.machine`: the load average at start and end, and why).
``direct``, ``rd`` and ``rhd`` rows force one of auto's algorithms (to measure its cost model). The ``floor`` row (not in
the default set) times the least a Python all-reduce from point-to-point messages can cost:
bare mpi4py, the algorithm auto uses for small messages (recursive doubling where N is a
power of two, direct otherwise) on persistent requests made for the benchmark's buffer,
with nothing else: no deadline, no byte counting, no checks; it waits as auto does
(MPI_Testall polls, then yielding the core between polls).
Where ``floor`` itself is below a target, that target is out of reach of any all-reduce
built from Python point-to-point calls on this MPI.
"""
import json
import os
import re
import time

import numpy as np
from mpi4py import MPI

from ringnet.backend import cupy, to_numpy
from ringnet.bench import machine, options, paired_quartiles
from ringnet.comm import COMMUNICATORS, create, make_transport
from ringnet.comm.cost import ALGORITHMS as AUTO_ALGORITHMS, fit, fit_native, thresholds
from ringnet.comm.schedules import eager_cuts
from ringnet.placement import lean_spins
from ringnet.config import transport_usage_error
from ringnet.errors import TransportUnavailable, UsageError
from ringnet.cli import ArgumentParser

__all__ = ["main", "parse_sizes", "bus_bandwidth", "repetitions", "target"]

ALGOS = ("ring", "native", "tree", "master", "auto")
FORCED = tuple(a for a in AUTO_ALGORITHMS if a != "ring")   # auto with its choice forced
EXTRA = FORCED + ("floor",)                                 # rows only on request
TARGET = 0.9          # auto's busbw over native's, at every size
# Small all-reduces are timed REPS_BYTES // size times back to back per sample (at most
# MAX_REPS), as nccl-tests loops: one barrier per call would dominate a 10 us operation.
REPS_BYTES, MAX_REPS = 256 << 10, 64
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text):
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise UsageError(f"bad size {text!r}: use bytes with an optional K/M/G suffix, e.g. 8,1K,16M")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text):
    """Parse '8,1K,16M' or 'MIN:MAX' (doubling) into a list of byte counts."""
    if ":" in text:
        low, high = (_parse_size(part) for part in text.split(":", 1))
        if low <= 0 or high < low:
            raise UsageError(f"bad size range {text!r}: need 0 < MIN <= MAX")
        sizes = []
        while low <= high:
            sizes.append(low)
            low *= 2
        return sizes
    return [_parse_size(part) for part in text.split(",") if part.strip()]


def bus_bandwidth(algbw, size):
    """Return all-reduce bus bandwidth: algbw * 2(N-1)/N (what each link carries)."""
    return algbw * 2 * (size - 1) / size


def repetitions(nbytes):
    """Calls per timed sample for a buffer of ``nbytes``."""
    return max(1, min(MAX_REPS, REPS_BYTES // max(nbytes, 1)))


def target(nbytes):
    """The auto row's goal for ``nbytes``: its busbw over native's must reach this."""
    return TARGET


def build_parser():
    parser = ArgumentParser(
        prog="python -m ringnet.bench comm",
        description="Time all-reduce of ring/tree/master/auto communicators and the library's "
                    "own all-reduce, interleaved per iteration; run under mpirun.")
    parser.add_argument("--algos", default=",".join(ALGOS),
                        help=f"comma list of {','.join(ALGOS)} (default: all), "
                             f"{','.join(FORCED)} (auto forced to that algorithm), or floor "
                             "(bare mpi4py exchange: the least a Python all-reduce costs)")
    parser.add_argument("--sizes", default="8,1K,64K,1M,4M,16M,64M",
                        help="comma list of byte sizes (K/M/G suffixes) or MIN:MAX doubling "
                             "(default 8,1K,64K,1M,4M,16M,64M)")
    parser.add_argument("--iters", type=int, default=10,
                        help="timed iterations per size, median reported (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed iterations per size (default 2)")
    options.add_dtype(parser, what="element type of the reduced buffers",
                      choices=("float16",) + options.DTYPES)
    options.add_transport(parser, "how bytes move, as train's --transport")
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="ring, tree, master: cut transfers into pieces of this many bytes "
                             "(pipelined; tree and master pick a size by default)")
    parser.add_argument("--fit", action="store_true",
                        help="also fit auto's cost model (alpha, beta, gamma) to the ring, direct, "
                             "rd and rhd rows and print the switch points it implies")
    options.add_json(parser, 'print {"rows": [...]} on rank 0')
    options.add_markdown(parser, "also print bus bandwidth per size")
    options.add_plot(parser, "rank 0 also draws bus bandwidth against size (.png; needs matplotlib)")
    return parser


class Floor:
    """Bare mpi4py all-reduce of NumPy buffers: the lower bound of auto's small-message path.

    Recursive doubling where N is a power of two, else every rank sends to every other and
    sums in rank order (auto's ``direct``); messages cut as auto cuts them around MPI's
    eager limit; persistent requests (MPI_Recv_init / MPI_Send_init) made for the buffer
    it is called with and started on every call with that array, as auto's short path
    does once an array comes back; waits by as many MPI_Testall polls as auto
    (``lean_spins``), then sched_yield between polls (a busy loop starves ranks that share
    a core); no deadline, counters or checks.
    """

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm.Dup()
        self.n, self.rank = self.mpi.Get_size(), self.mpi.Get_rank()
        self.algorithm = "rd" if self.n & (self.n - 1) == 0 else "direct"
        self.spins = range(lean_spins())
        self.scratch = {}
        self.hot = None         # the plan of the array called with last

    def _requests(self, buf, cuts, inbox, specs):
        """The persistent requests of one call on ``buf``: per rd step, or all at once."""
        n, r, mpi = self.n, self.rank, self.mpi
        sends = [[buf[a:b], MPI.BYTE] for a, b in cuts]
        if self.algorithm == "rd":
            steps, mask = [], 1
            while mask < n:
                peer = r ^ mask
                steps.append([mpi.Recv_init(x, peer, 0) for x in specs[0]]
                             + [mpi.Send_init(x, peer, 0) for x in sends])
                mask <<= 1
            return steps
        requests = []
        for k in range(1, n):
            requests += [mpi.Recv_init(x, (r - k) % n, 0) for x in specs[k - 1]]
            requests += [mpi.Send_init(x, (r + k) % n, 0) for x in sends]
        return [requests]

    @staticmethod
    def _free(plan):
        for requests in plan[3]:
            for request in requests:
                request.Free()

    def _plan(self, buf):
        """(dtype, cuts, inbox, persistent requests, buf) for ``buf``: made on its first call."""
        plan = self.scratch.get(buf.nbytes)
        if plan is None or plan[0] is not buf.dtype or plan[4] is not buf:
            n = self.n
            cuts = eager_cuts(buf.size, buf.itemsize)
            inbox = np.empty((n, buf.size), buf.dtype)     # n - 1 slots and a total
            specs = [[[inbox[k, a:b], MPI.BYTE] for a, b in cuts] for k in range(n - 1)]
            if plan is not None:
                self._free(plan)
            plan = self.scratch[buf.nbytes] = (buf.dtype, cuts, inbox,
                                               self._requests(buf, cuts, inbox, specs), buf)
        return plan

    def _wait(self, requests):
        testall = MPI.Request.Testall
        for _ in self.spins:
            if testall(requests):
                return
        while not testall(requests):
            os.sched_yield()

    def allreduce(self, buf):
        n, r = self.n, self.rank
        if n == 1:
            return
        plan = self.hot
        if plan is None or plan[4] is not buf:
            plan = self.hot = self._plan(buf)
        _, _, inbox, steps, _ = plan
        start = MPI.Prequest.Startall
        if self.algorithm == "rd":
            inc = inbox[0]
            for requests in steps:
                start(requests)
                self._wait(requests)
                np.add(buf, inc, buf)
            return
        start(steps[0])
        self._wait(steps[0])

        def part(rank):
            return buf if rank == r else inbox[(r - rank) % n - 1]
        total = buf if r <= 1 else inbox[n - 1]
        np.add(part(0), part(1), total)
        for rank in range(2, n):
            np.add(total, part(rank), total)
        if total is not buf:
            buf[...] = total

    def close(self):
        """Free the persistent requests and the duplicated communicator."""
        for plan in self.scratch.values():
            self._free(plan)
        self.scratch.clear()
        self.hot = None
        self.mpi.Free()


def _call(comms, transport, algo, buf):
    if algo == "native":
        if type(buf) is np.ndarray and transport.name == "mpi":
            transport.mpi_comm.Allreduce(MPI.IN_PLACE, buf)     # MPI's own, nothing of ours
        else:
            transport.allreduce_native(buf)
    else:
        comms[algo].allreduce(buf)


def _run_size(comms, transport, algos, xp, dtype, count, iters, warmup):
    """Time every algo on one buffer size; return {algo: (median_s, ok, samples_s)}, the
    samples being each timed iteration's slowest rank, in order (iteration i of every algo
    ran back to back, so they pair up).

    Each algo runs once on (rank + 1) and is checked against N(N+1)/2, before the timed
    samples and again after them (by then auto starts the persistent requests it bound to
    the buffer); timed samples run ``repetitions`` calls back to back on a zeroed buffer.
    """
    world = transport.mpi_comm
    n, rank = transport.size, transport.rank
    expected = n * (n + 1) / 2
    buf = xp.empty(count, dtype)
    reps = repetitions(count * dtype.itemsize)
    times = {algo: [] for algo in algos}
    ok = {}
    for algo in algos:
        buf.fill(rank + 1)
        _call(comms, transport, algo, buf)
        ok[algo] = bool((to_numpy(buf) == dtype.type(expected)).all())
    for it in range(warmup + iters):
        for algo in algos:  # interleaved: machine noise hits every algo alike
            buf.fill(0)
            if xp is not np:
                transport.finish()
            world.Barrier()
            start = time.perf_counter()
            for _ in range(reps):
                _call(comms, transport, algo, buf)
            elapsed = (time.perf_counter() - start) / reps
            if it >= warmup:
                times[algo].append(elapsed)
    for algo in algos:      # checked again after the timed calls (auto's bound requests)
        buf.fill(rank + 1)
        _call(comms, transport, algo, buf)
        ok[algo] = ok[algo] and bool((to_numpy(buf) == dtype.type(expected)).all())
    names = list(algos)
    # The slowest rank defines an iteration's time.
    local = np.array([times[a] for a in names], np.float64)
    slowest = np.empty_like(local)
    world.Allreduce(local, slowest, op=MPI.MAX)
    flags = np.array([ok[a] for a in names], np.int32)
    all_ok = np.empty_like(flags)
    world.Allreduce(flags, all_ok, op=MPI.MIN)
    return {a: (float(np.median(slowest[i])), bool(all_ok[i]), slowest[i].tolist(),
                getattr(comms.get(a), "last_algorithm", None))
            for i, a in enumerate(names)}


def check_ranks(argv):
    """The command on one rank (mpirun forgotten): after the flags and values are checked,
    one line saying how to start several. (``main`` itself runs on one rank in tests, with
    a scripted clock.)"""
    _checked(build_parser().parse_args(argv))
    if MPI.COMM_WORLD.Get_size() == 1:
        raise UsageError("bench comm times all-reduces between ranks and this run has one: "
                         "start it under MPI, e.g. mpirun -np 4 python -m ringnet.bench comm")


def _checked(args):
    """(algorithms, sizes) of the parsed ``args``; a UsageError for a bad value."""
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGOS + EXTRA]
    if unknown or not algos:
        raise UsageError(f"unknown algo(s) {unknown or args.algos!r}: choose from "
                         f"{', '.join(ALGOS + EXTRA)}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    sizes = parse_sizes(args.sizes)
    if not sizes:
        raise UsageError(f"--sizes names no size, got {args.sizes!r}")
    if args.chunk_bytes is not None and args.chunk_bytes < 1:
        raise UsageError(f"--chunk-bytes must be >= 1, got {args.chunk_bytes}")
    return algos, sizes


def main(argv=None):
    args = build_parser().parse_args(argv)
    algos, sizes = _checked(args)
    if args.plot:
        from ringnet.bench.plot import check_writable
        from ringnet.control import collective
        collective(MPI.COMM_WORLD, lambda: check_writable(args.plot)
                   if MPI.COMM_WORLD.Get_rank() == 0 else None)
    dtype = np.dtype(args.dtype)
    try:
        transport = make_transport(args.transport)
    except TransportUnavailable as exc:
        raise transport_usage_error(exc) from None
    xp = cupy if transport.uses_gpu() and transport.name == "nccl" else np
    chunks = {"chunk_bytes": args.chunk_bytes}
    comms = {a: create(a, transport=transport, **chunks) for a in algos if a in COMMUNICATORS}
    comms.update({a: create("auto", transport=transport, algorithm=a, **chunks)
                  for a in algos if a in FORCED})
    # the switch points printed below are those of an unforced auto (collective to make)
    chooser = comms.get("auto") or create("auto", transport=transport, **chunks)
    if "floor" in algos:
        if xp is not np:
            raise UsageError("the floor row times NumPy buffers over MPI: use --transport mpi")
        comms["floor"] = Floor(transport.mpi_comm)
    n, rows = transport.size, []
    run = machine.begin(out=False)
    if transport.rank == 0 and not args.json:
        print(f"# {run.header()}", flush=True)
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        results = _run_size(comms, transport, algos, xp, dtype, count, args.iters, args.warmup)
        native = results.get("native")
        for algo in algos:
            seconds, ok, samples, ran = results[algo]
            algbw = count * dtype.itemsize / seconds / 1e9
            row = {"algo": algo, "bytes": count * dtype.itemsize, "count": count,
                   "dtype": args.dtype, "time_us": seconds * 1e6, "algbw": algbw,
                   "busbw": bus_bandwidth(algbw, n), "ok": ok, "picked": None,
                   "vs_native": None, "vs_native_quartiles": None, "target": None,
                   "passed": None}
            if algo == "auto" or algo in FORCED:
                row["picked"] = ran         # what ran (every call of a size runs the same)
            if algo == "floor":
                row["picked"] = comms[algo].algorithm
            if native is not None and algo != "native":
                row["vs_native"] = native[0] / seconds
                # iteration by iteration: native's time over this algo's right beside it
                row["vs_native_quartiles"] = paired_quartiles(native[2], samples)
                if algo == "auto":
                    row["target"] = target(row["bytes"])
                    row["passed"] = row["vs_native"] >= row["target"]
            rows.append(row)
    load_line = run.end(out=False)
    if "floor" in comms:
        comms["floor"].close()
    model = _fit(rows, n) if args.fit else None
    if transport.rank == 0:
        if args.json:
            verdict = _verdict(rows, run)
            print(json.dumps({"rows": rows, "ranks": n, "transport": transport.name,
                              "oversubscribed": chooser.oversubscribed,
                              "alpha": chooser.alpha, "constants": chooser.constants,
                              "verdict": verdict, **run.facts(),
                              **({"fit": model} if model else {})}))
        else:
            _print_table(rows, n, transport.name, args, run, load_line)
            if model:
                print(f"# fit: alpha {model['alpha'] * 1e6:.2f} us, beta {model['beta'] * 1e9:.4f} "
                      f"ns/B, gamma {model['gamma'] * 1e9:.4f} ns/B"
                      + (f"; native: alpha {model['native_alpha'] * 1e6:.2f} us, beta "
                         f"{model['native_beta'] * 1e9:.4f} ns/B" if "native_alpha" in model else "")
                      + " -> switch points " + ", ".join(f"{_size(b)}: {a}" for b, a in model["switches"]))
            crowded = " (a node holds more ranks than cores: alpha %g us)" % (
                chooser.alpha * 1e6) if chooser.oversubscribed else ""
            print("# auto's switch points at N = %d%s: " % (n, crowded)
                  + ", ".join(f"{_size(b)}: {a}" for b, a in chooser.thresholds()))
            if args.markdown:
                from ringnet.bench.tables import comm_table
                print(comm_table(rows))
        if args.plot:
            from ringnet.bench.plot import plot_comm
            plot_comm(rows, args.plot, title=f"all-reduce, {n} ranks, {transport.name}, "
                                             f"{args.dtype}")
    return 0 if all(row["ok"] for row in rows) else 1


def _verdict(rows, run):
    """The auto rows' verdict against TARGET: PASS, FAIL at sizes, or why there is none
    (no auto or native row; the machine busy at start or end). None without auto rows."""
    judged = [r for r in rows if r["passed"] is not None]
    if not judged:
        return None
    failed = [_size(r["bytes"]) for r in judged if not r["passed"]]
    verdict = run.verdict(not failed)
    return verdict + (f" at {', '.join(failed)}" if verdict == "FAIL" else "")


def _print_table(rows, n, transport_name, args, run, load_line):
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"# all-reduce, {n} ranks, transport {transport_name}, dtype {args.dtype}, "
          f"median of {args.iters} (after {args.warmup} warm-up), slowest rank per iteration; "
          f"load average {load}")
    print(f"# target: auto's busbw over native's, ok (at least it) or below; ok: the result "
          f"equals the closed-form sum, checked before and after the timed calls")
    print(f"# {'bytes':>10} {'count':>10} {'dtype':>8} {'algo':>7} {'picked':>6} {'time_us':>11} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'x native':>8} {'target':>11} {'ok':>3}")
    for row in rows:
        ratio = "-" if row["vs_native"] is None else f"{row['vs_native']:.2f}"
        goal = "-" if row["target"] is None else \
            f"{'ok' if row['passed'] else 'below'} >={row['target']:.1f}"
        print(f"  {row['bytes']:>10} {row['count']:>10} {row['dtype']:>8} {row['algo']:>7} "
              f"{row['picked'] or '-':>6} {row['time_us']:>11.1f} {row['algbw']:>10.3f} "
              f"{row['busbw']:>10.3f} {ratio:>8} {goal:>11} {'yes' if row['ok'] else 'NO':>3}")
    for algo in dict.fromkeys(r["algo"] for r in rows):
        ratios = [(r["bytes"], r["vs_native"], r["vs_native_quartiles"]) for r in rows
                  if r["algo"] == algo and r["vs_native"] is not None]
        if ratios:
            print(f"# {algo} busbw / native busbw (iterations paired, quartiles): "
                  + ", ".join(f"{_size(b)} {x:.2f} ({q[0]:.2f}-{q[1]:.2f})" for b, x, q in ratios))
    ran = [(r["bytes"], r["picked"]) for r in rows if r["algo"] == "auto"]
    if ran:
        print("# auto ran: " + ", ".join(f"{_size(b)} {a}" for b, a in ran))
    print(f"# {load_line}")
    verdict = _verdict(rows, run)
    if verdict is not None:
        print(f"# auto target (>= {TARGET} x native at every size): {verdict}")


def _fit(rows, n):
    """Fit auto's alpha, beta, gamma to the rows of the algorithms it chooses from, and
    native's two constants to the native rows (where there are two sizes)."""
    samples = [(r["algo"], r["bytes"], n, r["time_us"] * 1e-6) for r in rows
               if r["algo"] in AUTO_ALGORITHMS]
    if n < 2 or len({s[0] for s in samples}) < 2 or len(samples) < 3:
        return None
    alpha, beta, gamma = fit(samples)
    model = {"alpha": alpha, "beta": beta, "gamma": gamma}
    natives = [(r["bytes"], n, r["time_us"] * 1e-6) for r in rows if r["algo"] == "native"]
    candidates = AUTO_ALGORITHMS
    if len({b for b, *_ in natives}) >= 2:
        model["native_alpha"], model["native_beta"] = fit_native(natives)
        candidates = None
    model["switches"] = thresholds(n, **({} if candidates is None else {"candidates": candidates}),
                                   **model)
    return model



def _size(nbytes):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
