"""python -m ringnet.bench scaling — strong scaling of each parallel mode, as the research reports it.

Launches ``mpirun -np N python -m ringnet.train ... --json`` for every (mode, delay, N),
one BLAS thread per rank, the same global batch at every N, repeated in interleaved
rounds (every configuration once per round) so machine noise hits all of them alike;
each row is the median over rounds, beside the spread of its rounds (slowest minus
fastest over the median: a difference between rows smaller than that is noise).
Speedup is over ``single`` at N=1.

``--ceiling`` also times ``single`` at each N's per-rank batch (B/N) in the same rounds:
t(B) / t(B/N) is the speedup N ranks would reach if splitting the batch cost nothing but
the per-sample efficiency small batches lose (fixed costs per step, GEMMs too thin to run
at full rate) -- the most a strong-scaling run can show on this machine, with a core per
rank. Each row then says what share of its N's ceiling it reaches.

``--vs ddp`` also runs the peer, PyTorch DistributedDataParallel (``python -m
ringnet.bench.ddp``: gloo on the CPU, NCCL with ``--device gpu``), under the same mpirun on
the same model, initial weights, data, global batch split the same way, steps and N, in the
same rounds: the table gets a ``ddp`` row at every N, and every row its ratio to DDP at its
N, ``vs DDP`` = DDP's step time / the row's (above 1: faster than DDP). With
``--to-accuracy`` DDP trains under the same recipe (the model's lr, lr policy, momentum,
weight decay; the same evaluations) and the ratio is of the seconds to accuracy.

On a cluster (``hpc/cluster.sh``) ``--launcher "srun --mpi=pmi2"`` (or an ``mpirun`` that
reaches the nodes) and ``--nodes 1 2 4 2x2`` place the ranks: K nodes of
``--ranks-per-node`` ranks (``KxR``: R ranks on each of K nodes), in blocks. Each row then
names its nodes and the topology that ran (``--topologies flat,hierarchical`` runs the ring
and the tree with each), and gives the bytes one step sends between nodes as the plan
counts them on the run's own placement (``inter-node``, :func:`ringnet.cluster.inter_node_bytes`)
beside what the nodes' links carried per step (``link``, the cluster's veth counters:
TCP/IP headers and the run's set-up included).

The first line names the BLAS that ran (library, kernels, threads per rank, OpenBLAS's
kernel variables) and the load average; the last the load average at start and end.
"""
import argparse
import csv
import json
import os
import shutil
import statistics
import sys

from ringnet import cluster
from ringnet.bench import machine, options
from ringnet.errors import UsageError
from ringnet.cli import ArgumentParser
from ringnet.jobs import job_env, job_launch, recipe_flags, run_json, train_run
from ringnet.parallel import MODES, hierarchical_modes

__all__ = ["main", "run_config", "default_delays", "vs_ddp", "markdown_table", "global_batch"]


def default_delays():
    """Return {mode: delays} for every parallel mode of :data:`ringnet.parallel.MODES`:
    its default delay, and delay 0 beside it where the default is the delayed update
    (what the delay buys)."""
    return {m.name: (m.default_delay,) + ((0,) if m.default_delay else ())
            for m in MODES.values() if m.distributed}


def _delays_text():
    return ", ".join(f"{m} {' and '.join(map(str, d))}" for m, d in default_delays().items())


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_np(p, [1, 2], "rank counts")
    p.add_argument("--modes", default="ring,tree,master",
                   help=f"comma list of {', '.join(default_delays())} (default ring,tree,master; "
                        "single at N=1 is always run)")
    p.add_argument("--delays", default=None,
                   help=f"comma list of delays for every mode (default: {_delays_text()})")
    options.add_model(p, "cifar10_quick")
    options.add_dataset(p, "synthetic")
    options.add_batch_size(p, 64, "global batch, or with --scaling weak the batch of each rank")
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="strong (default): the same global batch at every N, speedup = single's step "
                        "time / the row's; weak: every rank keeps --batch-size (a global batch of N "
                        "times it), speedup = the row's images/s / single's at --batch-size")
    options.add_steps(p, 30)
    options.add_repeats(p)
    options.add_lr(p, None, shown="0.001, small enough that no mode diverges in a timing run "
                   "(step time does not depend on it); with --to-accuracy the model's default "
                   "of python -m ringnet.train")
    options.add_transport(p)
    options.add_device(p)
    options.add_mpirun(p)
    g = options.add_cluster(p, "node counts to run each mode on, K (K nodes of --ranks-per-node "
                               "ranks) or KxR (K nodes of R ranks), e.g. 1 2 4 2x2; replaces --np",
                            many=True)
    g.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks on each node for --nodes K (default 1)")
    g.add_argument("--topologies", default=None, metavar="LIST",
                   help="comma list of train's --topology (auto, flat, hierarchical) to run the "
                        "ring and the tree with (default: train's, auto)")
    p.add_argument("--vs", choices=("ddp",), default=None,
                   help="ddp: also run PyTorch DistributedDataParallel on the same problem at every "
                        "N, in the same rounds, and give each row its ratio to it (needs torch)")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table as CSV")
    options.add_plot(p, "also draw speedup and efficiency against N (.png; needs matplotlib)")
    options.add_json(p, 'print {"rows": [...]} instead of the table')
    options.add_markdown(p, "print the table")
    options.add_timeout(p)
    p.add_argument("--ceiling", action="store_true",
                   help="also time single at each N's per-rank batch (B/N) in the same rounds "
                        "and print each N's ceiling, t(B) / t(B/N): the speedup a split of the "
                        "batch could reach with nothing but small-batch efficiency lost, and "
                        "each row's share of it")
    g = p.add_argument_group("time to accuracy")
    g.add_argument("--to-accuracy", type=float, default=None, metavar="A",
                   help="train each configuration for up to --epochs, evaluating the test set every "
                        "--eval-every steps, and report the training wall time (evaluations excluded) "
                        "and the epochs until test accuracy first reaches A (0..1) beside images/s")
    options.add_epochs(g, 5, "with --to-accuracy: the most epochs a run may take")
    options.add_eval_every(g, 100, "with --to-accuracy: steps between test evaluations")
    options.add_seed(g, None, shown="train's")
    p.add_argument("--delay-compensation", choices=("lookahead", "none"), default=None,
                   help="train's --delay-compensation for the delay-1 runs (default: train's, lookahead)")
    options.add_data_dir(g)
    return p


def first_reaching(evals, accuracy):
    """Return (epoch, train seconds) of the first evaluation at or above ``accuracy``, or None."""
    for _, epoch, seconds, acc in evals:
        if acc >= accuracy:
            return epoch, seconds
    return None


def run_config(args, mode, delay, nranks, length=None, extra=(), batch=None):
    """Run one training job under mpirun; return its --json summary dict: ringnet's
    (:func:`ringnet.jobs.train_run`, which says what ``length``, ``extra`` and ``batch``
    are), or with ``mode`` ``ddp`` the peer's."""
    if mode != "ddp":
        return train_run(args, mode, delay, nranks, length, extra, batch)
    length = ["--steps", str(args.steps)] if length is None else length
    return run_json(_ddp_command(args, job_launch(args, nranks), length, batch),
                    f"ddp at N={nranks}", env=job_env(), timeout=args.timeout)


def _require_peer():
    """Raise the one-line UsageError saying how to install PyTorch, where it is missing."""
    from ringnet.bench.ddp import require_torch
    require_torch()


def _ddp_command(args, launch, length, batch=None):
    """The command line of the peer's run under ``launch``: ``ringnet.bench.ddp`` with
    train's flags."""
    return [*launch, sys.executable, "-m", "ringnet.bench.ddp",
            "--model", args.model, "--dataset", args.dataset,
            "--batch-size", str(batch or args.batch_size), *length, "--device", args.device,
            "--json", "--quiet", "--no-eval", "--timeout", str(args.timeout), *recipe_flags(args)]


def _check(args):
    """Raise UsageError for values no run can use (before anything is launched)."""
    for name in ("steps", "repeats", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr is not None and (not args.lr > 0 or args.lr == float("inf")):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 < args.timeout < float("inf"):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not [m for m in args.modes.split(",") if m.strip()]:
        raise UsageError(f"--modes names no mode, got {args.modes!r}")
    if args.csv:
        folder = os.path.dirname(os.path.abspath(args.csv))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write {args.csv}: folder {folder} does not exist or is not writable")
    delays = None
    if args.delays is not None:
        items = [d.strip() for d in args.delays.split(",") if d.strip()]
        if not items or any(d not in ("0", "1") for d in items):
            raise UsageError(f"--delays takes a comma list of 0 and 1, got {args.delays!r}")
        delays = [int(d) for d in items]
    return delays


def _shapes(args):
    """Return (the rank counts to run, the topologies to run the ring and the tree with):
    ``--np``'s, or with ``--nodes`` each a :class:`~ringnet.cluster.Shape`, checked
    against the nodes the launcher reaches."""
    topologies = [None]
    if args.topologies is not None:
        topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
        wrong = [t for t in topologies if t not in ("auto", "flat", "hierarchical")]
        if wrong or not topologies:
            raise UsageError(f"--topologies takes a comma list of auto, flat, hierarchical, "
                             f"got {args.topologies!r}")
    if not args.nodes:
        return list(args.np), topologies
    if args.ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be >= 1, got {args.ranks_per_node}")
    launcher = args.launcher or args.mpirun
    return options.node_shapes(args.nodes, args.ranks_per_node, launcher), topologies


def _across_nodes(args, model, mode, delay, n, results):
    """A row's cluster columns: its nodes, the topology that ran, the bytes one step of
    ``model`` sends between nodes by the plan on the run's placement, and what the links
    carried per step."""
    first = results[0]
    ran = (first.get("topology") or "flat").split()[0]
    steps = max(1, first.get("steps") or args.steps)
    nodes = first.get("rank_nodes")
    planned = None
    if mode == "single":
        planned = 0
    elif mode != "ddp" and nodes:
        planned = cluster.inter_node_bytes(mode, model, nodes,
                                           global_batch(args, n), delay, ran)
    link = [r["link_bytes"] / max(1, r.get("steps") or steps) for r in results if "link_bytes" in r]
    return {"nodes": getattr(n, "nodes", 1), "ranks_per_node": getattr(n, "per_node", int(n)),
            "topology": ran if mode in hierarchical_modes() else None,
            "inter_node_bytes_per_step": planned,
            "link_bytes_per_step": int(statistics.median(link)) if link else None}


def main(argv=None):
    args = build_parser().parse_args(argv)
    delays = _check(args)
    if args.plot:
        from ringnet.bench.plot import check_writable
        check_writable(args.plot)
    if args.launcher:
        cluster.check_launcher(args.launcher)
    elif shutil.which(args.mpirun) is None:
        raise UsageError(f"launcher {args.mpirun!r} not found; `pip install mpich` or pass --mpirun")
    nps, topologies = _shapes(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    per_mode = default_delays()
    for m in modes:
        if m not in per_mode:
            raise UsageError(f"unknown mode {m!r} in --modes; choose from {', '.join(per_mode)}")
    if any(n < 1 for n in nps):
        raise UsageError("--np values must be >= 1")
    bad = [int(n) for n in nps if args.batch_size % n and args.scaling == "strong"]
    if bad:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by N = {bad}")
    if args.to_accuracy is not None and not 0 < args.to_accuracy <= 1:
        raise UsageError(f"--to-accuracy is a fraction in (0, 1], got {args.to_accuracy}")
    if args.epochs < 1 or args.eval_every < 1:
        raise UsageError("--epochs and --eval-every must be >= 1")
    if args.ceiling and args.scaling == "weak":
        raise UsageError("--ceiling is strong scaling's (a split of one batch); weak scaling's ceiling "
                         "is N itself")
    if args.ceiling and args.to_accuracy is not None:
        raise UsageError("--ceiling times steps; it does not combine with --to-accuracy")
    if args.lr is None and args.to_accuracy is None:
        args.lr = 0.001                 # a timing run: small enough that no mode diverges
    if args.vs == "ddp":
        _require_peer()
    # the ranks run one BLAS thread each (run_config's environment)
    run = machine.begin(out=sys.stderr if args.json else None, threads=1, per_rank=True)
    length = None
    if args.to_accuracy is not None:
        length = ["--epochs", str(args.epochs), "--eval-every", str(args.eval_every)]
    one = cluster.Shape(1, 1) if args.nodes else 1
    configs = [("single", 0, one, None)]
    for n in sorted(set(nps)):
        if n == 1:
            continue
        for m in modes:
            for d in (delays if delays is not None else per_mode[m]):
                for topology in (topologies if m in hierarchical_modes() else [None]):
                    configs.append((m, d, n, topology))
    if args.vs == "ddp":        # the peer at every N, each right after ringnet's modes at it
        for n in sorted(set(nps)):
            last = max(i for i, c in enumerate(configs) if c[2] <= n)
            configs.insert(last + 1, ("ddp", 0, n, None))
    # single at the per-rank batch of each N, keyed by N (mode "ceiling")
    ceilings = [("ceiling", 0, n, None) for n in sorted(set(nps)) if n > 1] if args.ceiling else []
    configs += ceilings
    runs = {c: [] for c in configs}
    total = len(configs) * args.repeats
    done = 0
    for _ in range(args.repeats):
        for config in configs:
            mode, delay, n, topology = config
            if mode == "ceiling":
                runs[config].append(run_config(args, "single", 0, one, length=length,
                                               batch=args.batch_size // n))
                what = f"single batch {args.batch_size // n}"
            else:
                extra = ["--topology", topology] if topology else []
                runs[config].append(run_config(args, mode, delay, n, length=length, extra=extra,
                                               batch=global_batch(args, n)))
                what = f"{mode} delay {delay} N={cluster.nodes_text(n)}" + (
                    f" {topology}" if topology else "")
            done += 1
            print(f"\r[{done}/{total}] {what}   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    end_line = run.end(out=False)
    rows = []
    base_ms = statistics.median(r["step_ms"] for r in runs[configs[0]])
    # t(B) / t(B/N): the speedup of a free split of the batch, per N
    ceiling = {c[2]: base_ms / statistics.median(r["step_ms"] for r in runs[c]) for c in ceilings}
    if args.nodes:                     # what the rows' bytes between nodes are planned for
        from ringnet.models import build_model
        planned_model = build_model(args.model)
    for (mode, delay, n, _), results in runs.items():
        if mode == "ceiling":
            continue
        times = [r["step_ms"] for r in results]
        step_ms = statistics.median(times)
        med = lambda key: statistics.median(r.get(key, 0) or 0 for r in results)  # noqa: E731
        batch = global_batch(args, n)
        # images/s against single's at --batch-size: base_ms / step_ms for one global batch
        speedup = base_ms / step_ms * batch / args.batch_size
        rows.append({
            "mode": mode, "delay": delay, "np": int(n), "step_ms": round(step_ms, 3),
            "batch": batch, "images_per_sec": round(batch / step_ms * 1000, 1),
            "speedup": round(speedup, 3), "efficiency": round(speedup / n, 3),
            # how far apart the rounds' step times are: a speedup gap smaller than this is noise
            # (none from one round: "-", not 0%)
            "spread": round((max(times) - min(times)) / step_ms, 3)
            if step_ms and len(times) > 1 else None,
            "exposed_comm_ms": round(1000 * med("comm_wait_s") / max(1, results[0]["steps"]), 3),
            "overlap": round(med("overlap"), 3),
            "bytes_per_step": int(med("bytes_per_step")),
            "fc_params_per_rank": results[0].get("fc_params_per_rank"),
        })
        if args.nodes:
            rows[-1].update(_across_nodes(args, planned_model, mode, delay, n, results))
        if mode == "ddp":       # what DDP does not expose, rather than a made-up zero
            rows[-1].update(exposed_comm_ms=None, overlap=None, bytes_per_step=None)
            if args.nodes:
                rows[-1].update(inter_node_bytes_per_step=None)
        if n in ceiling:
            rows[-1]["ceiling"] = round(ceiling[n], 3)
            rows[-1]["of_ceiling"] = round(speedup / ceiling[n], 3)
        if args.to_accuracy is not None:
            reached = [first_reaching(r["evals"], args.to_accuracy) for r in results]
            hits = [x for x in reached if x is not None]
            # a configuration counts as reaching A only when every round did
            rows[-1]["epochs_to_acc"] = (round(statistics.median(x[0] for x in hits), 3)
                                         if len(hits) == len(results) else None)
            rows[-1]["seconds_to_acc"] = (round(statistics.median(x[1] for x in hits), 2)
                                          if len(hits) == len(results) else None)
            rows[-1]["final_accuracy"] = round(statistics.median(r["test_accuracy"] for r in results), 4)
    vs_ddp(rows, args.to_accuracy is not None)
    if args.plot:
        from ringnet.bench.plot import plot_scaling
        plot_scaling(rows, args.plot, title=f"{args.model}, {_batch_text(args).split(', speedup')[0]}, "
                                            f"{args.device}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        doc = {"model": args.model, "batch_size": args.batch_size, "scaling": args.scaling,
               "steps": args.steps,
               "repeats": args.repeats, "to_accuracy": args.to_accuracy, "rows": rows}
        if ceilings:
            doc["ceiling"] = [{"np": n, "batch_per_rank": args.batch_size // n,
                               "single_step_ms": round(base_ms / c, 3), "ceiling": round(c, 3)}
                              for n, c in sorted(ceiling.items())]
        doc.update(run.facts())
        doc["threads_ran"] = {("ddp" if mode == "ddp" else "ringnet"): sorted(
            {r.get("torch_threads" if mode == "ddp" else "blas_threads") for r in results} - {None})
            for (mode, _, _, _), results in runs.items()}
        print(json.dumps(doc))
        print(end_line, file=sys.stderr)
        return 0
    if args.markdown:
        print(markdown_table(args, rows))
        print(end_line)
        return 0
    if args.to_accuracy is not None:
        _print_to_accuracy(args, rows)
        print(end_line)
        return 0
    print(f"# model {args.model}, data {args.dataset}, {_batch_text(args)}, "
          f"{args.steps} steps, median of {args.repeats} interleaved rounds, 1 BLAS thread/rank; "
          f"spread = (slowest - fastest round) / median step, - with one round")
    header = (f"{'mode':>8} {'delay':>5} {'N':>3} {'step ms':>9} {'spread':>7} {'img/s':>8} {'speedup':>8} "
              f"{'effic.':>7} {'exposed comm ms':>16} {'overlap':>8} {'bytes/step':>12} "
              f"{'FC params/rank':>15}")
    if args.nodes:
        header += f" {'nodes':>6} {'topology':>12} {'inter-node B/step':>18} {'link B/step':>12}"
    if ceiling:
        header += f" {'ceiling':>8} {'of ceil.':>8}"
    peer = any("vs_ddp" in r for r in rows)
    if peer:
        header += f" {'vs DDP':>7}"
    print(header)
    for r in rows:
        spread = f"{100 * r['spread']:.0f}%" if r["spread"] is not None else "-"
        line = (f"{r['mode']:>8} {r['delay']:>5} {r['np']:>3} {r['step_ms']:>9.2f} {spread:>7} "
                f"{r['images_per_sec']:>8.0f} {r['speedup']:>8.2f} {r['efficiency']:>7.2f} "
                f"{_cell(r['exposed_comm_ms'], '.2f'):>16} {_cell(r['overlap'], '.2f'):>8} "
                f"{_cell(r['bytes_per_step'], ','):>12} "
                f"{r['fc_params_per_rank'] if r['fc_params_per_rank'] is not None else '-':>15}")
        if args.nodes:
            line += (f" {r['nodes']}x{r['ranks_per_node']:<{5 - len(str(r['nodes']))}} "
                     f"{r['topology'] or '-':>12} {_cell(r['inter_node_bytes_per_step'], ','):>18} "
                     f"{_cell(r['link_bytes_per_step'], ','):>12}")
        if ceiling:
            line += (f" {r['ceiling']:>8.2f} {100 * r['of_ceiling']:>7.0f}%" if "ceiling" in r
                     else f" {'-':>8} {'-':>8}")
        if peer:
            line += f" {_cell(r.get('vs_ddp'), '.2f'):>7}"
        print(line)
    if args.nodes:
        print("# nodes = nodes x ranks per node; inter-node = bytes a step sends between nodes as "
              "the plan counts them on the run's placement; link = bytes the nodes' links carried "
              "per step (TCP/IP headers and the run's set-up included)")
    if peer:
        print("# vs DDP = DDP's step time at the same N / this row's (above 1: faster than "
              "PyTorch DistributedDataParallel on the same model, data, batch and ranks)")
    from ringnet.placement import node_cores
    cores = node_cores()
    for n, c in sorted(ceiling.items()):
        shared = (f"; {n} ranks share this machine's {cores} cores, so the ranks' compute "
                  f"alone takes {n / cores:.1f}x as long as the ceiling assumes"
                  if n > cores and not args.nodes else "")      # on nodes: each its own cores
        print(f"# ceiling at N={n}: single at batch {args.batch_size // n} takes "
              f"{base_ms / c:.2f} ms a step against {base_ms:.2f} ms at {args.batch_size}: "
              f"t(B) / t(B/N) = {c:.2f}x{shared}")
    print(end_line)
    return 0


def global_batch(args, n):
    """The global batch of a run on ``n`` ranks: ``--batch-size``, or with ``--scaling weak``
    N times it (every rank keeps ``--batch-size``)."""
    return args.batch_size * int(n) if getattr(args, "scaling", "strong") == "weak" else args.batch_size


def _batch_text(args):
    if getattr(args, "scaling", "strong") == "weak":
        return (f"weak scaling: {args.batch_size} images per rank (global batch N x {args.batch_size}), "
                f"speedup = images/s / single's")
    return f"global batch {args.batch_size}"


def _cell(value, spec, missing="-"):
    """``value`` formatted by ``spec``, or ``missing`` where it was not measured (None)."""
    return missing if value is None else format(value, spec)


def vs_ddp(rows, to_accuracy=False):
    """Give every row of ``rows`` its ratio to the ``ddp`` row at its N: ``vs_ddp`` = DDP's
    step time / the row's; with ``to_accuracy`` also ``vs_ddp_to_acc`` = DDP's seconds to
    accuracy / the row's (None where either did not reach it). No ddp rows: nothing."""
    peers = {r["np"]: r for r in rows if r["mode"] == "ddp"}
    if not peers:
        return
    for r in rows:
        peer = peers.get(r["np"])
        r["vs_ddp"] = round(peer["step_ms"] / r["step_ms"], 3) if peer and r["step_ms"] else None
        if to_accuracy:
            both = peer is not None and peer.get("seconds_to_acc") and r.get("seconds_to_acc")
            r["vs_ddp_to_acc"] = (round(peer["seconds_to_acc"] / r["seconds_to_acc"], 3)
                                  if both else None)


def _mb(nbytes):
    return "–" if nbytes is None else f"{nbytes / 1e6:.2f}"


def markdown_table(args, rows):
    """Return the README's Markdown table of ``rows`` (the timing or the time-to-accuracy table)."""
    from ringnet.tables import markdown
    peer = any("vs_ddp" in r for r in rows)
    weak = getattr(args, "scaling", "strong") == "weak"
    if args.to_accuracy is None and args.nodes:
        return markdown(["mode", "delay", "nodes x ranks", "topology", "step ms"]
                        + (["images/s"] if weak else []) + ["speedup",
                         "exposed comm ms", "inter-node MB/step", "link MB/step"]
                        + (["DDP step / step"] if peer else []),
                        [[r["mode"], r["delay"], f"{r['nodes']} x {r['ranks_per_node']}",
                          r["topology"] or "–", f"{r['step_ms']:.1f}"]
                         + ([f"{r['images_per_sec']:.0f}"] if weak else [])
                         + [f"{r['speedup']:.2f}",
                          _cell(r["exposed_comm_ms"], ".2f", "–"), _mb(r["inter_node_bytes_per_step"]),
                          _mb(r["link_bytes_per_step"])]
                         + ([_cell(r["vs_ddp"], ".2f", "–")] if peer else []) for r in rows])
    if args.to_accuracy is None:
        return markdown(["mode", "delay", "N", "step ms"] + (["images/s"] if weak else [])
                        + ["speedup", "exposed comm ms"]
                        + (["DDP step / step"] if peer else []),
                        [[r["mode"], r["delay"], r["np"], f"{r['step_ms']:.1f}"]
                         + ([f"{r['images_per_sec']:.0f}"] if weak else [])
                         + [f"{r['speedup']:.2f}", _cell(r["exposed_comm_ms"], ".2f", "–")]
                         + ([_cell(r["vs_ddp"], ".2f", "–")] if peer else []) for r in rows])
    target = f"{100 * args.to_accuracy:g}%"
    compensation = args.delay_compensation or "lookahead"       # train's default at delay 1
    out = []
    for r in rows:
        reached = r["epochs_to_acc"] is not None
        out.append([f"{r['mode']} (`{compensation}`)" if r["delay"] else r["mode"], r["delay"], r["np"],
                    f"{r['images_per_sec']:.0f}", r["epochs_to_acc"] if reached else "not reached",
                    f"{r['seconds_to_acc']:.1f}" if reached else "–", f"{100 * r['final_accuracy']:.2f}%"]
                   + ([_cell(r["vs_ddp_to_acc"], ".2f", "–")] if peer else []))
    epochs = f"{args.epochs} epoch" + ("s" if args.epochs != 1 else "")
    return markdown(["mode", "delay", "N", "images/s", f"epochs to {target}", f"seconds to {target}",
                     f"accuracy after {epochs}"] + ([f"DDP s / s to {target}"] if peer else []), out)


def _print_to_accuracy(args, rows):
    a = args.to_accuracy
    print(f"# model {args.model}, data {args.dataset}, {_batch_text(args)}, "
          f"lr {args.lr or 'default'}, "
          f"up to {args.epochs} epochs, test set every {args.eval_every} steps, median of "
          f"{args.repeats} interleaved rounds; time = training wall time, evaluations excluded")
    print(f"{'mode':>8} {'delay':>5} {'N':>3} {'img/s':>8} {'speedup':>8} "
          f"{'epochs to ' + format(a, '.1%'):>16} {'s to ' + format(a, '.1%'):>11} {'final acc':>10}"
          + (f" {'vs DDP':>7}" if any("vs_ddp" in r for r in rows) else ""))
    for r in rows:
        reached = r["epochs_to_acc"] is not None
        print(f"{r['mode']:>8} {r['delay']:>5} {r['np']:>3} {r['images_per_sec']:>8.0f} "
              f"{r['speedup']:>8.2f} {r['epochs_to_acc'] if reached else 'not reached':>16} "
              f"{format(r['seconds_to_acc'], '.1f') if reached else '-':>11} "
              f"{r['final_accuracy']:>10.2%}"
              + (f" {_cell(r['vs_ddp_to_acc'], '.2f'):>7}" if "vs_ddp" in r else ""))
    if any("vs_ddp" in r for r in rows):
        print("# vs DDP = DDP's seconds to the accuracy at the same N / this row's (above 1: "
              "there sooner than PyTorch DistributedDataParallel under the same recipe)")
