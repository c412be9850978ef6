"""The tables (ringnet.perfmodel.report): markdown tables have a row per configuration; the
hierarchical rows are printed only where the ranks span nodes, after the flat tables (which
stay as they were)."""
from ringnet import perfmodel as pm
from ringnet.perfmodel import cli

from tests.perfmodel.helpers import run_model_cli


def test_markdown_tables_have_a_row_per_configuration():
    from ringnet.tables import parse_markdown
    rows = [{"model": "lenet", "mode": mode, "delay": d, "np": n, "predicted_ms": 11.0,
             "measured_ms": 10.0 if n == 1 else 12.5} for mode, d in (("single", 0), ("ring", 1))
            for n in (1, 2) if mode != "single" or n == 1]
    header, body = parse_markdown(pm.markdown_validation(rows))
    assert header == ["model", "mode", "N=1 predicted / measured ms", "N=2"]
    assert body == [["lenet", "single d0", "11 / 10 (+10%)", "\u2013"],
                    ["lenet", "ring d1", "11 / 10 (+10%)", "11 / 12.5 (\u221212%)"]]
    proc = run_model_cli("--compute", "k40", "--np", "4", "--table", "paper", "--markdown")
    assert proc.returncode == 0, proc.stderr
    header, body = parse_markdown(proc.stdout)
    assert header[-1] == "reported (ring d1)" and [r[-1] for r in body] == ["3.77", "3.79"]
    proc = run_model_cli("--compute", "k40", "--table", "validation", "--markdown")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("ringnet: error: --table validation")


def test_tables_print_hierarchical_rows_only_where_ranks_span_nodes(capsys):
    args = ["--compute", "k40", "--models", "lenet", "--profile", "pcie3/eth-10g"]
    cli.main(args + ["--np", "1", "2", "4", "8"])
    one_node = capsys.readouterr().out
    assert "hierarchical topology" not in one_node
    cli.main(args + ["--np", "1", "2", "4", "8", "16"])
    spanning = capsys.readouterr().out
    flat, _, hierarchical = spanning.partition("hierarchical topology")
    assert "ring d1 hier" in hierarchical and "tree d0 hier" in hierarchical
    rows = [line.split()[0] for line in hierarchical.splitlines()[1:] if line.strip()[:1].isdigit()]
    assert rows == ["16"]
    cli.main(args + ["--np", "1", "2", "4", "8", "16", "--markdown", "--table", "hierarchical"])
    markdown = capsys.readouterr().out
    assert "ring d1 hierarchical (step, efficiency; residual, between nodes)" in markdown and "x flat; +" in markdown
    cli.main(args + ["--np", "1", "2", "4", "8", "16", "--markdown"])
    assert "hierarchical" not in capsys.readouterr().out      # the predictions table as it was
