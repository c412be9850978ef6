"""Checkpoint durability: signals and kill -9 leave nothing behind, fsync before rename,
a real write test before training, non-finite weights refused, version-1 files (with stream states) still load."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ringnet import checkpoint
from ringnet.checkpoint import (check_writable, load_checkpoint, save_checkpoint,
                                stale_temporaries)
from ringnet.errors import InputError, SetupError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
# The attributes every checkpoint a run writes has (load_checkpoint requires them).
ATTRS = dict(model="digits", mode="single", delay=0, ranks=1, step=1, epoch=0, dtype="float32")


def with_attrs(**changed):
    return dict(ATTRS, **changed)


def _tmp_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(checkpoint.TMP_SUFFIX))


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_signal_during_write_removes_the_temporary_and_keeps_the_old_file(tmp_path, sig):
    path = tmp_path / "ck.h5"
    save_checkpoint(path, PARAMS, **ATTRS)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import numpy as np
        from ringnet.checkpoint import save_checkpoint
        save_checkpoint({str(path)!r}, {{"w": np.zeros(1000, np.float32)}}, step=2)
        """)
    env = dict(os.environ, RINGNET_FAULT=f"{sig}:save-write:0",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode in (-getattr(signal, "SIG" + sig), 128 + getattr(signal, "SIG" + sig), 1), proc
    assert _tmp_files(tmp_path) == [], "the interrupted save left its temporary file"
    assert path.read_bytes() == before, "the interrupted save changed the old checkpoint"


def test_kill9_temporary_is_swept_by_the_next_save(tmp_path):
    path = tmp_path / "ck.h5"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"ck.h5.{checkpoint._HOST}.{dead_pid}.abc123.h5.tmp"
    live = tmp_path / f"ck.h5.{checkpoint._HOST}.{os.getppid()}.def456.h5.tmp"   # a writer still running
    other = tmp_path / f"other.h5.{checkpoint._HOST}.{dead_pid}.x.h5.tmp"        # another target's
    for f in (stale, live, other):
        f.write_bytes(b"half a checkpoint")
    assert stale_temporaries(path) == [str(stale)]
    save_checkpoint(path, PARAMS, **ATTRS)
    assert not stale.exists() and live.exists() and other.exists()
    load_checkpoint(path)


def test_file_and_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", None))
        return real_replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    save_checkpoint(tmp_path / "ck.h5", PARAMS, step=1)
    assert calls == [("fsync", False), ("replace", None), ("fsync", True)], calls


def test_write_check_tries_a_real_write_and_the_free_space(tmp_path):
    check_writable(str(tmp_path / "new" / "ck.h5"), 1 << 20)
    assert _tmp_files(tmp_path / "new") == []
    with pytest.raises(SetupError, match="MiB free"):
        check_writable(str(tmp_path / "ck.h5"), 1 << 60)
    # /proc passes os.access for root but takes no files: only a real write finds out
    with pytest.raises(SetupError, match="test write in /proc failed"):
        check_writable("/proc/ck.h5")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_refused_on_save_and_load(tmp_path, bad):
    params = {k: v.copy() for k, v in PARAMS.items()}
    params["b"][1] = bad
    with pytest.raises(InputError, match="params/b holds 1 NaN or infinite"):
        save_checkpoint(tmp_path / "a.h5", params)
    assert not (tmp_path / "a.h5").exists()
    import h5py
    path = tmp_path / "b.h5"
    save_checkpoint(path, PARAMS, PARAMS, **ATTRS)
    with h5py.File(path, "r+") as f:
        f["momentum/w"][0, 0] = bad
    with pytest.raises(InputError, match="momentum/w holds 1 NaN"):
        load_checkpoint(path)


def test_checkpoint_holds_no_stream_state_and_version_1_files_still_load(tmp_path):
    """Dropout masks follow from seed and step (no stream state): a version-2 file has no
    ``rng`` attribute; a version-1 file, which stored NumPy stream states there, loads."""
    import h5py
    path = tmp_path / "ck.h5"
    save_checkpoint(path, PARAMS, **with_attrs(step=3, seed=5))
    with h5py.File(path, "r") as f:
        assert f.attrs["version"] == 2 and "rng" not in f.attrs
    assert load_checkpoint(path)[3]["rng"] is None
    old_state = {"drop1": np.random.default_rng(6).bit_generator.state}
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = 1
        f.attrs["rng"] = json.dumps(old_state)
    params, _, _, attrs = load_checkpoint(path)
    assert attrs["version"] == 1 and attrs["rng"] == json.loads(json.dumps(old_state))
    np.testing.assert_array_equal(params["w"], PARAMS["w"])


def test_resume_overrides_only_what_is_given_and_reports_it(tmp_path):
    """A resume continues with the checkpoint's hyperparameters; a flag given on the command
    line overrides its value, and the run reports every override (log line and --json),
    even under --quiet. The reference: a run that changes the same settings at the same
    step from the same weights (a resume given them all explicitly) equals it."""
    from mpi4py import MPI

    from ringnet.config import TrainConfig
    from ringnet.train import train
    base = TrainConfig(model="digits", dataset="digits", dtype="float64", progress=False,
                       quiet=True, eval_every_epoch=False)
    path = str(tmp_path / "ck.h5")
    recipe = dict(batch_size=32, lr=0.05, momentum=0.8, weight_decay=1e-3, seed=3)
    train(base, world=MPI.COMM_SELF, steps=6, save=path, **recipe)
    changed = dict(batch_size=16, momentum=0.5, weight_decay=0.0, lr_policy="inv")
    resumed = train(base, world=MPI.COMM_SELF, steps=10, resume=path, lr=0.05, **changed)
    record = resumed.summary["resumed"]
    assert record["step"] == 6 and record["checkpoint"] == path
    assert record["overridden"] == {"batch_size": {"checkpoint": 32, "given": 16},
                                    "momentum": {"checkpoint": 0.8, "given": 0.5},
                                    "weight_decay": {"checkpoint": 1e-3, "given": 0.0},
                                    "lr_policy": {"checkpoint": "fixed", "given": "inv"}}
    assert "lr" not in record["overridden"]              # given, but equal to the checkpoint's
    assert record["from_checkpoint"]["seed"] == 3 and "momentum" not in record["from_checkpoint"]
    assert resumed.summary["batch_size"] == 16
    explicit = train(base, world=MPI.COMM_SELF, steps=10, resume=path, **recipe | changed)
    np.testing.assert_array_equal(np.asarray(resumed.strategy.eval_model().params),
                                  np.asarray(explicit.strategy.eval_model().params))
    untouched = train(base, world=MPI.COMM_SELF, steps=10, resume=path)
    assert untouched.summary["resumed"]["overridden"] == {}
    assert not np.array_equal(np.asarray(untouched.strategy.eval_model().params),
                              np.asarray(resumed.strategy.eval_model().params))


def test_a_nan_in_the_lookahead_base_is_a_corrupt_checkpoint_not_divergence(tmp_path):
    import h5py
    from ringnet.checkpoint import load_lookahead_base
    path = tmp_path / "ck.h5"
    save_checkpoint(path, PARAMS, PARAMS, PARAMS, lookahead_base=PARAMS)
    assert np.array_equal(load_lookahead_base(path)["w"], PARAMS["w"])
    with h5py.File(path, "r+") as f:
        f["lookahead_base/b"][0] = np.nan
    with pytest.raises(InputError, match="lookahead_base/b holds 1 NaN or infinite"):
        load_lookahead_base(path)
    # and on the command line: one line, not "training diverged; try a lower --lr"
    ck = str(tmp_path / "run.h5")
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    train = [sys.executable, "-m", "ringnet.train", "--quiet", "--mode", "ring"]
    subprocess.run(train + ["--steps", "3", "--warmup-steps", "1", "--save", ck], check=True,
                   env=env, cwd=REPO, timeout=120)
    with h5py.File(ck, "r+") as f:
        name = sorted(f["lookahead_base"])[0]
        f[f"lookahead_base/{name}"][(0,) * f[f"lookahead_base/{name}"].ndim] = np.nan
    proc = subprocess.run(train + ["--steps", "5", "--resume", ck], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"ringnet: error: checkpoint {ck}: lookahead_base/{name} holds 1 NaN or infinite "
        "value(s); it cannot be trained from"]


def test_a_save_through_a_symlink_writes_its_target(tmp_path):
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "ck-0001.h5"
    link = tmp_path / "latest.h5"
    link.symlink_to(target)                     # dangling until the first save
    check_writable(str(link), 1 << 10)
    save_checkpoint(str(link), PARAMS, **ATTRS)
    save_checkpoint(str(link), {k: v + 1 for k, v in PARAMS.items()}, **ATTRS)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert np.array_equal(load_checkpoint(target)[0]["w"], PARAMS["w"] + 1)
    assert _tmp_files(tmp_path) == [] and _tmp_files(tmp_path / "runs") == []


def test_the_free_space_check_counts_every_group_of_a_delay1_checkpoint(tmp_path):
    from ringnet.checkpoint import checkpoint_bytes
    n = 1_000_000          # 4 MB a group: the estimate's 1 MiB of slack does not hide a group
    path = tmp_path / "ck.h5"
    group = {"w": np.zeros(n, np.float32)}
    save_checkpoint(path, group, group, group, lookahead_base=group)     # the delay-1 default
    assert os.path.getsize(path) <= checkpoint_bytes(n, 4)


def test_sigterm_during_a_background_periodic_save_leaves_no_temporary(tmp_path):
    """The periodic saver writes on a thread of its own, where no signal handler can be
    installed: the main thread's guard removes that write's temporary, and the previous
    checkpoint stays whole."""
    path = tmp_path / "ck.h5"
    code = textwrap.dedent(f"""
        import os, signal, time
        import numpy as np
        from mpi4py import MPI
        from ringnet import checkpoint
        from ringnet.autosave import PeriodicSaver
        params = {{"w": np.full((256, 256), 1.0, np.float32)}}
        write = lambda state, step: checkpoint.save_checkpoint({str(path)!r}, state, model="digits",
            mode="single", delay=0, ranks=1, step=step, epoch=0, dtype="float32")
        saver = PeriodicSaver(MPI.COMM_SELF, 1, lambda: params, write, background=True)
        saver.save(1, wait=True)
        params = {{"w": np.full((256, 256), 2.0, np.float32)}}
        # the second write is signalled from its own thread, inside the write, which then
        # waits: the signal's handler runs on the main thread before the write can finish
        def fault(name):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        checkpoint.fault_point = fault
        saver.save(2, wait=False)
        for _ in range(500):
            time.sleep(0.01)
        print("not ended by the signal")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert _tmp_files(tmp_path) == []
    params, _, _, attrs = load_checkpoint(path)
    assert attrs["step"] == 1 and np.all(params["w"] == 1.0)


def test_a_resume_continues_with_the_checkpoints_data_and_flags(tmp_path, capsys):
    """--no-shuffle, --augment, --dtype and the data set shape the trajectory: the checkpoint
    keeps them, a resume without the flags continues the same run, and flags given anyway
    are listed as overridden. The data set is a name found in --data-dir (a checkpoint's data
    set path is never opened: tests/test_untrusted.py)."""
    import shutil
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import train
    data = tmp_path / "mydigits.h5"
    shutil.copy(os.path.join(REPO, "datasets", "digits.h5"), data)
    quiet = dict(progress=False, quiet=True, eval_every_epoch=False, batch_size=16,
                 data_dir=str(tmp_path))
    run = dict(dataset="mydigits", shuffle=False, augment=True, dtype="float64", **quiet)

    def weights(result):
        w = np.array(result.strategy.eval_model().params)
        result.strategy.close()
        return w

    expected = weights(train(TrainConfig(**run), world=MPI.COMM_SELF, steps=6))
    ck = str(tmp_path / "ck.h5")
    weights(train(TrainConfig(**run), world=MPI.COMM_SELF, steps=3, save=ck))
    resumed = train(TrainConfig(**quiet), world=MPI.COMM_SELF, steps=6, resume=ck)
    taken = resumed.summary["resumed"]["from_checkpoint"]
    assert (taken["dataset"], taken["shuffle"], taken["augment"], taken["dtype"]) == \
        ("mydigits", False, True, "float64")
    assert np.array_equal(weights(resumed), expected)
    other = train(TrainConfig(shuffle=True, **dict(quiet)), world=MPI.COMM_SELF, steps=6, resume=ck)
    assert other.summary["resumed"]["overridden"]["shuffle"] == {"checkpoint": False, "given": True}
    weights(other)
    # the file rewritten in place (one label): refused unless --dataset is given
    import h5py
    with h5py.File(data, "r+") as f:
        f["train/labels"][0] = (f["train/labels"][0] + 1) % 10
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train(TrainConfig(**quiet), world=MPI.COMM_SELF, steps=6, resume=ck)
    assert stopped.value.code == 2
    assert "the data changed; pass --dataset" in capsys.readouterr().err
    given = train(TrainConfig(dataset="mydigits", **quiet), world=MPI.COMM_SELF, steps=6, resume=ck)
    assert set(given.summary["resumed"]["overridden"]) == {"data_content"}
    weights(given)


def test_a_finished_run_requeued_with_resume_auto_exits_0_and_writes_nothing(tmp_path):
    """The same command on every requeue: once its checkpoint holds the last step, `--resume
    auto` says the run is finished and exits 0, leaving the checkpoint and the --json-file as
    the finished run wrote them; an explicit --resume of it is still refused (exit 2)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
    command = [sys.executable, "-m", "ringnet.train", "--steps", "3", "--batch-size", "16",
               "--no-progress", "--save", "ck.h5", "--resume", "auto", "--json-file", "s.json"]

    def run(*extra):
        return subprocess.run(command + list(extra), capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=120)
    first = run()
    assert first.returncode == 0, first.stderr
    saved, summary = (tmp_path / "ck.h5").read_bytes(), (tmp_path / "s.json").read_text()
    for again in (run(), run("--json")):
        assert again.returncode == 0, again.stderr
        assert "--resume auto: checkpoint ck.h5 is at step 3 and this run asks for --steps 3: " \
               "the run is finished, nothing to do" in again.stdout + again.stderr
        assert (tmp_path / "ck.h5").read_bytes() == saved
        assert (tmp_path / "s.json").read_text() == summary
    record = json.loads(again.stdout.strip().splitlines()[-1])
    assert record["finished"] == {"checkpoint": "ck.h5", "step": 3, "steps_asked": 3}
    explicit = subprocess.run(command[:-4] + ["--resume", "ck.h5"], capture_output=True,
                              text=True, env=env, cwd=tmp_path, timeout=120)
    assert explicit.returncode == 2 and "already at step 3" in explicit.stderr
