"""python -m ringnet.bench {layers,comm,scaling,overlap,model,curves,delay,elastic,soak,faults,budget} ... — benchmarks that print tables."""
import importlib
import sys

from ringnet.allocator import configure_allocator
from ringnet.blas import configure_blas_threads
from ringnet.errors import UsageError

if __name__ == "__main__":     # the program: pin BLAS threads before a benchmark loads NumPy
    configure_blas_threads()
    configure_allocator()
    from ringnet import start_watch
    if start_watch.launcher_rank() is not None:     # a rank of a launcher's job (bench comm,
        start_watch.watch()                         # the model's calibration): MPI's start bounded

COMMANDS = {
    "layers": ("ringnet.bench.layers", "per-layer and full-step times, optionally against PyTorch CPU"),
    "comm": ("ringnet.bench.comm", "nccl-tests style table of ring/tree/master/native allreduce (run under mpirun)"),
    "scaling": ("ringnet.bench.scaling", "launches mpirun at several N and prints speedup per mode"),
    "overlap": ("ringnet.bench.overlap", "interleaved runs of each way to overlap communication on the "
                                         "CPU: delay 1 vs 0, stream progress, delay-0 buckets"),
    "model": ("ringnet.perfmodel", "predicted step time, speedup and efficiency per mode, N = 1..1024"),
    "delay": ("ringnet.bench.delay", "delay-1 compensations side by side in one process (accuracy, stability)"),
    "curves": ("ringnet.bench.curves", "test accuracy vs epoch and wall time for every mode: CSV + plot"),
    "elastic": ("ringnet.bench.elastic", "cost of --save-every, and of a rank killed under ringnet.launch"),
    "soak": ("ringnet.bench.soak", "a long run's memory, threads and open files per rank against "
                                   "the step count: growth per 1,000 steps"),
    "budget": ("ringnet.bench.budget", "kernel launches, allocations and host waits per GPU training "
                                       "step, counted without a GPU"),
    "faults": ("ringnet.bench.faults", "stops/kills a rank in every phase, MPMD mismatches, bad files: "
                                       "exit code and time to exit per case"),
}


def _unknown(name):
    """The one line for a benchmark name that is not one: the nearest name, and the list."""
    import difflib
    near = difflib.get_close_matches(name, list(COMMANDS), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (f"unknown benchmark {name!r}{hint}; choose one of {', '.join(COMMANDS)} "
            "(python -m ringnet.bench --help says what each does)")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        raise UsageError(_unknown(argv[0]))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m ringnet.bench {layers,comm,scaling,overlap,model,curves,delay,elastic,soak,faults,budget} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        print("\n`python -m ringnet.bench NAME --help` lists each benchmark's options.")
        return 0 if argv else 2
    from ringnet.blas import check_blas_threads
    check_blas_threads()        # docs/environment.md: a bad value is one line and exit 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    from ringnet import start_watch
    start_watch.up()            # the ranks' benchmarks start MPI as they load
    if hasattr(module, "check_ranks"):      # a benchmark between ranks, started on one
        module.check_ranks(argv[1:])
    if argv[0] != "model":      # every other benchmark prints its machine lines itself
        return module.main(argv[1:])
    from ringnet.bench import machine
    module.build_parser().parse_args(argv[1:])      # a bad flag: its one line, nothing else
    out = sys.stderr if "--json" in argv else None
    run = machine.begin(out=out)
    code = module.main(argv[1:])
    run.end(out=out)
    return code


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
