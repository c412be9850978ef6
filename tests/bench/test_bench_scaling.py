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


def test_one_round_has_no_spread(monkeypatch):
    """--repeats 1: the spread is unknown ("-" and null), not 0%."""
    monkeypatch.setattr(scaling, "run_config", _runs(TIMES))
    out = _main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "1"])
    header = next(line for line in out.splitlines() if line.split()[:1] == ["mode"])
    column = header.split().index("spread") - 1
    cells = [line.split()[column] for line in out.splitlines()
             if line.split()[:1] in (["single"], ["ring"])]
    assert cells and all(c == "-" for c in cells)
    monkeypatch.setattr(scaling, "run_config", _runs(TIMES))
    out = _main_output(scaling.main, ["--np", "1", "2", "--modes", "ring", "--repeats", "1", "--json"])
    assert all(r["spread"] is None for r in json.loads(out.strip().splitlines()[-1])["rows"])


# single at the global batch and at each N's per-rank batch, by round; and a parallel row
CEILING_TIMES = {("single", 64): [100.0, 120.0, 90.0], ("single", 32): [60.0, 55.0, 50.0],
                 ("single", 16): [40.0, 30.0, 35.0], ("ring", 2): [70.0, 70.0, 65.0],
                 ("ring", 4): [50.0, 45.0, 40.0]}


def _ceiling_runs(launched):
    """Stand in for run_config, keyed by (mode, global batch) or (mode, N); records each launch."""
    calls = {}

    def run_config(args, mode, delay, n, batch=None, **kw):
        key = (mode, batch or args.batch_size) if mode == "single" else (mode, n)
        launched.append((mode, delay, n, batch or args.batch_size))
        i = calls.get(key, 0)
        calls[key] = i + 1
        return {"step_ms": CEILING_TIMES[key][i], "comm_wait_s": 0.0, "steps": 30,
                "overlap": 0.0, "bytes_per_step": 0, "fc_params_per_rank": None}
    return run_config


def test_the_ceiling_is_single_at_the_per_rank_batch(monkeypatch, tmp_path):
    """--ceiling: t(B) / t(B/N) from single runs at batch B/N taken in every round, and each
    row's share of it; the CSV carries the new columns."""
    launched = []
    monkeypatch.setattr(scaling, "run_config", _ceiling_runs(launched))
    csv_path = tmp_path / "s.csv"
    out = _main_output(scaling.main, ["--np", "1", "2", "4", "--modes", "ring", "--delays", "1",
                                      "--repeats", "3", "--ceiling", "--json",
                                      "--csv", str(csv_path)])
    doc = json.loads(out.strip().splitlines()[-1])
    base = statistics.median(CEILING_TIMES[("single", 64)])
    for n, batch in ((2, 32), (4, 16)):
        expected = base / statistics.median(CEILING_TIMES[("single", batch)])
        row = next(r for r in doc["rows"] if r["mode"] == "ring" and r["np"] == n)
        assert row["ceiling"] == pytest.approx(expected, abs=1e-3)
        speedup = base / statistics.median(CEILING_TIMES[("ring", n)])
        assert row["of_ceiling"] == pytest.approx(speedup / expected, abs=1e-3)
        entry = next(c for c in doc["ceiling"] if c["np"] == n)
        assert entry["batch_per_rank"] == batch and entry["ceiling"] == pytest.approx(expected, abs=1e-3)
    single = next(r for r in doc["rows"] if r["mode"] == "single")
    assert "ceiling" not in single and len(doc["rows"]) == 3      # the ceiling runs are no rows
    # every round runs each configuration once, the ceiling runs as single ranks at B/N
    rounds = [launched[i:i + 5] for i in range(0, 15, 5)]
    assert all(r == rounds[0] for r in rounds)
    assert sorted(rounds[0]) == sorted([("single", 0, 1, 64), ("ring", 1, 2, 64), ("ring", 1, 4, 64),
                                        ("single", 0, 1, 32), ("single", 0, 1, 16)])
    header = csv_path.read_text().splitlines()[0].split(",")
    assert header[-2:] == ["ceiling", "of_ceiling"]


def test_the_ceiling_table_names_shared_cores(monkeypatch):
    """The plain table prints the ceiling columns, and says when N ranks outnumber the cores."""
    monkeypatch.setattr(scaling, "run_config", _ceiling_runs([]))
    monkeypatch.setattr(scaling.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = _main_output(scaling.main, ["--np", "1", "2", "4", "--modes", "ring", "--delays", "1",
                                      "--repeats", "3", "--ceiling"])
    base = statistics.median(CEILING_TIMES[("single", 64)])
    lines = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("# ceiling")}
    assert f"= {base / 55.0:.2f}x" in lines["# ceiling at N=2"]
    assert "share" not in lines["# ceiling at N=2"]
    assert "4 ranks share this machine's 2 cores" in lines["# ceiling at N=4"]
    row = next(line.split() for line in out.splitlines() if line.split()[:3] == ["ring", "1", "2"])
    speedup = base / 70.0
    assert row[-2:] == [f"{base / 55.0:.2f}", f"{100 * speedup / (base / 55.0):.0f}%"]


def test_a_ceiling_run_is_launched_at_the_per_rank_batch(monkeypatch):
    """run_config's batch reaches train's command line."""
    from ringnet import jobs
    seen = []
    monkeypatch.setattr(jobs, "run_json", lambda cmd, *a, **kw: seen.append(cmd) or {})
    args = scaling.build_parser().parse_args(["--batch-size", "64"])
    scaling.run_config(args, "single", 0, 1, batch=16)
    scaling.run_config(args, "ring", 1, 2)
    assert [cmd[cmd.index("--batch-size") + 1] for cmd in seen] == ["16", "64"]


def test_weak_scaling_keeps_the_per_rank_batch(monkeypatch):
    """--scaling weak: each run at N ranks gets a global batch of N x --batch-size, and its
    speedup is its images/s over single's at --batch-size (N x t_single / t_row)."""
    launched = []
    weak = {("single", 16): [100.0, 110.0, 90.0], ("ring", 2): [120.0, 110.0, 130.0],
            ("ring", 4): [140.0, 150.0, 130.0]}

    def run_config(args, mode, delay, n, batch=None, **kw):
        launched.append((mode, int(n), batch or args.batch_size))
        key = (mode, batch) if mode == "single" else (mode, int(n))
        return {"step_ms": weak[key][sum(1 for m, k, _ in launched if (m, k) == (mode, int(n))) - 1],
                "comm_wait_s": 0.0, "steps": 30, "overlap": 0.0, "bytes_per_step": 0,
                "fc_params_per_rank": None}
    monkeypatch.setattr(scaling, "run_config", run_config)
    out = _main_output(scaling.main, ["--np", "1", "2", "4", "--modes", "ring", "--delays", "1",
                                      "--batch-size", "16", "--scaling", "weak", "--repeats", "3",
                                      "--json"])
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["scaling"] == "weak"
    assert sorted(set(launched)) == [("ring", 2, 32), ("ring", 4, 64), ("single", 1, 16)]
    rows = {(r["mode"], r["np"]): r for r in doc["rows"]}
    assert rows[("ring", 4)]["batch"] == 64
    assert rows[("ring", 4)]["images_per_sec"] == pytest.approx(64 / 140.0 * 1000, abs=0.1)
    assert rows[("ring", 4)]["speedup"] == pytest.approx(4 * 100.0 / 140.0 + 0, abs=1e-3)
    assert rows[("ring", 2)]["efficiency"] == pytest.approx(100.0 / 120.0, abs=1e-3)
    assert rows[("single", 1)]["speedup"] == pytest.approx(1.0)
    # the Markdown table of a weak-scaling run has the images/s its speedup is made of
    launched.clear()
    out = _main_output(scaling.main, ["--np", "1", "2", "4", "--modes", "ring", "--delays", "1",
                                      "--batch-size", "16", "--scaling", "weak", "--repeats", "3",
                                      "--markdown"])
    header = next(l for l in out.splitlines() if l.startswith("| mode"))
    assert "| step ms | images/s | speedup |" in header
    ring4 = next(l for l in out.splitlines() if l.startswith("| ring | 1 | 4 |"))
    assert f"| {64 / 140.0 * 1000:.0f} | {4 * 100.0 / 140.0:.2f} |" in ring4


def test_weak_scaling_bad_input():
    """Weak scaling has no --ceiling (its ceiling is N); an unknown --scaling is one line."""
    from ringnet.errors import UsageError
    with pytest.raises(UsageError, match="--ceiling is strong scaling's"):
        scaling.main(["--np", "1", "2", "--scaling", "weak", "--ceiling"])
    with pytest.raises(UsageError, match="--scaling: invalid choice: 'sideways'"):
        scaling.main(["--np", "1", "2", "--scaling", "sideways"])


def test_weak_scaling_needs_no_divisible_batch(monkeypatch):
    """Strong scaling splits --batch-size over N, weak scaling does not: 10 at N = 4 runs."""
    monkeypatch.setattr(scaling, "run_config", lambda args, mode, delay, n, batch=None, **kw: {
        "step_ms": 10.0 * (batch or args.batch_size) / 10, "comm_wait_s": 0.0, "steps": 30,
        "overlap": 0.0, "bytes_per_step": 0, "fc_params_per_rank": None})
    doc = json.loads(_main_output(scaling.main, ["--np", "1", "4", "--modes", "ring", "--delays", "0",
                                                 "--batch-size", "10", "--scaling", "weak", "--repeats",
                                                 "1", "--json"]).strip().splitlines()[-1])
    assert {r["np"]: r["batch"] for r in doc["rows"]} == {1: 10, 4: 40}
    from ringnet.errors import UsageError
    with pytest.raises(UsageError, match="not divisible by N"):
        scaling.main(["--np", "1", "4", "--modes", "ring", "--batch-size", "10", "--repeats", "1"])
