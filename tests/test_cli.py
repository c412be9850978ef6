"""The command line as a new user meets it: help, output lines, resume settings, class counts.

Each test runs the real entry point (a subprocess, under mpirun where the behaviour depends
on the rank count) and asserts on what it printed or computed, against a second run or a
value worked out here.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from ringnet.checkpoint import HYPERPARAMETERS, load_checkpoint
from ringnet.config import DEFAULTS, MODEL_DEFAULTS, TrainConfig, build_parser, synopsis
from ringnet.data import write_dataset
from ringnet.train import train

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
QUIET = dict(progress=False, quiet=True, eval_every_epoch=False)


def run(cmd, timeout=300, env=None, merge=False, **kw):
    return subprocess.run(cmd, capture_output=not merge, text=True, env=env or ENV,
                          timeout=timeout, cwd=ROOT,
                          **(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT) if merge else {}),
                          **kw)


def train_cli(*args, np_=None, **kw):
    cmd = [sys.executable, "-m", "ringnet.train", *args]
    if np_:
        cmd = ["mpirun", "-np", str(np_), *cmd]
    return run(cmd, **kw)


def one_line_error(proc, *needles, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringnet: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]


def _hidden(tmp_path, module):
    """Return an env in which ``import module`` fails, as on a machine without it."""
    folder = tmp_path / f"no_{module}"
    folder.mkdir()
    (folder / f"{module}.py").write_text(f'raise ImportError("No module named {module}")\n')
    return dict(ENV, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT),
                                                 ENV.get("PYTHONPATH", "")]))


# --- help and synopsis ---------------------------------------------------------------

def test_every_flag_has_help_with_its_default():
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert action.help, f"{flag} has no help text"
        if action.nargs != 0 and flag not in ("--save", "--resume"):
            assert "default" in action.help.lower(), f"{flag}: help does not say its default"
    for name, value in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        action = next(a for a in build_parser()._actions if flag in a.option_strings)
        assert f"default {value:g}" in action.help if not isinstance(value, str) \
            else f"default {value}" in action.help, (flag, action.help)


def test_help_lists_the_per_model_defaults_and_its_examples_parse():
    proc = train_cli("--help")
    assert proc.returncode == 0
    for model, d in MODEL_DEFAULTS.items():
        epilog = proc.stdout.split("Per-model defaults")[1]
        line = next((l for l in epilog.splitlines() if l.strip().startswith(model + " ")), "")
        assert f"--dataset {d['dataset']}" in line and f"--lr {d['lr']:g}" in line \
            and f"--epochs {d['epochs']}" in line, (model, line)
    examples = [l.strip() for l in proc.stdout.split("Examples:")[1].splitlines() if l.strip()]
    assert len(examples) >= 4
    for example in examples:                 # the examples themselves run in test_docs.py
        argv = example.split("ringnet.train")[1].split()
        build_parser().parse_args(argv)


def test_readme_synopsis_is_the_parsers():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```\n(python -m ringnet\.train \[.*?)\n```", readme, re.S)
    assert block, "README has no synopsis block"
    assert block.group(1) == synopsis(), (
        "README's synopsis differs from the parser; paste the output of\n"
        "  python -c 'from ringnet.config import synopsis; print(synopsis())'")


# --- output lines ----------------------------------------------------------------------

def test_json_is_a_whole_line_even_with_stderr_merged_under_mpirun():
    proc = train_cli("--epochs", "2", "--batch-size", "128", "--json", "--no-progress", np_=2,
                     merge=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    # Every line arrives whole, and the JSON comes last: rank 0 prints it only once the
    # launcher has read everything it wrote to stderr (mpirun forwards the two separately).
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    objects = [l for l in lines if l.startswith("{")]
    assert len(objects) == 1 and lines[-1] == objects[0], lines
    summary = json.loads(objects[0])
    assert summary["steps"] == 2 * (1437 // 128) and summary["ranks"] == 2
    others = [l for l in lines if not l.startswith("{")]
    assert [l.split()[0] for l in others] == ["ringnet:", "epoch", "epoch", "done:"], others
    assert not any("{" in l for l in others), others


def test_json_file_holds_the_json_summary_and_the_log_stays_on_stdout(tmp_path):
    path = tmp_path / "out" / "summary.json"                # a missing folder is made
    proc = train_cli("--model", "digits", "--steps", "4", "--json", "--json-file", str(path),
                     "--no-progress", np_=2, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(path.read_text()) == printed and printed["steps"] == 4
    assert sorted(os.listdir(path.parent)) == ["summary.json"]          # no temporary left
    proc = train_cli("--model", "digits", "--steps", "4", "--json-file", str(path),
                     "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].startswith("ringnet: ") and "{" not in proc.stdout
    assert json.loads(path.read_text())["ranks"] == 1                   # replaced whole


@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_bad_json_file_is_one_line_before_training(tmp_path, where):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    path = tmp_path / "file" / "s.json" if where == "under a file" else tmp_path / "folder"
    proc = train_cli("--model", "digits", "--steps", "2", "--json-file", str(path), np_=2)
    one_line_error(proc, "--json-file", "is not a folder" if where == "under a file"
                   else "give a file name such as summary.json")
    assert sorted(os.listdir(tmp_path)) == ["file", "folder"] and not os.listdir(tmp_path / "folder")


def test_json_is_the_last_line_under_mpirun_with_stderr_merged():
    # Before the summary waited for the launcher to read stderr, `done:` came after the JSON
    # in about half of such runs; five in a row catch that with probability > 0.95.
    for _ in range(5):
        proc = train_cli("--model", "digits", "--steps", "4", "--json", "--no-progress",
                         np_=2, merge=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        last = proc.stdout.strip().splitlines()[-1]
        assert json.loads(last)["steps"] == 4, proc.stdout[-3000:]


def test_every_epoch_has_its_line_and_done_reports_the_losses():
    proc = train_cli("--epochs", "3", "--batch-size", "128", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    log = proc.stderr.splitlines()                    # under --json the log is on stderr
    epochs = [l for l in log if l.startswith("epoch")]
    assert [int(l.split()[1]) for l in epochs] == [1, 2, 3]
    last = epochs[-1]
    assert f"{100 * summary['test_accuracy']:6.2f}%" in last
    done = next(l for l in log if l.startswith("done:"))
    assert f"train loss {summary['train_loss']:.4f}" in done
    assert f"test loss {summary['test_loss']:.4f}" in done
    assert "{" not in proc.stderr                     # the JSON only on stdout


def test_diverging_run_is_one_line_without_warnings():
    proc = train_cli("--steps", "40", "--lr", "1e9", "--quiet")
    one_line_error(proc, "loss is", "diverged", "--lr", code=3)
    assert "Warning" not in proc.stderr and "Traceback" not in proc.stderr


# --- default batch at any N -------------------------------------------------------------

@pytest.mark.parametrize("np_, batch", [(3, 63), (6, 66)])
def test_default_batch_is_the_nearest_multiple_of_n(np_, batch):
    proc = train_cli("--steps", "2", "--json", "--no-progress", "--no-eval", np_=np_, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["batch_size"] == batch
    assert f"global batch {batch} (the default 64 rounded to a multiple of {np_} ranks)" \
        in proc.stderr


# --- resume ----------------------------------------------------------------------------

def _weights(result):
    return np.array(result.strategy.eval_model().params)


def test_resume_continues_with_the_checkpoints_hyperparameters(tmp_path):
    """Settings not repeated on the command line come from the checkpoint: same weights."""
    recipe = dict(batch_size=32, lr=0.05, momentum=0.8, weight_decay=1e-3, lr_policy="step",
                  gamma=0.5, stepsize=10, seed=3)
    base = TrainConfig(model="digits", dataset="digits", dtype="float64", **QUIET)
    whole = train(base, world=MPI.COMM_SELF, steps=30, **recipe)
    path = tmp_path / "sub" / "ck.h5"                   # --save creates the folder
    train(base, world=MPI.COMM_SELF, steps=12, save=str(path), **recipe)
    attrs = load_checkpoint(str(path))[3]
    assert {k: attrs[k] for k in recipe} == recipe
    assert set(HYPERPARAMETERS) <= set(attrs)
    resumed = train(base, world=MPI.COMM_SELF, steps=30, resume=str(path))
    np.testing.assert_array_equal(_weights(resumed), _weights(whole))
    assert resumed.summary["batch_size"] == 32
    # The same through the command line: it says what it took and what a flag overrode.
    proc = train_cli("--steps", "14", "--resume", str(path), "--lr", "0.01", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    note = next(l for l in proc.stdout.splitlines() if l.startswith("resuming"))
    assert f"from {path} at step 12" in note
    assert "--batch-size 32" in note and "--momentum 0.8" in note and "--seed 3" in note
    assert "overridden: --lr 0.01 (checkpoint: 0.05)" in note
    header = next(l for l in proc.stdout.splitlines() if l.startswith("ringnet:"))
    assert "global batch 32" in header and "steps 12 to 14 (2 to run)" in header


def test_resume_with_nothing_left_to_run_is_refused(tmp_path):
    path = tmp_path / "ck.h5"
    assert train_cli("--steps", "5", "--save", str(path), "--quiet").returncode == 0
    one_line_error(train_cli("--steps", "3", "--resume", str(path)),
                   "already at step 5", "--steps 3")


def test_resume_of_a_batch_that_n_cannot_split_says_how(tmp_path):
    path = tmp_path / "ck.h5"
    assert train_cli("--steps", "2", "--save", str(path), "--quiet").returncode == 0
    proc = train_cli("--steps", "4", "--resume", str(path), np_=3, timeout=300)
    one_line_error(proc, "global batch 64", "3 ranks", "--batch-size")


# --- class counts -------------------------------------------------------------------------

def _subset(tmp_path, classes, size=None):
    with h5py.File(ROOT / "datasets" / "digits.h5") as f:
        parts = [f[s][k][()] for s in ("train", "test") for k in ("images", "labels")]
    keep = [parts[1] < classes, parts[3] < classes]
    images = [parts[0][keep[0]], parts[2][keep[1]]]
    if size:                                          # nearest-neighbour enlargement
        images = [np.repeat(im, 3, 1).repeat(size // 8, 2).repeat(size // 8, 3)
                  for im in images]
    path = tmp_path / f"d{classes}.h5"
    write_dataset(path, images[0], parts[1][keep[0]], images[1], parts[3][keep[1]],
                  classes=[str(c) for c in range(classes)], name=f"digits{classes}")
    return path


def test_last_layer_follows_the_class_count(tmp_path):
    path = _subset(tmp_path, 3)
    result = train(TrainConfig(model="digits", dataset=str(path), steps=30, **QUIET),
                   world=MPI.COMM_SELF)
    assert result.model.named_params()["ip2.weight"].shape == (3, 64)
    assert result.summary["test_accuracy"] > 0.9
    proc = train_cli("--dataset", str(path), "--steps", "1", "--no-progress")
    assert "3 outputs: one per class" in proc.stdout


def test_carnet_takes_a_five_class_image_set(tmp_path):
    path = _subset(tmp_path, 5, size=64)
    result = train(TrainConfig(model="carnet", dataset=str(path), steps=2, batch_size=16, **QUIET),
                   world=MPI.COMM_SELF)
    assert result.model.named_params()["ip2.weight"].shape == (5, 256)


def test_default_data_set_missing_says_what_to_do(tmp_path):
    proc = train_cli("--model", "lenet", "--steps", "1", "--data-dir", str(tmp_path))
    one_line_error(proc, "python -m ringnet.datasets download mnist",
                   "default data set of model lenet", "--dataset synthetic")


# --- benchmarks, scripts --------------------------------------------------------------------

def test_bench_vs_torch_without_torch_says_how_to_get_it(tmp_path):
    proc = run([sys.executable, "-m", "ringnet.bench", "layers", "--vs", "torch"],
               env=_hidden(tmp_path, "torch"))
    one_line_error(proc, '.[bench]', "torch==2.13.0")


@pytest.mark.parametrize("args, needle", [
    (["--delays", "x"], "--delays"), (["--delays", "0,2"], "--delays"),
    (["--repeats", "0"], "--repeats"), (["--steps", "0"], "--steps"),
    (["--np", "x"], "--np"), (["--lr", "nan"], "--lr"),
    (["--ceiling", "--to-accuracy", "0.9"], "--ceiling"),
])
def test_bench_scaling_bad_arguments(args, needle):
    proc = run([sys.executable, "-m", "ringnet.bench", "scaling", *args], timeout=60)
    one_line_error(proc, needle)


def test_make_digits_without_scikit_learn(tmp_path):
    proc = run([sys.executable, "datasets/make_digits.py", "--out", str(tmp_path / "d.h5")],
               env=_hidden(tmp_path, "sklearn"))
    one_line_error(proc, "scikit-learn")
    assert os.listdir(tmp_path) == ["no_sklearn"]


@pytest.mark.parametrize("args, env, needle", [
    (["-n"], {}, "-n needs a positive rank count"),
    (["-n", "x"], {}, "-n needs a positive rank count"),
    (["-n", "2"], {"MPIRUN": "nosuch-launcher"}, "launcher 'nosuch-launcher' not found"),
])
def test_local_launcher_arguments(args, env, needle):
    proc = run(["bash", "launch/local.sh", *args], env=dict(ENV, **env), timeout=60)
    one_line_error(proc, needle)


def test_gpu_script_without_a_gpu_exits_77():
    try:
        import cupy
        if cupy.is_available():
            pytest.skip("a GPU is present: tests/gpu/run.sh runs the GPU tests")
    except ImportError:
        pass
    proc = run(["bash", "tests/gpu/run.sh"], timeout=120)
    assert proc.returncode == 77, proc.stderr
    assert "needs a CUDA GPU and CuPy" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("bench, args, needle", [
    ("layers", ["--seed", "-1"], "--seed"), ("layers", ["--iters", "x"], "--iters"),
    ("layers", ["--model", "nosuch"], "--model"),
    ("comm", ["--sizes", ""], "--sizes"), ("comm", ["--chunk-bytes", "0"], "--chunk-bytes"),
    ("comm", ["--dtype", "x"], "--dtype"),
    ("scaling", ["--timeout", "inf"], "--timeout"), ("scaling", ["--modes", ","], "--modes"),
    ("scaling", ["--csv", "/nonexistent/folder/s.csv"], "/nonexistent/folder"),
    ("elastic", ["--timeout", "inf"], "--timeout"), ("elastic", ["--np", "x"], "--np"),
    ("elastic", ["--mode", "nosuch"], "--mode"), ("elastic", ["--lr", "nan"], "--lr"),
    ("elastic", ["--batch-size", "2"], "--batch-size"),
    ("overlap", ["--timeout", "nan"], "--timeout"), ("overlap", ["--modes", ","], "--modes"),
    ("model", ["--validate-steps", "-1"], "--validate-steps"),
    ("model", ["--validate-batch", "0"], "--validate-batch"),
    ("model", ["--max-crossover-np", "-1"], "--max-crossover-np"),
    ("curves", ["--model", "nosuch"], "nosuch"),
])
def test_bench_bad_values_are_one_line(bench, args, needle):
    """A bad value of a benchmark flag is refused in one line before anything runs."""
    proc = run([sys.executable, "-m", "ringnet.bench", bench, *args], timeout=60)
    one_line_error(proc, needle)


def test_an_unknown_benchmark_is_one_line_naming_it():
    """A mistyped benchmark name: one line naming it and the nearest name, exit 2, not the
    whole list of benchmarks."""
    proc = run([sys.executable, "-m", "ringnet.bench", "scalng"], timeout=60)
    one_line_error(proc, "unknown benchmark 'scalng' (did you mean 'scaling'?)")
    assert proc.stdout == ""
    proc = run([sys.executable, "-m", "ringnet.bench", "xyzzy"], timeout=60)
    one_line_error(proc, "unknown benchmark 'xyzzy'; choose one of layers, comm")


def test_bench_comm_on_one_rank_says_how_to_start_several():
    proc = run([sys.executable, "-m", "ringnet.bench", "comm", "--sizes", "8"], timeout=60)
    one_line_error(proc, "this run has one", "mpirun -np 4 python -m ringnet.bench comm")
    assert proc.stdout == ""


def test_every_bench_refuses_a_bad_flag_in_one_line():
    """Each benchmark's parser reports a wrong flag or value in one line (no usage dump)."""
    from ringnet.bench.__main__ import COMMANDS
    for bench in COMMANDS:
        proc = run([sys.executable, "-m", "ringnet.bench", bench, "--no-such-flag"], timeout=60)
        one_line_error(proc, "--no-such-flag", f"python -m ringnet.bench {bench} --help")


def test_every_bench_flag_has_help_with_its_default():
    """`python -m ringnet.bench NAME --help` explains every flag and names every default."""
    import argparse
    import importlib
    from ringnet.bench.__main__ import COMMANDS
    missing = []
    for bench, (module, _) in COMMANDS.items():
        for a in importlib.import_module(module).build_parser()._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or \
                    isinstance(a, argparse._HelpAction):
                continue
            switch = isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            if not a.help or (not switch and a.default is not None and a.default is not False
                              and "default" not in a.help):
                missing.append(f"{bench} {a.option_strings[-1]}")
    assert not missing, missing


@pytest.mark.parametrize("args, needle", [
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--resume", "/"], "checkpoint / is not a readable HDF5 file"),
])
def test_train_bad_values_are_one_line(args, needle):
    """A negative seed and a checkpoint path that is a folder: one line (h5py's message spans
    lines; the error line joins them), exit 2."""
    one_line_error(train_cli("--steps", "1", *args, timeout=120), needle)


# --- inputs that were silently accepted or misnamed ----------------------------------------

def test_a_data_dir_that_is_not_a_folder_is_refused(tmp_path):
    one_line_error(train_cli("--steps", "1", "--data-dir", str(tmp_path / "nowhere")),
                   f"--data-dir {tmp_path / 'nowhere'} does not exist")
    (tmp_path / "file").write_text("x")
    one_line_error(train_cli("--steps", "1", "--data-dir", str(tmp_path / "file")),
                   "is not a folder")


def test_a_folder_given_as_the_data_set_is_named_a_folder(tmp_path):
    one_line_error(train_cli("--steps", "1", "--dataset", str(tmp_path)),
                   f"data set {tmp_path} is a folder", "convert imagefolder")


def test_transport_nccl_on_the_cpu_is_refused_alone_as_under_mpirun():
    env = {k: v for k, v in ENV.items() if k != "RINGNET_NCCL"}
    alone = train_cli("--steps", "1", "--device", "cpu", "--transport", "nccl", env=env)
    under = train_cli("--steps", "1", "--device", "cpu", "--transport", "nccl", np_=2, env=env)
    one_line_error(alone, "transport nccl moves GPU memory, but the device is the CPU")
    one_line_error(under, "transport nccl moves GPU memory, but the device is the CPU")
    assert alone.stderr == under.stderr


def test_a_resume_into_another_mode_says_what_followed_the_mode(tmp_path):
    ck = str(tmp_path / "ck.h5")
    assert train_cli("--steps", "4", "--save", ck, "--quiet").returncode == 0
    proc = train_cli("--steps", "6", "--resume", ck, "--no-progress", np_=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"resuming from {ck} at step 4; from the checkpoint: --model digits"), first
    assert "--warmup-steps 100, the default of ring delay 1 lookahead, as the checkpoint's " \
           "single had none (steps 4 to 100 synchronous, then delayed)" in first, first
    ring = str(tmp_path / "ring.h5")
    assert train_cli("--steps", "4", "--save", ring, "--quiet", np_=2).returncode == 0
    proc = train_cli("--steps", "6", "--resume", ring, "--mode", "single", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dropped the checkpoint's --warmup-steps 100 of ring delay 1 lookahead" in \
        proc.stdout.splitlines()[0]


# --- what the log lines say ------------------------------------------------------------------

def _loss(line):
    return float(re.search(r"train loss (\d+\.\d+)", line).group(1))


def test_the_done_line_and_the_last_epoch_line_give_one_train_loss(tmp_path):
    proc = train_cli("--epochs", "2", "--no-progress", np_=2)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    epoch2 = next(l for l in lines if l.startswith("epoch   2"))
    done = next(l for l in lines if l.startswith("done:"))
    assert _loss(epoch2) == _loss(done) and "mean of steps" not in done, (epoch2, done)
    # ending inside an epoch: the done line says which steps it averages (one epoch's worth)
    proc = train_cli("--steps", "30", "--no-progress", "--save", str(tmp_path / "a.h5"))
    done = proc.stdout.splitlines()[-1]
    assert "train loss" in done and "(mean of steps 8-29)" in done, done
    # resumed inside epoch 2 (steps 22-43): its line averages the steps this run made, and says so
    proc = train_cli("--epochs", "3", "--no-progress", "--resume", str(tmp_path / "a.h5"))
    epoch2 = next(l for l in proc.stdout.splitlines() if l.startswith("epoch   2"))
    assert epoch2.endswith("(train loss of steps 30-43 of 22-43: resumed)"), epoch2


@pytest.mark.skipif(not __import__("shutil").which("script"), reason="needs script (util-linux)")
def test_a_progress_bar_under_mpirun_in_a_terminal():
    """Hydra starts the ranks in a session of their own, without the terminal: the bar is
    drawn where the launcher writes to a terminal (script(1) gives it one), not elsewhere."""
    cmd = "mpirun -np 2 python -m ringnet.train --epochs 2"
    shown = run(["script", "-qec", cmd, "/dev/null"], stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stdout[-2000:]
    assert re.search(r"\d+/44 \[.*step/s", shown.stdout), shown.stdout[-2000:]
    piped = run(cmd.split())
    assert piped.returncode == 0 and "step/s" not in piped.stderr + piped.stdout
    assert re.search(r"^step 44/44  epoch 2\.00", piped.stderr, re.M), piped.stderr


def test_a_parallel_mode_on_one_rank_says_it_exchanges_nothing():
    """mpirun forgotten: one note on stderr says so and how to start N ranks; the run goes on."""
    for mode, alone in (("ring", "it trains alone, with the delay-1 update"),
                        ("split-fc", "it trains as --mode single")):
        proc = train_cli("--steps", "2", "--no-progress", "--mode", mode)
        assert proc.returncode == 0, proc.stderr[-2000:]
        notes = [l for l in proc.stderr.splitlines() if l.startswith("ringnet: note:")]
        assert notes == [f"ringnet: note: mode {mode} on 1 rank exchanges nothing ({alone}); "
                         f"start N ranks with mpirun -np N python -m ringnet.train --mode {mode} ..."], \
            proc.stderr
    # --quiet promises nothing but errors; single and a real world have nothing to note
    quiet = train_cli("--steps", "2", "--mode", "ring", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == "", quiet.stderr
    for args, np_ in ((["--mode", "single"], None), (["--mode", "ring"], 2)):
        proc = train_cli("--steps", "2", "--no-progress", *args, np_=np_)
        assert proc.returncode == 0 and "note:" not in proc.stderr + proc.stdout, proc.stderr


def _progress_lines(proc):
    return [l for l in proc.stderr.splitlines() if l.startswith("step ")]


def _progress_loss(line):
    found = re.search(r"  loss (\d+\.\d{4}) \(([^)]*)\)  ", line)
    assert found, line
    return float(found.group(1)), found.group(2)


def test_progress_and_epoch_lines_say_which_losses_they_average():
    """The progress line's loss is the mean of the steps since the previous line (rank 0's
    under several ranks), the epoch line's the epoch's mean over every rank; each says so,
    and the values are what the labels say."""
    no_terminal = dict(start_new_session=True, env=dict(ENV, RINGNET_PROGRESS_SECONDS="1000"))
    for np_, progress_label, epoch_label in ((None, "mean of last 22 steps", "(epoch mean)"),
                                             (2, "rank 0, mean of last 22 steps",
                                              "(epoch mean, all ranks)")):
        proc = train_cli("--epochs", "1", "--json", np_=np_, **no_terminal)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads(proc.stdout.splitlines()[-1])     # train_loss: the epoch's steps
        [line] = _progress_lines(proc)
        loss, label = _progress_loss(line)
        assert line.startswith("step 22/22  ") and label == progress_label, line
        epoch = next(l for l in proc.stderr.splitlines() if l.startswith("epoch   1"))
        assert f"train loss {summary['train_loss']:.4f} {epoch_label}  " in epoch, epoch
        if np_ is None:     # one rank: the progress line's 22 steps are the epoch's
            assert f"{loss:.4f}" == f"{summary['train_loss']:.4f}", (line, epoch)
    # a line every step: each gives that step's loss, and their mean is the run's train loss
    proc = train_cli("--steps", "3", "--json", start_new_session=True,
                     env=dict(ENV, RINGNET_PROGRESS_SECONDS="0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [_progress_loss(l) for l in _progress_lines(proc)]
    assert [label for _, label in losses] == ["last step"] * 3, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert abs(np.mean([loss for loss, _ in losses]) - summary["train_loss"]) < 1e-4
