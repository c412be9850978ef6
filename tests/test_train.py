"""python -m ringnet.train end to end: accuracy, checkpoints, resume, and bad input."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.backend import to_numpy
from ringnet.checkpoint import load_checkpoint
from ringnet.config import TrainConfig
from ringnet.train import train

from conftest import ENV, assert_one_line_error, run_cli

QUIET = dict(progress=False, quiet=True, eval_every_epoch=False)


def test_default_run_reaches_95_percent_and_reports_json():
    proc = run_cli("--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "single" and summary["ranks"] == 1
    assert summary["model"] == "digits" and summary["dataset"] == "digits"
    assert summary["test_accuracy"] >= 0.95, summary
    spe = 1437 // 64
    assert summary["steps"] == 20 * spe
    for key in ("train_loss", "images_per_sec", "time_s", "compute_s", "comm_wait_s",
                "update_s", "data_s", "bytes_sent", "overlap"):
        assert key in summary
    assert summary["bytes_sent"] == 0 and summary["train_loss"] < 0.5


@pytest.mark.parametrize("readings, expected", [((10.0, 12.5), 2.5), ((None, 3.0), None),
                                                ((4.0, None), None)])
def test_summary_gives_the_control_group_s_cpu_over_the_loop(monkeypatch, readings, expected):
    # the group's CPU is read once before the loop and once after it: the summary holds
    # the difference, null where either reading failed
    from ringnet import placement
    left = list(readings)
    monkeypatch.setattr(placement, "group_cpu_s", lambda: left.pop(0))
    cfg = TrainConfig(model="digits", dataset="digits", batch_size=32, seed=1, **QUIET)
    summary = train(cfg, world=MPI.COMM_SELF, steps=3).summary
    assert left == [] and summary["group_cpu_s"] == expected


def test_summary_gives_the_median_and_the_mean_step_of_the_steps_after_the_first_two():
    # every step span, as the statistics publish it: the summary's two figures are the
    # median and the mean of all but the first two (compilation, first touches)
    import statistics
    from ringnet import stats
    durations = []
    unsubscribe = stats.subscribe(lambda e: durations.append(e.duration) if e.name == "step" else None)
    try:
        cfg = TrainConfig(model="digits", dataset="digits", batch_size=32, seed=1, **QUIET)
        summary = train(cfg, world=MPI.COMM_SELF, steps=9).summary
    finally:
        unsubscribe()
    assert len(durations) == 9
    kept = durations[2:]
    assert summary["step_ms"] == pytest.approx(1e3 * statistics.median(kept), rel=1e-12)
    assert summary["step_mean_ms"] == pytest.approx(1e3 * statistics.fmean(kept), rel=1e-12)
    assert summary["step_mean_ms"] != summary["step_ms"]


def _weights(result):
    return np.array(to_numpy(result.strategy.eval_model().params))


def test_checkpoint_round_trip_and_exact_resume(tmp_path):
    cfg = TrainConfig(model="digits", dataset="digits", batch_size=32, dtype="float64",
                      seed=5, **QUIET)
    whole = train(cfg, world=MPI.COMM_SELF, steps=70)        # crosses an epoch (44 steps)
    path = tmp_path / "ck.h5"
    first = train(cfg, world=MPI.COMM_SELF, steps=30, save=str(path))
    params, momentum, prev, attrs = load_checkpoint(str(path))
    named = first.strategy.eval_model().named_params()
    for name, value in named.items():
        np.testing.assert_array_equal(params[name], to_numpy(value), err_msg=name)
    assert attrs["step"] == 30 and attrs["model"] == "digits" and attrs["mode"] == "single"
    assert set(momentum) == set(params) and any(np.abs(m).max() > 0 for m in momentum.values())
    assert params["conv1.weight"].ndim == 4            # PyTorch layout (out, in, kh, kw)
    resumed = train(cfg, world=MPI.COMM_SELF, steps=70, resume=str(path))
    np.testing.assert_array_equal(_weights(resumed), _weights(whole))
    assert resumed.summary["steps"] == 70


def test_failed_run_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "good.h5"
    proc = run_cli("--steps", "3", "--save", str(path), "--quiet")
    assert proc.returncode == 0, proc.stderr
    before = path.read_bytes()
    proc = run_cli("--steps", "40", "--lr", "1e9", "--save", str(path), "--quiet")
    assert proc.returncode != 0
    assert "loss is" in proc.stderr and "diverged" in proc.stderr
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["good.h5"]


@pytest.mark.parametrize("args, needles", [
    (["--model", "resnet"], ["unknown model", "resnet"]),
    (["--model", "lenet", "--dataset", "digits"], ["1x8x8", "1x28x28"]),
    (["--dataset", "/nonexistent/x.h5"], ["/nonexistent/x.h5"]),
    (["--dataset", "mnist", "--data-dir", "/nonexistent"], ["python -m ringnet.datasets download mnist"]),
    (["--batch-size", "0"], ["batch-size"]),
    (["--lr", "-1"], ["--lr"]),
    (["--delay", "1"], ["delay"]),
    (["--resume", "/nonexistent/ck.h5"], ["/nonexistent/ck.h5"]),
    (["--epochs", "x"], ["--epochs"]),
])
def test_bad_input_exits_2_with_one_line(args, needles):
    assert_one_line_error(run_cli(*args, "--steps", "1") if "--epochs" not in args else run_cli(*args),
                          *needles)


def test_corrupt_data_file_exits_2(tmp_path):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(os.urandom(4096))
    assert_one_line_error(run_cli("--dataset", str(bad), "--steps", "1"), str(bad))
    wrong = tmp_path / "wrong.h5"
    with h5py.File(wrong, "w") as f:
        f.create_dataset("train/images", data=np.zeros((4, 1, 8, 8), np.uint8))
    assert_one_line_error(run_cli("--dataset", str(wrong), "--steps", "1"), str(wrong))


def test_batch_not_divisible_exits_2_on_every_rank():
    proc = run_cli("--batch-size", "64", "--steps", "1", np_=3, timeout=120)
    assert_one_line_error(proc, "64", "3 ranks")


def test_single_mode_under_mpirun_is_refused():
    proc = run_cli("--mode", "single", "--steps", "1", np_=2, timeout=120)
    assert_one_line_error(proc, "single")


def test_mpirun_default_is_ring_and_replicas_agree():
    proc = run_cli("--steps", "12", "--json", "--quiet", "--check-every", "4", np_=2, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "ring" and summary["delay"] == 1 and summary["ranks"] == 2
    # ring traffic per rank per step: reduce-scatter + all-gather, each (N-1)/N of the model
    itemsize = 4
    expected = 2 * (1 / 2) * summary["num_params"] * itemsize
    assert abs(summary["bytes_per_step"] - expected) <= 0.01 * expected


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _running(pid):
    """True while ``pid`` is a live (not zombie) ringnet rank."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and "ringnet.train" in _cmdline(pid)


def test_a_rank_dying_ends_the_whole_job_promptly(tmp_path):
    """kill -9 of one rank in the training loop ends the whole job, non-zero, within a
    bound, and no rank outlives it. Each rank writes its own pid to a file (``exec`` keeps
    it), and the kill comes once the first periodic checkpoint exists: no search of the
    process table, no sleep standing in for "training has started"."""
    import signal
    import time
    ck = tmp_path / "ck.h5"
    pid_files = [tmp_path / f"pid.{rank}" for rank in (0, 1)]
    rank_cmd = (f'echo $$ > "{tmp_path}/pid.$PMI_RANK" && exec "{sys.executable}" -m ringnet.train '
                f'--steps 100000 --quiet --no-progress --save "{ck}" --save-every 1')
    proc = subprocess.Popen(["mpirun", "-np", "2", "sh", "-c", rank_cmd], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 180
        while not (ck.exists() and all(f.exists() and f.read_text().strip() for f in pid_files)):
            if proc.poll() is not None:
                pytest.fail(f"the job ended before training: exit {proc.returncode}\n"
                            f"{proc.stderr.read()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint within 180 s: the ranks did not reach training")
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in pid_files]
        assert all(_running(pid) for pid in pids), [_cmdline(pid) for pid in pids]
        os.kill(pids[1], signal.SIGKILL)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the job still runs 60 s after one of its ranks was killed")
        assert proc.returncode != 0
        end = time.monotonic() + 10             # a killed rank may await its reaping a moment
        while any(_running(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(0.1)
        survivors = [pid for pid in pids if _running(pid)]
        assert not survivors, f"ranks {survivors} outlived the job"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("np_", [None, 2])
def test_unwritable_save_path_is_refused_before_training(tmp_path, np_):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_cli("--epochs", "50", "--save", str(blocker / "ck.h5"), np_=np_, timeout=120)
    assert_one_line_error(proc, "cannot write checkpoint", "is not a folder")
    assert "epoch" not in proc.stdout                    # refused before any training
    assert_one_line_error(run_cli("--steps", "1", "--save", str(tmp_path)), "it is a folder")


def test_losses_are_read_every_k_steps_and_checked_at_the_read():
    from ringnet.errors import DivergedError
    from ringnet.stats import LossReads
    reads = LossReads(1, 10, 0.01)                     # the CPU: every step, on its own
    assert reads.add(0, 2.5) == [(0, 2.5)] and reads.pending == []
    with pytest.raises(DivergedError, match=r"^loss is nan at step 12 \(epoch 2\): training "
                                            r"diverged; try a lower --lr \(now 0.01\)$"):
        reads.add(12, float("nan"))
    reads = LossReads(3, 10, 0.1)                      # a GPU: three steps, one read
    held = [np.asarray(v, dtype=np.float32) for v in (1.0, 0.5, np.inf, 0.25)]
    assert reads.add(20, held[0]) == [] and reads.add(21, held[1]) == []
    with pytest.raises(DivergedError, match=r"loss is inf at step 22 \(epoch 3; losses of "
                                            r"steps 20-22 read together\)"):
        reads.add(22, held[2])
    assert reads.add(23, held[3]) == [] and reads.read() == [(23, 0.25)] and reads.read() == []


def test_progress_lines_under_several_ranks_say_the_loss_is_rank_0s():
    """Rank 0 prints the lines from its own losses: its share of the global batch, not the
    mean over every rank of the epoch line, and the label says so."""
    import io
    from ringnet.progress import Progress
    out = io.StringIO()
    p = Progress(total=5, initial=0, batch_size=8, steps_per_epoch=5, interactive=False,
                 interval=1e9, file=out, clock=iter(range(100)).__next__, ranks=2)
    for step, loss in zip(range(1, 6), (1.0, 2.0, 3.0, 4.0, 6.0)):
        p.update(step, loss)
    [line] = out.getvalue().splitlines()
    assert "  loss 3.2000 (rank 0, mean of last 5 steps)  " in line, line
    out = io.StringIO()
    p = Progress(total=2, initial=0, batch_size=8, steps_per_epoch=5, interactive=False,
                 interval=0, file=out, clock=iter(range(100)).__next__, ranks=2)
    p.update(1, 0.5)
    assert "  loss 0.5000 (rank 0, last step)  " in out.getvalue(), out.getvalue()


def test_progress_writes_whole_lines():
    """Each progress line is one write, its newline included, so that a Ctrl-C can not
    leave it open for the rank's 'interrupted' line to be joined to."""
    from ringnet.progress import Progress

    class Writes:
        def __init__(self):
            self.calls = []

        def write(self, text):
            self.calls.append(text)

        def flush(self):
            pass
    out = Writes()
    p = Progress(total=3, initial=0, batch_size=8, steps_per_epoch=3, interactive=False,
                 interval=0, file=out, clock=iter(range(100)).__next__)
    for step in (1, 2, 3):
        p.update(step, 0.5)
    assert len(out.calls) == 3 and all(c.startswith("step ") and c.endswith("\n")
                                       and c.count("\n") == 1 for c in out.calls), out.calls


CTRL_C_DURING_PROGRESS = """
import sys
from ringnet.cli import run_main
from ringnet.progress import Progress

def main(argv):
    p = Progress(total=10**9, initial=0, batch_size=8, steps_per_epoch=10**9,
                 interactive=False, interval=0)
    step = 0
    while True:
        step += 1
        p.update(step, 0.25)

run_main(main)
"""


def test_ctrl_c_while_progress_lines_are_written_leaves_the_interrupted_line_whole():
    # The child writes progress lines into a pipe nobody reads until it is full, and blocks
    # in a write; SIGINT then lands inside the writing of a line. The exit's line must
    # still stand alone, as launchers and ringnet.launch look for it.
    import signal
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", CTRL_C_DURING_PROGRESS], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert proc.stderr.readline().startswith(b"step "), "no progress line"
            time.sleep(0.05)                # the pipe fills; the child blocks in a write
            proc.send_signal(signal.SIGINT)
            lines = proc.stderr.read().decode().splitlines()
            assert proc.wait(timeout=30) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert lines[-1] == "ringnet: error: interrupted", lines[-3:]
        assert all(l.startswith("step ") and "ringnet" not in l for l in lines[:-1])
