"""python -m ringnet.bench overlap — how communication overlaps computation on the CPU, variant by variant.

Runs ``python -m ringnet.train`` under mpirun (one BLAS thread per rank) for single at
N=1 and, at N ranks, every mode and delay under each way of overlapping:

* ``progress``: how a CPU stream's transfers progress (``RINGNET_CPU_PROGRESS``):
  ``driven`` (the stream thread sleeps; the training thread tests the transfer at every
  layer boundary; the default), ``poll`` (the stream thread polls), ``block`` (the
  stream thread blocks in MPI's wait);
* ``buckets``: delay 0 only, ``RINGNET_BUCKET_BYTES``: ``0`` exchanges the whole
  gradient after the backward, the default cuts it into buckets whose exchange starts
  during the backward.

Every configuration runs once per round, rounds interleaved, so machine noise hits all
alike; each row is the median over rounds, with the load average of the machine before
and after the runs (a ratio measured at a load above the core count says little).
``delay1/delay0``: the step-time ratio of the same mode and variant (>= 1: delay 1 is
not slower).
"""
import argparse
import os
import shutil
import statistics

from ringnet import cluster
from ringnet.bench import machine, options
from ringnet.bench.scaling import run_config
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser
from ringnet.parallel import distributed_modes

__all__ = ["main", "VARIANTS"]

# (delay, progress, bucket bytes or None for the default): the variants of each mode
VARIANTS = (
    (0, "driven", "0"), (0, "poll", None), (0, "driven", None),
    (1, "poll", None), (1, "block", None), (1, "driven", None),
)
MODES = tuple(distributed_modes())     # the modes --modes takes (single runs once, as the base)


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench overlap", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_np(p, 2, "ranks of the parallel runs")
    p.add_argument("--modes", default="ring,tree,split-fc", help="comma list of "
                   f"{', '.join(MODES)} (default ring,tree,split-fc)")
    options.add_model(p, "cifar10_quick")
    options.add_dataset(p, "synthetic")
    options.add_batch_size(p)
    options.add_steps(p, 30)
    options.add_repeats(p)
    p.add_argument("--variants", default=None,
                   help="comma list of DELAY:PROGRESS:BUCKETS (e.g. 1:driven:default,0:driven:0); "
                        "default: every variant")
    options.add_lr(p, 0.001)
    options.add_mpirun(p)
    options.add_timeout(p)
    options.add_cluster(p, "run the parallel modes on K nodes of one rank (K) or of R ranks "
                           "(KxR), e.g. 4 or 2x2, instead of --np ranks; single runs on one node")
    return p


def _variants(text):
    if text is None:
        return list(VARIANTS)
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in ("0", "1") \
                or parts[1] not in ("driven", "poll", "block") \
                or not (parts[2] == "default" or parts[2].isdigit()):
            raise UsageError(f"--variants: {item!r} is not DELAY:PROGRESS:BUCKETS "
                             "(delay 0/1, progress driven/poll/block, buckets default or bytes)")
        out.append((int(parts[0]), parts[1], None if parts[2] == "default" else parts[2]))
    if not out:
        raise UsageError("--variants is empty")
    return out


def _label(variant):
    delay, progress, buckets = variant
    if delay:
        return progress
    if buckets == "0":
        return "no buckets"
    return f"{progress}, buckets {'default' if buckets is None else buckets}"


def main(argv=None):
    args = build_parser().parse_args(argv)
    for name in ("steps", "repeats", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.nodes:
        args.np = options.node_shapes([args.nodes], 1, args.launcher or args.mpirun)[0]
    elif args.launcher:
        raise UsageError("--launcher places ranks on nodes: give --nodes K or KxR with it")
    if args.np < 2 or args.batch_size % args.np:
        raise UsageError(f"--np must be >= 2 and divide --batch-size {args.batch_size}, got {args.np}")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise UsageError(f"--modes names no mode, got {args.modes!r}")
    for m in modes:
        if m not in MODES:
            raise UsageError(f"unknown mode {m!r} in --modes; choose from {', '.join(MODES)}")
    variants = _variants(args.variants)
    if args.launcher:
        cluster.check_launcher(args.launcher)
    elif shutil.which(args.mpirun) is None:
        raise UsageError(f"launcher {args.mpirun!r} not found; `pip install mpich` or pass --mpirun")
    args.transport, args.device, args.delay_compensation = "mpi", "cpu", None
    one = cluster.Shape(1, 1) if args.nodes else 1
    configs = [("single", 0, one, ("driven", "0"))] + [
        (mode, delay, args.np, (progress, buckets))
        for mode in modes for delay, progress, buckets in variants]
    results = {c: [] for c in configs}
    run = machine.begin(threads=1, per_rank=True)      # run_config pins one thread a rank
    loads = [machine.load_average()]
    saved = {k: os.environ.get(k) for k in ("RINGNET_CPU_PROGRESS", "RINGNET_BUCKET_BYTES")}
    try:
        for r in range(args.repeats):
            for config in configs:
                mode, delay, n, (progress, buckets) = config
                os.environ["RINGNET_CPU_PROGRESS"] = progress
                if buckets is None:
                    os.environ.pop("RINGNET_BUCKET_BYTES", None)
                else:
                    os.environ["RINGNET_BUCKET_BYTES"] = buckets
                summary = run_config(args, mode, delay, n)
                results[config].append(summary)
            loads.append(machine.load_average())
            print(f"round {r + 1}/{args.repeats} done, load average {loads[-1]:.2f}", flush=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def med(config, key):
        return statistics.median(s[key] for s in results[config])

    def step_ms(config):
        return statistics.median(s["step_ms"] for s in results[config])

    single = configs[0]
    where = f"{args.np.nodes} nodes x {args.np.per_node} ranks" if args.nodes else f"N={args.np}"
    print(f"# model {args.model}, global batch {args.batch_size}, {args.steps} steps, {where}, "
          f"median of {args.repeats} interleaved rounds, 1 BLAS thread/rank; load average (1 min) "
          f"{', '.join(f'{x:.1f}' for x in loads)} (machine: {machine.machine_cores()} cores)")
    print(f"{'mode':>8} {'delay':>5} {'variant':<24} {'step ms':>8} {'speedup':>8} "
          f"{'exposed comm ms':>16} {'overlap':>8} {'delay1/delay0':>14}")
    print(f"{'single':>8} {0:>5} {'':<24} {step_ms(single):8.2f} {1.0:8.2f} {0.0:16.2f} {0.0:8.2f}")
    for config in configs[1:]:
        mode, delay, n, (progress, buckets) = config
        exposed = 1e3 * statistics.median(s["comm_wait_s"] / max(1, s["steps"]) for s in results[config])
        ratio = ""
        if delay:       # against the default delay-0 variant of the same mode
            base = (mode, 0, n, ("driven", None))
            if base in results:
                ratio = f"{step_ms(base) / step_ms(config):.2f}"
        print(f"{mode:>8} {delay:>5} {_label((delay, progress, buckets)):<24} {step_ms(config):8.2f} "
              f"{step_ms(single) / step_ms(config):8.2f} {exposed:16.2f} {med(config, 'overlap'):8.2f} "
              f"{ratio:>14}")
    run.end()
    return 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
