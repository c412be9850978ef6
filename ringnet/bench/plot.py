"""Pictures of benchmark results and traces (needs matplotlib: ``pip install ringnet[plot]``).

* :func:`plot_scaling` — speedup and efficiency against N per mode, with the ideal line
  (rows of ``python -m ringnet.bench scaling``).
* :func:`plot_cluster` — step time of every mode and topology on each layout of nodes, one
  panel per ``bench scaling --nodes ... --csv`` file (a model and a link rate each), the
  part of it spent waiting on the exchange shaded.
* :func:`plot_comm` — bus bandwidth against message size per algorithm (rows of
  ``python -m ringnet.bench comm``).
* :func:`plot_trace` — a few steps of every rank from a ``--trace`` file: one lane for the
  training thread and one for communication per rank.

Also ``python -m ringnet.bench.plot trace TRACE.json OUT.png [--steps K]`` and
``python -m ringnet.bench.plot scaling SCALING.csv OUT.png`` (the ``--csv`` of ``bench
scaling``, e.g. written by ``hpc/scaling.sbatch``) and ``python -m ringnet.bench.plot
cluster A.csv [B.csv ...] OUT.png`` (``--csv`` files of ``bench scaling --nodes``).
"""
import argparse
import json
import os

from ringnet.errors import UsageError

__all__ = ["plot_scaling", "plot_cluster", "read_cluster_csv", "plot_comm", "plot_trace", "main"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UsageError("plots need matplotlib: pip install 'ringnet[plot]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_writable(path):
    """Raise UsageError when ``path`` cannot be written (checked before a long benchmark)."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {path}: folder {folder} does not exist or is not writable")
    if not path.lower().endswith((".png", ".svg", ".pdf")):
        raise UsageError(f"plot file {path} must end in .png, .svg or .pdf")
    _pyplot()


def _save(fig, path):
    tmp = f"{path}.tmp{os.getpid()}{os.path.splitext(path)[1]}"
    try:
        fig.savefig(tmp, dpi=80)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _label(mode, delay):
    return mode if mode == "single" else f"{mode} delay {delay}"


def plot_scaling(rows, path, title=""):
    """Speedup and efficiency against N per (mode, delay), with the ideal line."""
    plt = _pyplot()
    series = {}
    base = [r for r in rows if r["mode"] == "single"]
    for r in rows:
        if r["mode"] != "single":
            series.setdefault(_label(r["mode"], r["delay"]), []).append(r)
    ns = sorted({r["np"] for r in rows})
    fig, (ax_s, ax_e) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax_s.plot(ns, ns, "k--", lw=1, label="ideal")
    ax_e.axhline(1.0, color="k", ls="--", lw=1)
    for name, points in series.items():
        own_first = any(p["np"] == 1 for p in points)     # ddp has its own N = 1
        points = ([] if own_first else base) + sorted(points, key=lambda r: r["np"])
        x = [p["np"] for p in points]
        ax_s.plot(x, [p["speedup"] for p in points], "o-", label=name)
        ax_e.plot(x, [p["efficiency"] for p in points], "o-", label=name)
    for ax, what in ((ax_s, "speedup over single"), (ax_e, "efficiency (speedup / N)")):
        ax.set_xlabel("ranks N")
        ax.set_ylabel(what)
        ax.set_xticks(ns)
        ax.grid(alpha=0.3)
    ax_e.set_ylim(0, 1.15)
    ax_s.legend(fontsize=8)
    fig.suptitle(title or "strong scaling", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def read_cluster_csv(path):
    """The rows of a ``bench scaling --nodes ... --csv`` file, with numbers as numbers."""
    import csv
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        return [{"mode": r["mode"], "delay": int(r["delay"]), "nodes": int(r["nodes"]),
                 "ranks_per_node": int(r["ranks_per_node"]), "topology": r.get("topology") or "",
                 "step_ms": float(r["step_ms"]),
                 "exposed_comm_ms": float(r["exposed_comm_ms"] or 0)} for r in rows]
    except (OSError, KeyError, ValueError) as exc:
        raise UsageError(f"cannot read cluster scaling table {path} (bench scaling --nodes "
                         f"--csv): {exc}") from None


def _cluster_label(row):
    """A bar's legend: the mode and delay, and the topology's first letters where given."""
    return _label(row["mode"], row["delay"]) + (f" {row['topology'][:4]}" if row["topology"] else "")


def plot_cluster(panels, path):
    """Step time per (mode, delay, topology) on each layout of nodes, one panel per
    (title, rows); the exposed communication darker at the bottom of each bar."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        layouts = sorted({(r["nodes"], r["ranks_per_node"]) for r in rows if r["mode"] != "single"},
                         key=lambda s: (s[0] * s[1], s[0]))
        labels = list(dict.fromkeys(_cluster_label(r) for r in rows if r["mode"] != "single"))
        width = 0.8 / max(1, len(labels))
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for j, label in enumerate(labels):
            for i, layout in enumerate(layouts):
                got = [r for r in rows if (r["nodes"], r["ranks_per_node"]) == layout
                       and _cluster_label(r) == label]
                if not got:
                    continue
                x = i + (j - (len(labels) - 1) / 2) * width
                colour = colours[j % len(colours)]
                ax.bar(x, got[0]["step_ms"], width, color=colour, alpha=0.45,
                       label=label if i == 0 else None)
                ax.bar(x, min(got[0]["exposed_comm_ms"], got[0]["step_ms"]), width, color=colour)
        single = [r["step_ms"] for r in rows if r["mode"] == "single"]
        if single:
            ax.axhline(single[0], color="k", ls="--", lw=1, label="single, 1 node")
        ax.set_xticks(range(len(layouts)))
        ax.set_xticklabels([f"{k} node{'s' if k > 1 else ''} x {r}" for k, r in layouts])
        ax.set_ylabel("step ms (dark: exposed communication)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_comm(rows, path, title=""):
    """Bus bandwidth (GB/s) against message size per algorithm, log-log."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for algo in dict.fromkeys(r["algo"] for r in rows):
        points = sorted((r["bytes"], r["busbw"]) for r in rows if r["algo"] == algo)
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=algo)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title(title or "all-reduce bus bandwidth", fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


# Colours of span names in trace pictures; anything else is grey.
_COLOURS = {"compute": "#d9d9d9", "data": "#8c8c8c", "forward": "#4c72b0", "backward": "#55a868",
            "loss": "#c44e52", "update": "#dd8452", "wait": "#d62728", "exposed_comm": "#c5b0d5",
            "comm": "#c5b0d5", "transfer": "#6a3d9a"}


def plot_trace(trace, path, steps=3, title=""):
    """A few steps of every rank: a training lane and a communication lane per rank.

    ``trace`` is the dict of a ``--trace`` file (or its path). The window starts at the
    second step span (the first carries start-up costs) and covers ``steps`` steps.
    """
    plt = _pyplot()
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    lanes = {}   # (pid, tid) -> lane label from the thread_name metadata
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    step_spans = sorted((e for e in events if e["name"] == "step" and e["pid"] == 0),
                        key=lambda e: e["ts"])
    if not step_spans:
        raise UsageError("trace has no step spans on rank 0")
    first = step_spans[min(1, len(step_spans) - 1)]
    last = step_spans[min(len(step_spans) - 1, step_spans.index(first) + steps - 1)]
    t0, t1 = first["ts"], last["ts"] + last["dur"]
    used = sorted({(e["pid"], e["tid"]) for e in events})
    rows = {key: i for i, key in enumerate(used)}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(used) + 1.3))
    seen = set()
    # Longest first, so spans nested inside others are drawn on top of them.
    for e in sorted(events, key=lambda e: -e["dur"]):
        if e.get("cat") == "step" or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
            continue
        kind = e.get("cat") or e["name"]
        colour = _COLOURS.get(kind, "#bbbbbb")
        y = rows[(e["pid"], e["tid"])]
        ax.broken_barh([((e["ts"] - t0) / 1000, e["dur"] / 1000)], (y - 0.4, 0.8),
                       facecolors=colour, edgecolor="white", linewidth=0.4,
                       label=None if kind in seen else kind)
        seen.add(kind)
    for s in step_spans:
        if t0 <= s["ts"] <= t1:
            ax.axvline((s["ts"] - t0) / 1000, color="k", lw=0.6, alpha=0.5)
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels([f"rank {pid} {lanes.get((pid, tid), tid)}" for pid, tid in used],
                       fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, (t1 - t0) / 1000)
    ax.set_xlabel("time (ms); vertical lines: step starts on rank 0")
    order = [k for k in _COLOURS if k in seen] + sorted(seen - set(_COLOURS))
    handles = {h.get_label(): h for h in ax.get_legend_handles_labels()[0]}
    ax.legend([handles[k] for k in order], order, fontsize=7, ncol=len(order),
              loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        ax.set_title(title, fontsize=10, pad=22)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ringnet.bench.plot",
                                description="Draw a picture of a --trace file.")
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trace", help="a few steps of every rank from a --trace file")
    t.add_argument("trace", help="the JSON file written by python -m ringnet.train --trace")
    t.add_argument("out", help="picture to write (.png, .svg or .pdf)")
    t.add_argument("--steps", type=int, default=3, help="steps to show (default 3)")
    c = sub.add_parser("scaling", help="speedup and efficiency from a bench scaling --csv file")
    c.add_argument("csv", help="the CSV written by python -m ringnet.bench scaling --csv")
    c.add_argument("out", help="picture to write (.png, .svg or .pdf)")
    c.add_argument("--title", default="", help="title above the plots")
    k = sub.add_parser("cluster", help="step time per mode and topology on each layout of nodes "
                                       "from bench scaling --nodes --csv files, a panel each")
    k.add_argument("files", nargs="+", metavar="CSV",
                   help="the CSV files of python -m ringnet.bench scaling --nodes ... --csv, "
                        "then the picture to write (.png, .svg or .pdf)")
    args = p.parse_args(argv)
    if args.what == "cluster":
        if len(args.files) < 2:
            raise UsageError("plot cluster takes one or more CSV files and the picture to write")
        *tables, args.out = args.files
    check_writable(args.out)
    if args.what == "cluster":
        panels = [(os.path.splitext(os.path.basename(t))[0], read_cluster_csv(t)) for t in tables]
        plot_cluster(panels, args.out)
        print(f"wrote {args.out}", flush=True)
        return 0
    if args.what == "scaling":
        import csv
        try:
            with open(args.csv, newline="") as f:
                rows = [{"mode": r["mode"], "delay": int(r["delay"]), "np": int(r["np"]),
                         "speedup": float(r["speedup"]), "efficiency": float(r["efficiency"])}
                        for r in csv.DictReader(f)]
        except (OSError, KeyError, ValueError) as exc:
            raise UsageError(f"cannot read scaling table {args.csv}: {exc}") from None
        plot_scaling(rows, args.out, title=args.title)
        print(f"wrote {args.out}", flush=True)
        return 0
    try:
        with open(args.trace) as f:
            trace = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read trace {args.trace}: {exc}") from None
    run = trace.get("otherData") or {}
    title = os.path.basename(args.trace)
    if "mode" in run:
        title = (f"{run['mode']} delay {run['delay']}, {run['ranks']} ranks, {run['model']}, "
                 f"global batch {run['batch_size']}, {run['device']}")
    plot_trace(trace, args.out, steps=args.steps, title=title)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    from ringnet.cli import run_main
    run_main(main)
