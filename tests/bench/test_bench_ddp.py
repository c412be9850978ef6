"""bench scaling --vs ddp: the PyTorch DDP driver trains ringnet's problem (checked against
ringnet's synchronous master mode, float64), and the table's ddp rows and ratios."""
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import pytest

from ringnet.bench import scaling

from tests.conftest import launcher_free_env
from tests.test_docs import _main_output

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(launcher_free_env(), OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
           PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
# a recipe whose lr changes every two steps: Caffe's momentum update (ringnet's) and
# PyTorch's own SGD part ways there, so the driver must run ringnet's
RECIPE = ["--model", "digits", "--dataset", "digits", "--steps", "6", "--batch-size", "32",
          "--dtype", "float64", "--lr", "0.05", "--lr-policy", "step", "--stepsize", "2",
          "--gamma", "0.5", "--no-eval"]


def _run(cmd, cwd):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_ddp_at_two_ranks_ends_with_master_mode_s_weights(tmp_path):
    """DDP over gloo at N = 2 and ringnet's master mode at N = 2, each launched by mpirun on
    the same model, data, global batch and recipe: the same weights after 6 steps (float64,
    up to summation order), though the weights moved far from their start."""
    pytest.importorskip("torch")
    from ringnet.checkpoint import load_checkpoint
    from ringnet.models import build_model
    ddp = _run(["mpirun", "-np", "2", sys.executable, "-m", "ringnet.bench.ddp", *RECIPE,
                "--json", "--quiet", "--save-weights", "ddp.npz"], tmp_path)
    ours = _run(["mpirun", "-np", "2", sys.executable, "-m", "ringnet.train", *RECIPE, "--mode",
                 "master", "--json", "--quiet", "--no-progress", "--save", "master.h5"], tmp_path)
    theirs = np.load(tmp_path / "ddp.npz")
    mine = load_checkpoint(str(tmp_path / "master.h5"))[0]
    start = build_model("digits", dtype="float64", seed=0).state()
    assert set(theirs.files) == set(mine) == set(start)
    for name, w in mine.items():
        moved = np.max(np.abs(w - start[name]))
        assert moved > 1e-3, name
        assert np.max(np.abs(theirs[name] - w)) <= 1e-9 * moved, name
    assert (ddp["mode"], ddp["ranks"], ddp["transport"], ddp["steps"]) == ("ddp", 2, "gloo", 6)
    assert ddp["test_accuracy"] == ours["test_accuracy"]
    assert ddp["step_ms"] > 0 and ddp["images_per_sec"] > 0


# step times by (mode, delay, N), one per round
TIMES = {("single", 0, 1): [100.0, 110.0], ("ddp", 0, 1): [90.0, 95.0],
         ("ring", 1, 2): [50.0, 60.0], ("ddp", 0, 2): [80.0, 70.0]}


def _stand_in(launched, times=TIMES, evals=None):
    """run_config's stand-in: each call returns its configuration's next step time."""
    calls = {}

    def run_config(args, mode, delay, n, **kw):
        key = (mode, delay, n)
        launched.append(key)
        i = calls.get(key, 0)
        calls[key] = i + 1
        summary = {"step_ms": times[key][i % len(times[key])], "comm_wait_s": 0.01, "steps": 30, "overlap": 0.5,
                   "bytes_per_step": 1000, "fc_params_per_rank": None, "test_accuracy": 0.9}
        if mode == "ddp":
            summary.update(comm_wait_s=None, overlap=None, bytes_per_step=None, torch_threads=1)
        if evals is not None:
            summary["evals"] = evals[key]
        return summary
    return run_config


def test_the_table_has_a_ddp_row_per_n_and_each_row_s_ratio_to_it(monkeypatch):
    launched = []
    monkeypatch.setattr(scaling, "run_config", _stand_in(launched))
    monkeypatch.setattr(scaling, "_require_peer", lambda: None)
    argv = ["--np", "1", "2", "--modes", "ring", "--delays", "1", "--repeats", "2", "--vs", "ddp"]
    doc = json.loads(_main_output(scaling.main, argv + ["--json"]).strip().splitlines()[-1])
    rows = {(r["mode"], r["delay"], r["np"]): r for r in doc["rows"]}
    assert set(rows) == set(TIMES)
    median = {k: statistics.median(v) for k, v in TIMES.items()}
    for (mode, delay, n), row in rows.items():
        assert row["step_ms"] == pytest.approx(median[(mode, delay, n)])
        # DDP's step time at the row's N over the row's own
        assert row["vs_ddp"] == pytest.approx(median[("ddp", 0, n)] / median[(mode, delay, n)],
                                              abs=1e-3)
    assert rows[("ring", 1, 2)]["vs_ddp"] == pytest.approx(75.0 / 55.0, abs=1e-3)
    assert rows[("ddp", 0, 2)]["exposed_comm_ms"] is None       # not measured, not zero
    # interleaved: every round runs each configuration once, DDP beside ringnet at each N
    assert launched[:4] == launched[4:8] == [("single", 0, 1), ("ddp", 0, 1), ("ring", 1, 2),
                                             ("ddp", 0, 2)]
    from ringnet.tables import parse_markdown
    header, table = parse_markdown(_main_output(scaling.main, argv + ["--markdown"]))
    assert header[-1] == "DDP step / step"
    shown = {(r[0], r[2]): r[-1] for r in table}
    assert shown[("ring", "2")] == f"{75.0 / 55.0:.2f}" and shown[("ddp", "2")] == "1.00"
    assert shown[("single", "1")] == f"{92.5 / 105.0:.2f}"
    plain = _main_output(scaling.main, argv).splitlines()
    head = next(line for line in plain if line.split()[:1] == ["mode"])
    assert head.rstrip().endswith("vs DDP")
    ring = next(line.split() for line in plain if line.split()[:3] == ["ring", "1", "2"])
    assert ring[-1] == f"{75.0 / 55.0:.2f}"


def test_time_to_accuracy_has_ddp_s_row_and_the_ratio_of_seconds(monkeypatch):
    evals = {("single", 0, 1): [[10, 0.5, 8.0, 0.5], [20, 1.0, 16.0, 0.95]],
             ("ddp", 0, 1): [[10, 0.5, 6.0, 0.96], [20, 1.0, 12.0, 0.97]],
             ("ring", 1, 2): [[10, 0.5, 4.0, 0.95], [20, 1.0, 8.0, 0.97]],
             ("ddp", 0, 2): [[10, 0.5, 5.0, 0.2], [20, 1.0, 10.0, 0.3]]}
    times = {k: [v[0]] for k, v in TIMES.items()}
    monkeypatch.setattr(scaling, "run_config", _stand_in([], times, evals))
    monkeypatch.setattr(scaling, "_require_peer", lambda: None)
    argv = ["--np", "1", "2", "--modes", "ring", "--delays", "1", "--repeats", "1", "--vs", "ddp",
            "--to-accuracy", "0.9"]
    doc = json.loads(_main_output(scaling.main, argv + ["--json"]).strip().splitlines()[-1])
    rows = {(r["mode"], r["np"]): r for r in doc["rows"]}
    assert rows[("ddp", 1)]["seconds_to_acc"] == 6.0
    assert rows[("single", 1)]["vs_ddp_to_acc"] == pytest.approx(6.0 / 16.0, abs=1e-3)
    assert rows[("ddp", 2)]["seconds_to_acc"] is None            # DDP did not get there at N=2
    assert rows[("ring", 2)]["vs_ddp_to_acc"] is None
    from ringnet.tables import parse_markdown
    header, table = parse_markdown(_main_output(scaling.main, argv + ["--markdown"]))
    assert header[-1] == "DDP s / s to 90%"
    assert [r[-1] for r in table] == [f"{6.0 / 16.0:.2f}", "1.00", "–", "–"]


def test_the_ddp_run_gets_the_problem_of_the_ringnet_runs(monkeypatch):
    """run_config launches the driver under the same mpirun with the same model, data,
    batch, length, lr, seed and device."""
    from ringnet import jobs
    seen = []
    monkeypatch.setattr(scaling, "run_json", lambda cmd, *a, **kw: seen.append(cmd) or {})
    monkeypatch.setattr(jobs, "run_json", lambda cmd, *a, **kw: seen.append(cmd) or {})
    args = scaling.build_parser().parse_args(["--model", "lenet", "--batch-size", "32", "--steps",
                                              "7", "--lr", "0.02", "--seed", "3", "--vs", "ddp"])
    scaling.run_config(args, "ddp", 0, 2)
    scaling.run_config(args, "ring", 1, 2)
    ddp, ring = seen
    assert ddp[:6] == ring[:3] + [sys.executable, "-m", "ringnet.bench.ddp"]
    for flag in ("--model", "--dataset", "--batch-size", "--steps", "--lr", "--seed", "--device"):
        assert ddp[ddp.index(flag) + 1] == ring[ring.index(flag) + 1], flag
    assert "--json" in ddp and "--no-eval" in ddp


def _hidden_torch(tmp_path):
    folder = tmp_path / "no_torch"
    folder.mkdir()
    (folder / "torch.py").write_text('raise ImportError("No module named torch")\n')
    return dict(ENV, PYTHONPATH=os.pathsep.join([str(folder), ENV["PYTHONPATH"]]))


@pytest.mark.parametrize("cmd", [["-m", "ringnet.bench", "scaling", "--vs", "ddp", "--np", "1", "2"],
                                 ["-m", "ringnet.bench.ddp", "--steps", "1"]],
                         ids=["scaling", "driver"])
def test_without_torch_vs_ddp_says_how_to_install_it_in_one_line(tmp_path, cmd):
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                          env=_hidden_torch(tmp_path), timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["ringnet: error: --vs ddp needs PyTorch, which is not installed: pip install "
                     "torch==2.13.0 (the CPU build; or pip install -e \".[bench]\")"], proc.stderr
    assert "{" not in proc.stdout                    # no run was launched


def test_a_short_vs_ddp_run_end_to_end(tmp_path):
    """The real thing, shortened: one round at N = 1, 2, a ddp row at each N, its ratio."""
    pytest.importorskip("torch")
    doc = _run([sys.executable, "-m", "ringnet.bench", "scaling", "--np", "1", "2", "--modes",
                "ring", "--delays", "1", "--model", "digits", "--dataset", "digits", "--steps", "4",
                "--repeats", "1", "--vs", "ddp", "--json"], tmp_path)
    rows = {(r["mode"], r["np"]): r for r in doc["rows"]}
    assert set(rows) == {("single", 1), ("ddp", 1), ("ring", 2), ("ddp", 2)}
    for (mode, n), row in rows.items():
        assert row["vs_ddp"] == pytest.approx(rows[("ddp", n)]["step_ms"] / row["step_ms"], rel=1e-2)
    assert doc["threads_ran"] == {"ringnet": [1], "ddp": [1]}
    assert doc["blas"]["env"].keys() == {"OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"}


def test_the_documented_vs_ddp_commands_are_scaling_s_and_unset_the_kernel_variables():
    """docs/benchmarks.md shows --vs ddp as a user's machine runs it (env -u both OpenBLAS
    variables, which tests/test_docs.py does not pick up as a command): each line is one
    bench scaling accepts."""
    import shlex
    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    lines = [line for line in text.splitlines() if "--vs ddp" in line and line.startswith("env ")]
    assert len(lines) == 3, lines
    for line in lines:
        argv = shlex.split(line)
        assert argv[:6] == ["env", "-u", "OPENBLAS_CORETYPE", "-u", "OPENBLAS_L2_SIZE", "python"]
        args = scaling.build_parser().parse_args(argv[argv.index("scaling") + 1:])
        assert args.vs == "ddp" and args.markdown
        scaling._check(args)
