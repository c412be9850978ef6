"""The model's output: Markdown tables (the README's), the text tables, and the plot."""
import math

from ringnet.perfmodel.sweeps import MODES, mode_label
from ringnet.perfmodel.validation import row_error, row_label
from ringnet.errors import UsageError

__all__ = ["MARKDOWN_TABLES", "PAPER_LABELS", "markdown_predictions", "markdown_paper",
           "markdown_validation", "print_tables", "plot", "markdown_hierarchical",
           "print_hierarchical"]

MARKDOWN_TABLES = ("predictions", "paper", "validation", "hierarchical")
PAPER_LABELS = {"lenet": "LeNet / MNIST", "cifar10_quick": "cifar10_quick / CIFAR-10"}


def _minus(text):
    return text.replace("-", "\u2212")


def _ms(seconds_ms):
    """Milliseconds to three significant digits, never in exponent form."""
    return f"{seconds_ms:.3g}" if seconds_ms < 1000 else f"{seconds_ms:.0f}"


def markdown_predictions(rows, nps):
    """The predictions as one Markdown table: step ms and efficiency per mode, a row per
    (model, profile, N)."""
    from ringnet.tables import markdown
    cols = [md for md in MODES if any((r["mode"], r["delay"]) == md for r in rows)]
    table = {}
    for r in rows:
        table.setdefault((r["model"], r["profile"]), {})[(r["mode"], r["delay"], r["np"])] = r
    out = []
    for (name, profile), got in table.items():
        for n in nps:
            cells = [got.get((md[0], md[1], n)) for md in cols]
            if any(cells):
                out.append([name, profile, n] + [f"{_ms(c['step_ms'])} ms, {c['efficiency']:.2f}"
                                                 if c else "\u2013" for c in cells])
    return markdown(["model", "profile", "N"] + [f"{mode_label(*md)} (step, efficiency)" for md in cols],
                    out)


def markdown_paper(rows):
    """The research's setting: predicted speedup per mode beside the reported one."""
    from ringnet.tables import markdown
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["batch_per_gpu"]), {})[(r["mode"], r["delay"])] = r
    out = []
    for (name, batch), got in by.items():
        cells = [f"**{got[('ring', 1)]['speedup']:.2f}**"]
        cells += [f"{got[md]['speedup']:.2f}" if md in got else "\u2013"
                  for md in (("ring", 0), ("tree", 0), ("master", 0), ("split-fc", 0))]
        out.append([PAPER_LABELS.get(name, name), batch] + cells
                   + [f"{got[('ring', 1)]['reported_speedup']:.2f}"])
    return markdown(["model", "batch per GPU", "ring d1", "ring d0", "tree", "master", "split-fc",
                     "reported (ring d1)"], out)


def markdown_validation(rows):
    """Predicted / measured ms (error) per model and mode, a column per N; the error is the
    median of the rounds' paired errors. Where every row has the prediction at each run's
    own speed: predicted / at the run's speed / measured ms (the error of the first, then
    of the second)."""
    from ringnet.tables import markdown
    from ringnet.perfmodel.validation import row_error_at_run
    at_run = all(row_error_at_run(r) is not None for r in rows)
    nps = sorted({r["np"] for r in rows})
    by = {}
    for r in rows:
        by.setdefault((r["model"], row_label(r)), {})[r["np"]] = r
    out = []
    for (name, label), got in by.items():
        cells = []
        for n in nps:
            r = got.get(n)
            if r is None:
                cells.append("\u2013")
                continue
            err = 100 * row_error(r)
            if at_run:
                cells.append(_minus(f"{_ms(r['predicted_ms'])} / {_ms(r['at_run_ms'])} / "
                                    f"{_ms(r['measured_ms'])} ({err:+.0f}%, "
                                    f"{100 * row_error_at_run(r):+.0f}%)"))
            else:
                cells.append(_minus(f"{_ms(r['predicted_ms'])} / {_ms(r['measured_ms'])} ({err:+.0f}%)"))
        out.append([name, label] + cells)
    first = ("predicted / at the run's speed / measured ms (errors)" if at_run
             else "predicted / measured ms")
    header = ["model", "mode"] + [f"N={n} {first}" if i == 0 else f"N={n}"
                                  for i, n in enumerate(nps)]
    return markdown(header, out)


def print_tables(rows, batch, scaling, nps):
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["profile"]), {})[(r["mode"], r["delay"], r["np"])] = r
    for (name, profile), table in by.items():
        cols = [md for md in MODES if any((md[0], md[1], n) in table for n in nps)]
        per = "per rank" if scaling == "weak" else "global"
        print(f"\n# {name}, profile {profile}, {scaling} scaling, batch {batch} {per}: "
              "step ms / speedup / efficiency")
        _print_rows(table, cols, nps, "", lambda r: "")


def _print_rows(table, cols, nps, tag, mark):
    """A text table's column header and its rows: step ms, speedup, efficiency per column
    (``tag`` after each column's label, ``mark(row)`` after each cell)."""
    width = 22 + len(mark({"step_ms": 0, "flat_ms": 0})) if cols else 22
    print(f"{'N':>5} " + " ".join(f"{mode_label(*md) + tag:>{width}}" for md in cols))
    for n in nps:
        cells = []
        for md in cols:
            r = table.get((md[0], md[1], n))
            cells.append(f"{r['step_ms']:9.3g} {r['speedup']:6.3g} {r['efficiency']:5.2f}{mark(r)}"
                         if r else f"{'-':>{width}}")
        if any(c.strip() != "-" for c in cells):
            print(f"{n:>5} " + " ".join(f"{c:>{width}}" for c in cells))


def _by_table(rows):
    by = {}
    for r in rows:
        by.setdefault((r["model"], r["profile"]), {})[(r["mode"], r["delay"], r["np"])] = r
    return by


def _hierarchical_columns(table):
    from ringnet.perfmodel.topology import HIERARCHICAL_MODES
    return [md for md in HIERARCHICAL_MODES if any(k[:2] == md for k in table)]


def print_hierarchical(rows, batch, scaling, nps):
    """The hierarchical exchange's text tables, where the ranks span nodes (``*``: faster than
    the flat exchange at that N)."""
    for (name, profile), table in _by_table(rows).items():
        cols = _hierarchical_columns(table)
        per = "per rank" if scaling == "weak" else "global"
        print(f"\n# {name}, profile {profile}, {scaling} scaling, batch {batch} {per}, hierarchical "
              "topology where the ranks span nodes (ring: every rank of a node in its channel between "
              "nodes; tree: one leader per node): step ms / speedup / efficiency, * faster than flat")
        _print_rows(table, cols, nps, " hier", lambda r: "*" if r["step_ms"] < r["flat_ms"] else " ")
        print("# each row's floor (one rank's step alone, no exchange), what the exchange leaves on "
              "the step, and the algorithm between nodes")
        for n in nps:
            cells = [table.get((md[0], md[1], n)) for md in cols]
            if any(cells):
                print(f"# {n:>5}: floor {cells[0]['floor_ms'] if cells[0] else 0:.3g} ms; " + "; ".join(
                    f"{mode_label(*md)} +{c['residual_ms']:.3g} ms ({c['between']})"
                    for md, c in zip(cols, cells) if c))
        print("# assumed: alpha per message as the profile's links (spec-sheet latency + the stated "
              "software cost), one link between nodes per rank (the channels do not share a link), "
              "delay 1 overlapping the whole exchange with the next step's compute, and each add of "
              "the exchange a kernel on the compute's device; a node link shared by its ranks, or "
              "an exchange slower than the compute, breaks the delay-1 rows")


def markdown_hierarchical(rows, nps):
    """The hierarchical exchange as a Markdown table: step ms, efficiency and the step against
    the flat exchange's, a row per (model, profile, N) where the ranks span nodes."""
    from ringnet.tables import markdown
    out, cols = [], []
    for (name, profile), table in _by_table(rows).items():
        cols = cols or _hierarchical_columns(table)
        for n in nps:
            cells = [table.get((md[0], md[1], n)) for md in cols]
            if any(cells):
                floor = next(c for c in cells if c)["floor_ms"]
                out.append([name, profile, n, f"{_ms(floor)} ms"] + [
                    f"{_ms(c['step_ms'])} ms, {c['efficiency']:.2f} ({c['step_ms'] / c['flat_ms']:.2f}x "
                    f"flat; +{_ms(c['residual_ms'])} ms, {c['between']})"
                    if c else "\u2013" for c in cells])
    return markdown(["model", "profile", "N", "floor"]
                    + [f"{mode_label(*md)} hierarchical (step, efficiency; residual, between nodes)"
                       for md in cols], out)


def plot(rows, path, title):
    """Step time, speedup and efficiency against N: one row of panels per model."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install -e \".[plot]\"") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    styles = ["-", "--", ":", "-."]
    colors = dict(zip([mode_label(*md) for md in MODES], plt.cm.tab10.colors))
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for i, name in enumerate(models):
        for j, (key, ylabel) in enumerate((("step_ms", "step time (ms)"), ("speedup", "speedup"),
                                            ("efficiency", "efficiency"))):
            ax = axes[i][j]
            for k, profile in enumerate(profiles):
                for md in MODES:
                    pts = sorted((r["np"], r[key]) for r in rows if r["model"] == name
                                 and r["profile"] == profile and (r["mode"], r["delay"]) == md)
                    if len(pts) < 2:
                        continue
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, styles[k % len(styles)], color=colors[mode_label(*md)],
                            marker=".", label=f"{mode_label(*md)}, {profile}")
            ax.set_xscale("log", base=2)
            if key != "efficiency":
                ax.set_yscale("log")
            ax.set_xlabel("ranks N")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{name}: {ylabel}")
            ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * math.ceil(len(labels) / 4), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
