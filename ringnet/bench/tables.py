"""Markdown tables of benchmark results: what a benchmark's ``--markdown`` prints, and what
the README shows under the command that printed it (tests/test_docs.py checks the columns)."""

from ringnet.tables import markdown

__all__ = ["layers_table", "comm_table"]


def _size(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def layers_table(results):
    """Return the table of ``python -m ringnet.bench layers --markdown`` from its results."""
    torch = any("torch_step_ms" in r for r in results)
    header = ["model", "step ms"] + (["PyTorch step ms", "ratio"] if torch else []) + \
        ["step CPU ms"] + (["PyTorch CPU ms", "CPU-time ratio"] if torch else []) + \
        ["GEMM floor ms", "CPU / floor"] + (["PyTorch CPU / floor"] if torch else [])
    rows = []
    for r in results:
        row = [f"`{r['model']}`", f"{r['step_ms']:.1f}"]
        if torch:
            row += [f"{r['torch_step_ms']:.1f}", f"{r['ratio_vs_torch']:.2f}"]
        row.append(f"{r['cpu_step_ms']:.1f}")
        if torch:
            row += [f"{r['torch_cpu_step_ms']:.1f}", f"{r['cpu_ratio_vs_torch']:.2f}"]
        row += [f"{r['floor_ms']:.1f}", f"{r['cpu_step_vs_floor']:.2f}"]
        if torch:
            row.append(f"{r['torch_cpu_step_ms'] / r['floor_ms']:.2f}")
        rows.append(row)
    return markdown(header, rows)


def comm_table(rows):
    """Return the table of ``python -m ringnet.bench comm --markdown``: bus bandwidth per size
    and algorithm, and the ring's over the MPI library's own all-reduce where both ran."""
    algos = list(dict.fromkeys(r["algo"] for r in rows))
    by_size = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["algo"]] = r
    both = "ring" in algos and "native" in algos
    header = ["size"] + [f"{a} busbw GB/s" for a in algos] + (["ring / native"] if both else [])
    out = []
    for nbytes, got in by_size.items():
        row = [_size(nbytes)] + [f"{got[a]['busbw']:.3f}" for a in algos]
        if both:    # equal sizes: the ratio of bandwidths is the inverse ratio of times
            row.append(f"{got['native']['time_us'] / got['ring']['time_us']:.2f}")
        out.append(row)
    return markdown(header, out)
