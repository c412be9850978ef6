"""python -m ringnet.bench comm: nccl-tests style all-reduce table for ring/tree/master/native."""
import argparse
import json
import re
import time

import numpy as np
from mpi4py import MPI

from ringnet.backend import cupy, to_numpy
from ringnet.comm import COMMUNICATORS, create, make_transport
from ringnet.errors import UsageError

__all__ = ["main", "parse_sizes", "bus_bandwidth"]

ALGOS = ("ring", "native", "tree", "master")
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


def _parser():
    parser = argparse.ArgumentParser(
        prog="python -m ringnet.bench comm",
        description="Time all-reduce of ring/tree/master communicators and the library's "
                    "own all-reduce, interleaved per iteration; run under mpirun.")
    parser.add_argument("--algos", default=",".join(ALGOS),
                        help="comma list of ring,native,tree,master (default: all)")
    parser.add_argument("--sizes", default="8,1K,64K,1M,4M,16M,64M",
                        help="comma list of byte sizes (K/M/G suffixes) or MIN:MAX doubling")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per size")
    parser.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    parser.add_argument("--transport", default="auto", choices=("auto", "mpi", "nccl"))
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="ring: cut each step into chunks of this many bytes (pipelined)")
    parser.add_argument("--json", action="store_true", help='print {"rows": [...]} on rank 0')
    parser.add_argument("--markdown", action="store_true",
                        help="also print bus bandwidth per size as a Markdown table (the README's)")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="rank 0 also draws bus bandwidth against size (.png; needs matplotlib)")
    return parser


def _run_size(comms, transport, algos, xp, dtype, count, iters, warmup):
    """Time every algo on one buffer size; return {algo: (median_s, ok)}."""
    world = transport.mpi_comm
    n, rank = transport.size, transport.rank
    expected = n * (n + 1) / 2
    buf = xp.empty(count, dtype)
    times = {algo: [] for algo in algos}
    ok = {algo: True for algo in algos}
    for it in range(warmup + iters):
        for algo in algos:  # interleaved: machine noise hits every algo alike
            buf.fill(rank + 1)
            if xp is not np:
                transport.finish()
            world.Barrier()
            start = time.perf_counter()
            if algo == "native":
                transport.allreduce_native(buf)
            else:
                comms[algo].allreduce(buf)
            elapsed = time.perf_counter() - start
            if it >= warmup:
                times[algo].append(elapsed)
            ok[algo] &= bool((to_numpy(buf) == dtype.type(expected)).all())
    names = list(algos)
    # The slowest rank defines an iteration's time.
    local = np.array([times[a] for a in names], np.float64)
    slowest = np.empty_like(local)
    world.Allreduce(local, slowest, op=MPI.MAX)
    flags = np.array([ok[a] for a in names], np.int32)
    all_ok = np.empty_like(flags)
    world.Allreduce(flags, all_ok, op=MPI.MIN)
    return {a: (float(np.median(slowest[i])), bool(all_ok[i])) for i, a in enumerate(names)}


def main(argv=None):
    args = _parser().parse_args(argv)
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    unknown = [a for a in algos if a not in ALGOS]
    if unknown or not algos:
        raise UsageError(f"unknown algo(s) {unknown or args.algos!r}: choose from {', '.join(ALGOS)}")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be >= 1 and --warmup >= 0")
    sizes = parse_sizes(args.sizes)
    if args.plot:
        from ringnet.bench.plot import check_writable
        from ringnet.errors import collective
        collective(MPI.COMM_WORLD, lambda: check_writable(args.plot)
                   if MPI.COMM_WORLD.Get_rank() == 0 else None)
    dtype = np.dtype(args.dtype)
    transport = make_transport(args.transport)
    xp = cupy if transport.uses_gpu() and transport.name == "nccl" else np
    options = {"ring": {"chunk_bytes": args.chunk_bytes}}
    comms = {a: create(a, transport=transport, **options.get(a, {}))
             for a in algos if a in COMMUNICATORS}
    n, rows = transport.size, []
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        results = _run_size(comms, transport, algos, xp, dtype, count, args.iters, args.warmup)
        for algo in algos:
            seconds, ok = results[algo]
            algbw = count * dtype.itemsize / seconds / 1e9
            rows.append({"algo": algo, "bytes": count * dtype.itemsize, "count": count,
                         "dtype": args.dtype, "time_us": seconds * 1e6, "algbw": algbw,
                         "busbw": bus_bandwidth(algbw, n), "ok": ok})
    if transport.rank == 0:
        if args.json:
            print(json.dumps({"rows": rows, "ranks": n, "transport": transport.name}))
        else:
            _print_table(rows, n, transport.name, args)
            if args.markdown:
                from ringnet.bench.tables import comm_table
                print(comm_table(rows))
        if args.plot:
            from ringnet.bench.plot import plot_comm
            plot_comm(rows, args.plot, title=f"all-reduce, {n} ranks, {transport.name}, "
                                             f"{args.dtype}")
    return 0 if all(row["ok"] for row in rows) else 1


def _print_table(rows, n, transport_name, args):
    print(f"# all-reduce, {n} ranks, transport {transport_name}, dtype {args.dtype}, "
          f"median of {args.iters} (after {args.warmup} warm-up), slowest rank per iteration")
    print(f"# {'bytes':>10} {'count':>10} {'dtype':>8} {'algo':>7} {'time_us':>11} "
          f"{'algbw GB/s':>10} {'busbw GB/s':>10} {'ok':>3}")
    for row in rows:
        print(f"  {row['bytes']:>10} {row['count']:>10} {row['dtype']:>8} {row['algo']:>7} "
              f"{row['time_us']:>11.1f} {row['algbw']:>10.3f} {row['busbw']:>10.3f} "
              f"{'yes' if row['ok'] else 'NO':>3}")
    by_size = {}
    for row in rows:
        by_size.setdefault(row["bytes"], {})[row["algo"]] = row["time_us"]
    ratios = [(b, t["native"] / t["ring"]) for b, t in by_size.items() if "ring" in t and "native" in t]
    if ratios:
        print("# ring busbw / native busbw: " + ", ".join(f"{b}B {r:.2f}" for b, r in ratios))


if __name__ == "__main__":
    from ringnet.errors import run_main
    run_main(main)
