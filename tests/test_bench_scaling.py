"""bench scaling's table: each row's median and the spread of its rounds, from the runs it launched."""
import json
import statistics

import pytest

from ringnet.bench import scaling

from tests.test_docs import _main_output


def _runs(times):
    """Stand in for run_config: each call returns the next step time of its configuration."""
    calls = {}

    def run_config(args, mode, delay, n, **kw):
        key = (mode, delay, n)
        i = calls.get(key, 0)
        calls[key] = i + 1
        return {"step_ms": times[key][i], "comm_wait_s": 0.0, "steps": 30, "overlap": 0.0,
                "bytes_per_step": 0, "fc_params_per_rank": None}
    return run_config


TIMES = {("single", 0, 1): [100.0, 120.0, 90.0],
         ("ring", 1, 2): [50.0, 80.0, 55.0],
         ("ring", 0, 2): [60.0, 60.0, 60.0]}


def test_rows_carry_the_spread_of_their_rounds(monkeypatch):
    monkeypatch.setattr(scaling, "run_config", _runs(TIMES))
    out = _main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "3", "--json"])
    rows = {(r["mode"], r["delay"], r["np"]): r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == set(TIMES)
    for key, times in TIMES.items():
        median = statistics.median(times)
        assert rows[key]["step_ms"] == pytest.approx(median)
        assert rows[key]["spread"] == pytest.approx((max(times) - min(times)) / median, abs=1e-3)
    # speedup against single's median, not its fastest or slowest round
    assert rows[("ring", 1, 2)]["speedup"] == pytest.approx(100.0 / 55.0, abs=1e-3)


def test_plain_table_prints_the_spread(monkeypatch):
    monkeypatch.setattr(scaling, "run_config", _runs(TIMES))
    out = _main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "3"])
    header = next(line for line in out.splitlines() if line.split()[:1] == ["mode"])
    column = header.split().index("spread") - 1        # "step ms" is two words in the header
    lines = {tuple(line.split()[:3]): line.split() for line in out.splitlines()
             if line.split()[:1] in (["single"], ["ring"])}
    assert lines[("single", "0", "1")][column] == "30%"      # (120 - 90) / 100
    assert lines[("ring", "1", "2")][column] == "55%"        # (80 - 50) / 55
    assert lines[("ring", "0", "2")][column] == "0%"
