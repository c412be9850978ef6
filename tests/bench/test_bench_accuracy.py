"""Accuracy-over-time reporting: train --eval-every, bench scaling --to-accuracy, bench curves."""
import csv
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from ringnet.bench import curves, delay, scaling
from ringnet.config import TrainConfig
from ringnet.errors import UsageError
from ringnet.train import train

ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
QUIET = dict(progress=False, quiet=True, eval_every_epoch=False)


def test_eval_every_lists_accuracy_at_fixed_steps():
    result = train(TrainConfig(model="digits", steps=9, eval_every=4, **QUIET), world=MPI.COMM_SELF)
    evals = result.summary["evals"]
    assert [e[0] for e in evals] == [4, 8, 9]            # every 4 steps, and the end
    spe = 1437 // 64
    assert [e[1] for e in evals] == [round(s / spe, 4) for s in (4, 8, 9)]
    seconds = [e[2] for e in evals]
    assert seconds == sorted(seconds) and seconds[0] > 0
    assert seconds[-1] <= result.summary["train_s"]
    assert evals[-1][3] == result.summary["test_accuracy"]
    # an evaluation in the middle sees the weights of that step: a run of 4 steps ends there
    short = train(TrainConfig(model="digits", steps=4, **QUIET), world=MPI.COMM_SELF)
    assert evals[0][3] == short.summary["test_accuracy"]
    assert "evals" not in short.summary


def test_first_reaching():
    evals = [[10, 0.5, 1.0, 0.6], [20, 1.0, 2.0, 0.81], [30, 1.5, 3.0, 0.79], [40, 2.0, 4.0, 0.9]]
    assert scaling.first_reaching(evals, 0.8) == (1.0, 2.0)
    assert scaling.first_reaching(evals, 0.9) == (2.0, 4.0)
    assert scaling.first_reaching(evals, 0.95) is None


def test_curve_runs_are_parsed():
    runs = curves.parse_runs("single,ring:1,ring:1:none,tree,split-fc:1", 2)
    assert [(r[1], r[2], r[3], r[4]) for r in runs] == [
        ("single", 0, 1, []), ("ring", 1, 2, []),
        ("ring", 1, 2, ["--delay-compensation", "none"]), ("tree", 0, 2, []),
        ("split-fc", 1, 2, [])]
    assert runs[2][0] == "ring d1 (none)"
    for bad in ("ring:2", "single:1", "star", ""):
        with pytest.raises(UsageError):
            curves.parse_runs(bad, 2)


def test_delay_variants_are_checked():
    assert delay.parse_variant("pred:2+mom:0.98") == {"pred": 2.0, "mom": 0.98}
    for bad in ("pred", "foo:1", "pred:x"):
        with pytest.raises(UsageError):
            delay.parse_variant(bad)
    from ringnet.parallel import COMPENSATIONS
    from ringnet.parallel.delayed_update import Lookahead
    assert delay.engine_variant("lookahead") is COMPENSATIONS["lookahead"]
    assert delay.engine_variant("none") is COMPENSATIONS["none"]
    assert delay.engine_variant("single") is None
    assert delay.engine_variant("lookahead/warm=30/k=5") == Lookahead(k=5.0, c=2.0, warmup=30)
    assert delay.engine_variant("lookahead/c=1.5") == Lookahead(k=None, c=1.5, warmup=None)
    assert delay.engine_variant("lookahead/warm=0") == Lookahead(k=None, c=2.0, warmup=0)
    for bad in ("lookahead/warm=1.5", "lookahead/k=0", "lookahead/x=1", "none/k=2",
                "single/warm=3", "lookahead/k=-1", "lookahead/k=nan"):
        with pytest.raises(UsageError):
            delay.engine_variant(bad)


def test_delay_own_gradient_prediction_against_its_recurrence():
    """own:N: each of N simulated ranks computes on its shard at w[t-1] - (mu v[t-1] +
    lr (g_r[t-1] + wd w[t-1])), its prediction of w[t] (v kept here as a buffer; the bench
    rebuilds it from the weights); own:1 is synchronous SGD."""
    from ringnet.models import build_model
    lr, mu, wd, steps = 0.05, 0.9, 5e-4, 6
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 1, 8, 8)), rng.integers(0, 10, size=8)) for _ in range(steps)]

    def bench(variant):
        model = build_model("digits", dtype="float64", seed=1)
        runner = (delay._Engine if variant == "single" else delay._WrittenOut)(
            model, variant if variant == "single" else delay.parse_variant(variant), lr, mu, wd,
            "float64")
        for it, (x, y) in enumerate(batches):
            runner.step(x, y, it)
        return np.array(runner.eval_model().params)

    def reference(n):
        model = build_model("digits", dtype="float64", seed=1)
        w, v, own = model.params.copy(), np.zeros(model.num_params), None
        w_prev, v_prev = w, v
        for t, (x, y) in enumerate(batches):
            grads = []
            for r in range(n):
                model.params[...] = w if t == 0 else w_prev - (mu * v_prev + lr * (own[r] + wd * w_prev))
                model.loss_and_grad(x[r * 8 // n:(r + 1) * 8 // n], y[r * 8 // n:(r + 1) * 8 // n])
                grads.append(model.grads.copy())
            own = grads
            w_prev, v_prev = w, v
            v = mu * v + lr * (sum(grads) / n + wd * w)
            w = w - v
        return w

    single = bench("single")
    assert np.max(np.abs(bench("own:1") - single)) <= 1e-10 * np.max(np.abs(single))
    assert np.max(np.abs(reference(1) - single)) <= 1e-10 * np.max(np.abs(single))
    for n in (2, 4):
        own = bench(f"own:{n}")
        assert np.max(np.abs(own - reference(n))) <= 1e-10 * np.max(np.abs(single)), n
        assert np.max(np.abs(own - single)) > 1e-6 * np.max(np.abs(single)), n  # not synchronous
    for bad in ("own:0", "own:1.5", "own:-2"):
        with pytest.raises(UsageError):
            delay.parse_variant(bad)


def test_delay_loss_metric_tells_descent_from_divergence():
    """--metric loss: no test evaluation; a run that descends is ok, one that blows up
    (the plain recurrence at lr 0.3, momentum 0.9 on digits: 3.04 -> about 5) "grew"."""
    ok = delay.run("digits", "digits", "single", 0.03, 0.9, epochs=0.5, seed=0, metric="loss")
    assert ok["status"] == "ok" and ok["train_loss"] < ok["first_loss"], ok
    assert ok["test_accuracy"] != ok["test_accuracy"]       # NaN: the test set was not read
    bad = delay.run("digits", "digits", "none", 0.3, 0.9, epochs=0.5, seed=0, metric="loss")
    assert bad["status"] == "grew" and bad["train_loss"] > 1.05 * bad["first_loss"], bad


@pytest.mark.parametrize("losses, status", [
    ([2.30, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], "ok"),          # descended
    ([2.30, 2.31, 2.30, 2.32, 2.31, 2.30, 2.31, 2.32], "dead"),  # flat: not below, within 5%
    ([2.30, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], "grew"),         # blew up without NaN
    ([2.30, 2.5, 3.0, 4.0, 5.0, float("inf"), 7.0, 8.0], "div@5"),
])
def test_delay_loss_metric_states_and_their_table_cells(monkeypatch, losses, status):
    """The late quarter's mean against the first step's loss decides ok / dead (flat) / grew
    (more than 5% above it) / div@S, and each shows as its own cell in both tables."""
    class Scripted:             # the training steps stood in for by a loss sequence
        def __init__(self, model, *args):
            self.model = model

        def step(self, x, y, it):
            return losses[it]

        def eval_model(self):
            return self.model
    monkeypatch.setattr(delay, "_Engine", Scripted)
    r = delay.run("digits", "digits", "single", 0.01, 0.9, epochs=8 / 22, seed=0, metric="loss")
    assert r["steps"] == 8 and r["status"] == status, r
    rows = {("single", 0.01, 0.9): [r], ("none", 0.01, 0.9): [dict(r, status="ok")]}
    seeds = delay.seeds_table(rows, "loss").splitlines()[2]
    sweep = delay.sweep_table(rows, "loss").splitlines()[2]
    cell = {"ok": f"{r['train_loss']:.3f}", "dead": "no descent", "grew": "loss grew",
            "div@5": "diverged at step 5"}[status]
    assert seeds.startswith(f"| single | {cell} |"), seeds
    part = {"ok": f"{r['train_loss']:.3g}", "dead": "–", "grew": "grew", "div@5": "–"}[status]
    assert sweep.startswith(f"| 0.01 | {part} / "), sweep
    # one seed that diverged outweighs one whose loss grew: the sweep shows "–"
    rows[("single", 0.01, 0.9)] = [dict(r, status="grew"), dict(r, status="div@3")]
    assert delay.sweep_table(rows, "loss").splitlines()[2].startswith("| 0.01 | – / ")


def test_delay_bench_separates_plain_from_compensated_on_lenet():
    """LeNet, lr 0.01, momentum 0.9: the plain delayed update diverges, the compensated one
    does not (without the default's warm-up, which is longer than these 64 steps)."""
    rows = {v: delay.run("lenet", "synthetic", v, 0.01, 0.9, epochs=2, seed=0)
            for v in ("single", "none", "lookahead/warm=0")}
    assert rows["single"]["status"] == "ok" and rows["single"]["test_accuracy"] >= 0.95
    assert rows["none"]["status"].startswith("div@"), rows["none"]
    assert rows["lookahead/warm=0"]["status"] == "ok", rows
    assert rows["lookahead/warm=0"]["test_accuracy"] >= 0.95, rows


@pytest.mark.timeout(900)
def test_default_compensation_is_stable_where_single_is_on_lenet_lr_0_03():
    """LeNet, lr 0.03, momentum 0.9: single converges, so must the default delay 1 (its
    compensated recurrence: no warm-up here, the default's would cover all 64 steps).

    The former fixed k = 5 (momentum 0.98, lr/5, c 2, written out here) diverges there:
    its stable range on a quadratic is lr*h < 1.3 against synchronous SGD's 3.8.
    """
    rows = {v: delay.run("lenet", "synthetic", v, 0.03, 0.9, epochs=2, seed=0)
            for v in ("single", "lookahead/warm=0", "pred:2+mom:0.98+lrs:0.2")}
    assert rows["single"]["status"] == "ok" and rows["single"]["test_accuracy"] >= 0.95
    assert rows["lookahead/warm=0"]["status"] == "ok", rows
    assert rows["lookahead/warm=0"]["test_accuracy"] >= 0.95, rows
    assert rows["pred:2+mom:0.98+lrs:0.2"]["status"].startswith("div@"), rows


@pytest.mark.timeout(900)
def test_curves_and_to_accuracy_end_to_end(tmp_path):
    out_csv, out_png = tmp_path / "c.csv", tmp_path / "c.png"
    try:
        import matplotlib  # noqa: F401
        plot = str(out_png)
    except ImportError:         # the CSV is still checked; the plot needs the plot extra
        plot = ""
    proc = subprocess.run(
        [sys.executable, "-m", "ringnet.bench", "curves", "--model", "digits", "--dataset", "digits",
         "--epochs", "2", "--np", "2", "--runs", "single,ring:1,ring:1:none", "--eval-every", "11",
         "--csv", str(out_csv), "--plot", plot],
        capture_output=True, text=True, env=ENV, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    labels = sorted({r["label"] for r in rows})
    assert labels == ["ring d1", "ring d1 (none)", "single"]
    for label in labels:
        mine = [r for r in rows if r["label"] == label]
        assert [int(r["step"]) for r in mine] == [11, 22, 33, 44]   # 22 steps per epoch
        assert all(0 <= float(r["test_accuracy"]) <= 1 for r in mine)
        times = [float(r["train_s"]) for r in mine]
        assert times == sorted(times)
    if plot:
        assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in proc.stdout
    # the CSV read back gives the same rows, and the summary from it without training
    back = curves.read_csv([str(out_csv)])
    assert [(r["label"], r["step"], r["test_accuracy"]) for r in back] == \
        [(r["label"], int(r["step"]), float(r["test_accuracy"])) for r in rows]
    again = subprocess.run([sys.executable, "-m", "ringnet.bench", "curves", "--from-csv",
                            str(out_csv), "--markdown"],
                           capture_output=True, text=True, env=ENV, timeout=120)
    assert again.returncode == 0 and again.stdout.startswith("| run |"), again.stderr

    proc = subprocess.run(
        [sys.executable, "-m", "ringnet.bench", "scaling", "--np", "1", "--model", "digits",
         "--dataset", "digits", "--to-accuracy", "0.5", "--epochs", "1", "--eval-every", "5",
         "--repeats", "1", "--json"],
        capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    row = json.loads(proc.stdout.strip().splitlines()[-1])["rows"][0]
    assert row["mode"] == "single"
    # evaluated at steps 5, 10, 15, 20 and at the end (22 steps per epoch)
    assert row["epochs_to_acc"] in [round(s / 22, 3) for s in (5, 10, 15, 20, 22)]
    assert 0 < row["seconds_to_acc"] and row["final_accuracy"] >= 0.5


def _curve(label, accs, seconds=10.0):
    return [{"label": label, "mode": label.split()[0], "delay": 0, "np": 2, "step": 10 * e,
             "epoch": float(e), "train_s": seconds * e, "test_accuracy": a}
            for e, a in enumerate(accs, 1)]


def test_curves_summary_table_from_rows():
    rows = _curve("single", [0.80, 0.85, 0.86, 0.90, 0.88, 0.89]) + _curve("ring d1", [0.7, 0.9])
    from ringnet.tables import parse_markdown
    header, body = parse_markdown(curves.summary_table(rows))
    # first, second, middle (3 of 6) and last evaluated epochs
    assert header == ["run", "epoch 1", "epoch 2", "epoch 3", "epoch 6", "best (epoch)", "training s"]
    assert body[0] == ["single", "80.00%", "85.00%", "86.00%", "89.00%", "90.00% (4)", "60"]
    assert body[1] == ["ring d1", "70.00%", "90.00%", "–", "–", "90.00% (2)", "20"]


def test_a_short_curves_run_reads_in_round_epochs_and_real_seconds():
    # 22 steps an epoch, evaluated every 5 steps, 0.4 s of training in all
    rows = [{"label": "single", "mode": "single", "delay": 0, "np": 1, "step": s,
             "epoch": round(s / 22, 4), "train_s": 0.02 * s, "test_accuracy": 0.5 + s / 100}
            for s in (5, 10, 15, 20)]
    from ringnet.tables import parse_markdown
    header, body = parse_markdown(curves.summary_table(rows))
    # first, second, middle (the second again) and last
    assert header == ["run", "epoch 0.23", "epoch 0.45", "epoch 0.91", "best (epoch)", "training s"]
    assert body[0][-2:] == ["70.00% (0.91)", "0.40"]


def test_curves_from_csv_joins_and_refuses_bad_files(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    curves._write_csv(str(a), _curve("single", [0.8, 0.9]))
    curves._write_csv(str(b), _curve("tree d0", [0.7, 0.95]))
    joined = tmp_path / "j.csv"
    proc = subprocess.run([sys.executable, "-m", "ringnet.bench", "curves", "--from-csv", str(a),
                           str(b), "--csv", str(joined), "--markdown"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [r["label"] for r in curves.read_csv([str(joined)])] == ["single"] * 2 + ["tree d0"] * 2
    assert "| tree d0 | 70.00% | 95.00% | 95.00% (2) | 20 |" in proc.stdout
    (tmp_path / "bad.csv").write_text("label,mode\nx,y\n")
    for bad in (str(tmp_path / "bad.csv"), str(tmp_path / "missing.csv")):
        proc = subprocess.run([sys.executable, "-m", "ringnet.bench", "curves", "--from-csv", bad],
                              capture_output=True, text=True, env=ENV, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("ringnet: error: cannot read"), proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.timeout(900)
def test_delay_speed_prints_interleaved_ratio():
    """bench delay --speed: none, lookahead and warm-up alternate, ratio lines per N."""
    proc = subprocess.run(
        [sys.executable, "-m", "ringnet.bench", "delay", "--speed", "--model", "digits",
         "--dataset", "digits", "--steps", "3", "--repeats", "2", "--np", "1", "2"],
        capture_output=True, text=True, env=ENV, timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert sum("ring delay 1, mpirun -np" in line for line in out) == 2, proc.stdout
    ratios = [line for line in out if "ratio lookahead / none: median" in line]
    assert len(ratios) == 2, proc.stdout
    assert sum("ratio warm-up / lookahead: median" in line for line in out) == 2, proc.stdout
    warmups = [line for line in out if "the default warm-up (100 synchronous steps" in line]
    assert [line.split("N=")[1][0] for line in warmups] == ["1", "2"], proc.stdout
    for name in ("none", "lookahead", "warm-up"):
        rows = [line.split() for line in out if line.split()[:1] == [name]]
        assert len(rows) == 2 and all(len(r) == 5 for r in rows), proc.stdout   # 2 rounds each
        assert all(float(v) > 0 for r in rows for v in (r[1], r[3], r[4]))
    assert sum("step boundary and update alone" in line for line in out) == 1, proc.stdout
    assert [line.split("N=")[1][0] for line in out if "extra / ring delay 1 step" in line] == ["1", "2"]


def test_delay_speed_refuses_bad_values():
    from conftest import assert_one_line_error, run_cli
    assert_one_line_error(run_cli("delay", "--speed", "--np", "0", module="ringnet.bench"), "--np")
    assert_one_line_error(run_cli("delay", "--speed", "--np", "5", module="ringnet.bench"),
                          "not divisible")
