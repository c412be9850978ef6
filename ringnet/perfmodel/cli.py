"""The command line of ``python -m ringnet.bench model``: its options, and a run from them."""
import argparse
import json
import os
import sys

from ringnet.perfmodel.calibration import calibrate
from ringnet.perfmodel.exchange import allreduce_rows
from ringnet.perfmodel.links import LINKS
from ringnet.perfmodel.profiling import compute_profile
from ringnet.perfmodel.report import (MARKDOWN_TABLES, markdown_hierarchical, markdown_paper,
                                        markdown_predictions, markdown_validation, plot,
                                        print_hierarchical)
from ringnet.perfmodel.roofline import GPUS
from ringnet.perfmodel.sweeps import (DEFAULT_MODELS, DEFAULT_NP, DEFAULT_PROFILES, PAPER_NP,
                                        crossovers, hierarchical_rows, paper_rows, sweep)
from ringnet.perfmodel.profiles import make_system
from ringnet.perfmodel.text import print_report, print_validation
from ringnet.perfmodel.validation import PROBE_S, VALIDATION_NP, validate, validation_rows
from ringnet.perfmodel.worker import calibrate_worker
from ringnet.cli import ArgumentParser
from ringnet.errors import UsageError
from ringnet.models import MODELS, build_model

__all__ = ["main"]


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench model",
                       description=sys.modules[__package__].__doc__.split("\n\n")[0],
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
                        "calibrates in every round, and times each model's step in this process "
                        f"for {PROBE_S:g} s after the profile and before and after every run, to "
                        "say how far the machine's speed drifted meanwhile; each row is also "
                        "predicted at the run's own speed (its training threads' CPU time in "
                        "forward and backward against the profile's for the same work) "
                        "(about 4 minutes a round)")
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
                        "paper (the research's setting), validation (predicted / measured; "
                        "needs --validate or --validation FILE) or hierarchical (the ring's and "
                        "the tree's hierarchical exchange where the ranks span nodes, against "
                        "flat) (default predictions)")
    p.add_argument("--json", action="store_true",
                   help='print one line {"predictions": [...], "validation": [...], "paper": [...]}')
    p.add_argument("--mpirun", default=os.environ.get("MPIRUN", "mpirun"),
                   help="launcher for calibration and validation (default $MPIRUN or mpirun)")
    p.add_argument("--launcher", default=None, metavar="CMD",
                   help='what starts the ranks of calibration and validation on a cluster, e.g. '
                        '"srun --mpi=pmi2" or an mpirun reaching the nodes: the ranks are placed '
                        "--ranks-per-node to a node (default: --mpirun, placed as it likes)")
    p.add_argument("--iters", type=int, default=7, help="calibration repetitions (median; default 7)")
    p.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _checked(args):
    """Check the options; return (models, rank counts, link profiles)."""
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
    profiles = args.profile or list(DEFAULT_PROFILES)
    for spec in profiles:
        if spec != "local":
            make_system(spec, None, args.ranks_per_node)        # unknown names fail early
    make_system(args.paper_profile, None, PAPER_NP)
    if args.paper_compute not in GPUS and args.paper_compute not in ("here", "here-isolated") \
            and not os.path.exists(args.paper_compute):
        raise UsageError(f"--paper-compute {args.paper_compute!r}: use here, "
                         f"{', '.join(GPUS)} or a profile file")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    return models, sorted(set(args.np)), profiles


def _read_record(path, what, fields):
    """The JSON object in ``path``, with each of ``fields`` (name: type); else one UsageError."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {what} {path}: {exc}") from None
    missing = [k for k, kind in fields.items()
               if not isinstance(record, dict) or not isinstance(record.get(k), kind)]
    if missing:
        raise UsageError(f"{path} is not a {what} of bench model: it lacks {', '.join(missing)}")
    return record


def _calibration(args, compute, models, profiles):
    """The local calibration: read from --calibration, or run here when profile local needs it."""
    if args.calibration and os.path.exists(args.calibration) and not args.calibrate:
        return _read_record(args.calibration, "calibration", {"by_np": dict})
    if not (args.calibrate or "local" in profiles):
        return None
    if compute.device != "cpu":
        raise UsageError("profile local is this CPU machine: use --compute here")
    calibration = calibrate((2, 4), compute, args.launcher or args.mpirun, args.iters,
                            models=models, batch=args.batch_size, scaling=args.scaling,
                            per_node=args.ranks_per_node if args.launcher else None)
    if args.calibration:
        with open(args.calibration, "w") as f:
            json.dump(calibration, f, indent=1)
    return calibration


def _validation(args, models, nps):
    """Return (validation rows, record): measured now (--validate) or read from --validation."""
    if args.validate:
        record = validate(models, args.validate_batch, args.validate_steps,
                          args.validate_repeats, args.launcher or args.mpirun, args.iters,
                          nps=VALIDATION_NP if args.np == list(DEFAULT_NP) else tuple(nps),
                          # on a cluster: the ranks placed --ranks-per-node to a node
                          **({"per_node": args.ranks_per_node} if args.launcher else {}))
        if args.validation:
            with open(args.validation, "w") as f:
                json.dump(record, f, indent=1)
        return validation_rows(record), record
    if not args.validation:
        return [], None
    record = _read_record(args.validation, "validation record",
                          {"batch_size": int, "steps": int, "rounds": list})
    if not record["rounds"] or not all(isinstance(r, dict) and {"compute", "calibration",
                                                                "measured"} <= set(r)
                                       for r in record["rounds"]):
        raise UsageError(f"{args.validation} is not a validation record of bench model: its "
                         f"rounds lack compute, calibration or measured")
    args.validate_batch, args.validate_steps = record["batch_size"], record["steps"]
    args.validate_repeats = len(record["rounds"])
    return validation_rows(record), record


def _print_json(predictions, validation, paper, hierarchical=()):
    keys = ("model", "mode", "delay", "np", "profile", "topology", "between", "step_ms", "speedup",
            "efficiency", "floor_ms", "residual_ms")
    print(json.dumps({
        "predictions": [{k: r[k] for k in keys} for r in list(predictions) + list(hierarchical)],
        "validation": [{k: r[k] for k in ("model", "mode", "delay", "np", "predicted_ms",
                                          "measured_ms")} for r in validation],
        "paper": [{"model": r["model"], "np": r["np"], "predicted_speedup": r["speedup"],
                   "reported_speedup": r["reported_speedup"]}
                  for r in paper if r["reported_speedup"] is not None]}))


def main(argv=None):
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.calibrate_worker:
        return calibrate_worker(args.iters, [m for m in args.models.split(",") if m],
                                args.batch_size)
    models, nps, profiles = _checked(args)
    compute = compute_profile(args.compute, models, args.dtype)
    if args.save_compute:
        with open(args.save_compute, "w") as f:
            json.dump(compute.to_json(), f, indent=1)
    calibration = _calibration(args, compute, models, profiles)
    predictions, crosses, allreduces, hierarchical = [], [], [], []
    for spec in profiles:
        system = make_system(spec, compute, args.ranks_per_node, calibration)
        for name in models:
            model = build_model(name, dtype=args.dtype)
            predictions += sweep(system, model, nps, args.batch_size, args.scaling)
            hierarchical += hierarchical_rows(system, model, nps, args.batch_size, args.scaling)
            allreduces += allreduce_rows(system, model, nps)
            crosses += crossovers(system, model, args.batch_size, args.scaling,
                                  min(args.max_crossover_np, max(nps)))
    paper, paper_compute, _ = paper_rows(args.paper_compute, args.paper_profile, args.dtype)
    validation, record = _validation(args, models, nps)
    if args.plot:
        plot(predictions, args.plot, f"ringnet predicted scaling ({args.scaling}, batch "
                                     f"{args.batch_size}, compute {compute.name})")
    if args.markdown:
        tables = {"predictions": lambda: markdown_predictions(predictions, nps),
                  "hierarchical": lambda: markdown_hierarchical(hierarchical, nps),
                  "paper": lambda: markdown_paper(paper),
                  "validation": lambda: markdown_validation(validation)}
        print(tables[args.table]())
        return 0
    if args.json:
        _print_json(predictions, validation, paper, hierarchical)
        return 0
    print_report(args, compute, profiles, calibration, nps, predictions, allreduces, crosses,
                 paper, paper_compute)
    if hierarchical:
        print_hierarchical(hierarchical, args.batch_size, args.scaling, nps)
    if validation:
        print_validation(args, validation, record)
    if args.plot:
        print(f"\n# plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
