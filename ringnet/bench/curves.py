"""python -m ringnet.bench curves — test accuracy against epochs and wall time, every mode.

Trains one model on one data set in every parallel structure (single, ring at delay 0
and 1, tree, master, split-fc; N ranks each, single on one), the same seed, recipe
and global batch, for E epochs, evaluating the test set every K steps. Writes every
evaluation to a CSV (mode, delay, N, step, epoch, train seconds with evaluations
excluded, test accuracy) and, with matplotlib, a plot of test accuracy against epoch
and against wall time. A run that fails (a diverged delay-1 run stops with a NaN loss)
is listed as failed and left out of the CSV and the plot; the others go on.

``--from-csv`` reads CSVs this benchmark wrote instead of training (several are joined:
runs made by separate invocations), and writes the plot (``--plot``), a joined CSV
(``--csv``) and the summary from them. ``--markdown`` prints the summary as the README's
table: per run the test accuracy after the first, second, middle and last evaluated
epoch, the best (and its epoch) and the training seconds of the last evaluation.
"""
import argparse
import csv
import os
import shutil
import sys

from ringnet.bench import machine, options
from ringnet.bench.scaling import run_config
from ringnet.errors import USER_ERRORS, UsageError
from ringnet.cli import ArgumentParser
from ringnet.parallel import MODES

__all__ = ["main", "parse_runs", "read_csv", "summary_table", "DEFAULT_RUNS"]

DEFAULT_RUNS = "single,ring:0,ring:1,ring:1:none,tree,master,split-fc"
FIELDS = ["label", "mode", "delay", "np", "step", "epoch", "train_s", "test_accuracy"]


def parse_runs(text, np_):
    """Return [(label, mode, delay, N, extra train args)] from 'mode[:delay[:compensation]]' items."""
    runs = []
    for item in (t for t in text.split(",") if t):
        parts = item.split(":")
        mode = parts[0]
        if mode not in MODES or len(parts) > 3:
            *names, last = MODES
            raise UsageError(f"bad run {item!r} in --runs: expected mode[:delay[:compensation]] with "
                             f"mode {', '.join(names)} or {last}")
        if not MODES[mode].distributed:
            if len(parts) > 1:
                raise UsageError(f"bad run {item!r}: {mode} takes no delay")
            runs.append((mode, mode, 0, 1, []))
            continue
        delay = MODES[mode].default_delay
        if len(parts) > 1:
            if parts[1] not in ("0", "1"):
                raise UsageError(f"bad run {item!r}: the delay is 0 or 1")
            delay = int(parts[1])
        extra = []
        label = f"{mode} d{delay}"
        if len(parts) > 2:
            extra = ["--delay-compensation", parts[2]]
            label += f" ({parts[2]})"
        runs.append((label, mode, delay, np_, extra))
    if not runs:
        raise UsageError("--runs is empty")
    return runs


def build_parser():
    p = ArgumentParser(prog="python -m ringnet.bench curves", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_model(p, "lenet")
    options.add_dataset(p, "fashion-mnist")
    options.add_epochs(p, 10)
    options.add_np(p, 2, "ranks of every parallel run")
    p.add_argument("--runs", default=DEFAULT_RUNS,
                   help="comma list of mode[:delay[:compensation]] (default %(default)s; "
                        "compensation as train's --delay-compensation)")
    options.add_eval_every(p, None, "steps between test evaluations", shown="a quarter epoch")
    options.add_batch_size(p)
    options.add_lr(p, None, shown="the model's")
    options.add_seed(p, 0)
    options.add_data_dir(p)
    options.add_transport(p)
    options.add_device(p)
    options.add_mpirun(p)
    options.add_timeout(p, 7200)
    p.add_argument("--csv", default=None,
                   help="output CSV (default curves.csv; with --from-csv none)")
    options.add_plot(p, "output PNG (default curves.png, '' for none; with --from-csv none)")
    p.add_argument("--from-csv", nargs="+", default=None, metavar="CSV",
                   help="summarise (and plot, join) these CSVs of earlier runs instead of training")
    options.add_markdown(p, "print the summary")
    return p


def read_csv(paths):
    """Return the rows of CSVs this benchmark wrote, joined (in file order), typed."""
    rows = []
    for path in paths:
        try:
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames != FIELDS:
                    raise UsageError(f"cannot read {path}: columns {reader.fieldnames}, "
                                     f"expected {','.join(FIELDS)}")
                for r in reader:
                    rows.append({"label": r["label"], "mode": r["mode"], "delay": int(r["delay"]),
                                 "np": int(r["np"]), "step": int(r["step"]),
                                 "epoch": float(r["epoch"]), "train_s": float(r["train_s"]),
                                 "test_accuracy": float(r["test_accuracy"])})
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None
        except (KeyError, ValueError, TypeError) as exc:
            raise UsageError(f"cannot read {path}: bad value ({exc})") from None
    if not rows:
        raise UsageError(f"no evaluations in {' '.join(paths)}")
    return rows


def _epoch(e):
    """An epoch as a label: whole epochs as integers, fractions to two places (0.23, not 0.227273)."""
    return f"{e:.0f}" if abs(e - round(e)) < 1e-9 else f"{e:.2f}"


def _seconds(t):
    """Training seconds: whole seconds from 10 s, else to two places (a short run is not 0 s)."""
    return f"{t:.0f}" if t >= 10 else f"{t:.2f}"


def summary_table(rows):
    """Return the ``--markdown`` summary: a row per run, accuracy after chosen epochs."""
    from ringnet.tables import markdown
    labels = list(dict.fromkeys(r["label"] for r in rows))
    epochs = sorted({r["epoch"] for r in rows})
    last = epochs[-1]
    middle = min(epochs, key=lambda e: (abs(e - last / 2), e))
    shown = list(dict.fromkeys(e for e in (epochs[0], epochs[min(1, len(epochs) - 1)], middle, last)))
    header = ["run"] + [f"epoch {_epoch(e)}" for e in shown] + ["best (epoch)", "training s"]
    out = []
    for label in labels:
        mine = {r["epoch"]: r for r in rows if r["label"] == label}
        best = max(mine.values(), key=lambda r: (r["test_accuracy"], -r["epoch"]))
        final = mine[max(mine)]
        out.append([label] + [f"{100 * mine[e]['test_accuracy']:.2f}%" if e in mine else "–"
                              for e in shown]
                   + [f"{100 * best['test_accuracy']:.2f}% ({_epoch(best['epoch'])})",
                      _seconds(final["train_s"])])
    return markdown(header, out)


def plot(rows, path, title):
    """Write test accuracy against epoch and against training seconds, one line per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for i, label in enumerate(labels):
        mine = [r for r in rows if r["label"] == label]
        style = dict(label=label, marker=".", linewidth=1.3, markersize=4,
                     linestyle="--" if "none" in label else "-")
        left.plot([r["epoch"] for r in mine], [100 * r["test_accuracy"] for r in mine], **style)
        right.plot([r["train_s"] for r in mine], [100 * r["test_accuracy"] for r in mine], **style)
    left.set_xlabel("epoch")
    right.set_xlabel("training wall time, s (evaluations excluded)")
    left.set_ylabel("test accuracy, %")
    accs = [100 * r["test_accuracy"] for r in rows]
    top = max(accs)
    left.set_ylim(max(min(accs), top - 15), top + 1)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def _write_csv(path, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _title(args):
    return (f"{args.model} on {args.dataset}, global batch {args.batch_size}, "
            f"N = {args.np} (single: 1), seed {args.seed}")


def _report(rows, failed, args):
    if args.markdown:
        print(summary_table(rows))
    else:
        print(f"{'run':>18} {'final acc':>10} {'best acc':>9} {'train s':>9}")
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = [r for r in rows if r["label"] == label]
            print(f"{label:>18} {mine[-1]['test_accuracy']:>10.2%} "
                  f"{max(r['test_accuracy'] for r in mine):>9.2%} {_seconds(mine[-1]['train_s']):>9}")
    for label, reason in failed.items():
        print(f"{label:>18} failed: {reason}")
    written = [p for p in (args.csv, args.plot) if p]
    if written:
        print("wrote " + " and ".join(written))


def _check_plot(path):
    if path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install matplotlib (or --plot '')") from None


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.from_csv:
        _check_plot(args.plot)
        rows = read_csv(args.from_csv)
        if args.csv:
            _write_csv(args.csv, rows)
        if args.plot:
            plot(rows, args.plot, _title(args))
        _report(rows, {}, args)
        return 0
    args.csv = "curves.csv" if args.csv is None else args.csv
    args.plot = "curves.png" if args.plot is None else args.plot
    if shutil.which(args.mpirun) is None:
        raise UsageError(f"launcher {args.mpirun!r} not found; `pip install mpich` or pass --mpirun")
    if args.epochs < 1 or args.np < 1 or (args.eval_every is not None and args.eval_every < 1):
        raise UsageError("--epochs, --np and --eval-every must be >= 1")
    if args.batch_size % args.np:
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by --np {args.np}")
    from ringnet.models import MODELS
    if args.model not in MODELS:
        raise UsageError(f"unknown model {args.model!r}: choose from {', '.join(MODELS)}")
    _check_plot(args.plot)
    runs = parse_runs(args.runs, args.np)
    args.steps = None           # run_config's default length; every run here sets --epochs
    if args.eval_every is None:
        from ringnet.data import open_dataset
        spec = MODELS[args.model]
        try:
            ds = open_dataset(args.dataset, data_dir=args.data_dir, seed=args.seed,
                              input_shape=spec and spec.input_shape,
                              num_classes=spec and spec.num_classes)
        except USER_ERRORS:
            ds = None
        n = len(ds.train) if ds is not None else 4 * args.batch_size
        if ds is not None:
            ds.close()
        args.eval_every = max(1, n // args.batch_size // 4)
    rows, failed = [], {}
    run = machine.begin(threads=1, per_rank=True)      # run_config pins one thread a rank
    for i, (label, mode, delay, n, extra) in enumerate(runs):
        print(f"\r[{i + 1}/{len(runs)}] {label}   ", end="", file=sys.stderr, flush=True)
        try:
            summary = run_config(args, mode, delay, n, extra=extra,
                                 length=["--epochs", str(args.epochs), "--eval-every",
                                         str(args.eval_every)])
        except UsageError as exc:       # a run that diverged (or failed) is reported, not fatal
            failed[label] = str(exc).split(": ", 1)[-1]
            continue
        for step, epoch, seconds, acc in summary["evals"]:
            rows.append({"label": label, "mode": mode, "delay": delay, "np": n, "step": step,
                         "epoch": epoch, "train_s": round(seconds, 3), "test_accuracy": acc})
        _write_csv(args.csv, rows)      # after every run: a long job leaves what it has
    print(file=sys.stderr)
    if not rows:
        raise UsageError("every run failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))
    if args.plot:
        plot(rows, args.plot, _title(args))
    _report(rows, failed, args)
    run.end()
    return 0
