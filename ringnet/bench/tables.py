"""Markdown tables of benchmark results: what a benchmark's ``--markdown`` prints, and what
the README shows under the command that printed it (tests/test_docs.py checks the columns)."""

__all__ = ["markdown", "parse_markdown", "parse_markdown_tables", "layers_table", "comm_table"]


def markdown(header, rows):
    """Return a Markdown table: ``header`` is the column titles, ``rows`` the cells of each row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def parse_markdown(text):
    """Return ``(header, rows)`` of the first Markdown table in ``text`` (cells stripped)."""
    lines = [line.strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table[0], table[2:]


def parse_markdown_tables(text):
    """Return ``[(caption, header, rows)]`` for every Markdown table in ``text``; a table's
    caption is the text lines just above it (joined with spaces, "" when none)."""
    lines = [line.strip() for line in text.splitlines()]
    tables, caption, gap, i = [], [], False, 0
    while i < len(lines):
        if not lines[i].startswith("|"):        # a blank line ends a paragraph
            if lines[i]:
                caption, gap = (caption if not gap else []) + [lines[i]], False
            else:
                gap = True
            i += 1
            continue
        end = i
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        header, rows = parse_markdown("\n".join(lines[i:end]))
        tables.append((" ".join(caption), header, rows))
        caption, gap, i = [], False, end
    return tables


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
