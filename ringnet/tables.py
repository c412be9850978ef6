"""Markdown tables: what a program's ``--markdown`` prints (a benchmark's, the performance
model's), and the reading of them back out of text (tests/test_docs.py checks the README's
tables' columns with it)."""

__all__ = ["markdown", "parse_markdown", "parse_markdown_tables"]


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
