"""What a run writes, checked before it trains: no output is one of its inputs or another
output, every output is a regular file (or nothing yet) in a writable folder, and one run
at a time writes a checkpoint (a lock named after it). Each refusal is one line and exit 2,
before any training, and leaves every file as it was.

The runs are tiny (digits, 2 steps) and refused before their first step; a few run under
``mpirun -np 2`` to check that every rank exits and only one line is printed.
"""
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ENV, assert_one_line_error
from ringnet.outputs import CheckpointLock, check_distinct, check_output, lock_path
from ringnet.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "datasets" / "digits.h5"
TINY = ["--steps", "2", "--quiet", "--batch-size", "16"]


def train_cli(cwd, *args, np_=None, env=None, timeout=120):
    cmd = [sys.executable, "-m", "ringnet.train", *args]
    if np_:
        cmd = ["mpirun", "-np", str(np_), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=cwd,
                          timeout=timeout)


@pytest.fixture
def folder(tmp_path):
    """A folder holding d.h5 (a copy of digits) and dd/digits.h5 (for --data-dir)."""
    shutil.copy(DIGITS, tmp_path / "d.h5")
    (tmp_path / "dd").mkdir()
    shutil.copy(DIGITS, tmp_path / "dd" / "digits.h5")
    return tmp_path


# -- no file is two of the run's files ------------------------------------------------------

SAME_FILE = [
    # (flags, needles of the one line, the input that must stay as it was)
    (["--dataset", "d.h5", "--save", "d.h5"], ["--dataset d.h5", "--save d.h5", "same file"], "d.h5"),
    (["--dataset", "digits", "--data-dir", "dd", "--save", "dd/digits.h5"],
     ["--dataset digits (dd/digits.h5)", "--save dd/digits.h5"], "dd/digits.h5"),
    (["--dataset", "d.h5", "--trace", "d.h5"], ["--dataset d.h5", "--trace d.h5"], "d.h5"),
    (["--dataset", "d.h5", "--save", "hard.h5"], ["--dataset d.h5", "--save hard.h5"], "d.h5"),
    (["--dataset", "soft.h5", "--json-file", "d.h5"], ["--dataset soft.h5", "--json-file d.h5"],
     "d.h5"),
    (["--dataset", "d.h5", "--save", "d.h5", "--resume", "auto"], ["--dataset d.h5", "--save d.h5"],
     "d.h5"),
    (["--resume", "ck.h5", "--json-file", "ck.h5"], ["--resume ck.h5", "--json-file ck.h5"],
     "ck.h5"),
]


@pytest.mark.parametrize("flags, needles, kept", SAME_FILE,
                         ids=["save=dataset", "save=data-dir's", "trace=dataset", "hard link",
                              "symbolic link", "resume-auto", "json=resume"])
def test_an_output_that_is_an_input_is_refused_and_the_input_kept(folder, flags, needles, kept):
    os.link(folder / "d.h5", folder / "hard.h5")
    os.symlink("d.h5", folder / "soft.h5")
    if "ck.h5" in flags:
        assert train_cli(folder, *TINY, "--save", "ck.h5").returncode == 0
    before = (folder / kept).read_bytes()
    proc = train_cli(folder, *TINY, *flags)
    assert_one_line_error(proc, *needles)
    assert (folder / kept).read_bytes() == before


def test_two_outputs_that_are_one_file_and_the_heartbeat(folder):
    proc = train_cli(folder, *TINY, "--save", "ck.h5", "--json-file", "ck.h5")
    assert_one_line_error(proc, "--save ck.h5 and --json-file ck.h5 are the same file")
    assert not (folder / "ck.h5").exists()
    before = (folder / "d.h5").read_bytes()
    proc = train_cli(folder, *TINY, "--dataset", "d.h5",
                     env=dict(ENV, RINGNET_HEARTBEAT=str(folder / "d.h5")))
    assert_one_line_error(proc, "--dataset d.h5 and RINGNET_HEARTBEAT=")
    assert (folder / "d.h5").read_bytes() == before


def test_resume_and_save_may_be_one_file(folder):
    assert train_cli(folder, *TINY, "--save", "ck.h5").returncode == 0
    proc = train_cli(folder, "--steps", "4", "--quiet", "--resume", "ck.h5", "--save", "ck.h5")
    assert proc.returncode == 0, proc.stderr
    from ringnet.checkpoint import read_attributes
    assert read_attributes(folder / "ck.h5")["step"] == 4


def test_a_save_onto_a_file_that_is_no_checkpoint_is_refused(folder):
    (folder / "notes.txt").write_text("results of last week\n")
    proc = train_cli(folder, *TINY, "--save", "notes.txt")
    assert_one_line_error(proc, "--save notes.txt exists and is not a ringnet checkpoint")
    assert (folder / "notes.txt").read_text() == "results of last week\n"
    (folder / "empty.h5").write_bytes(b"")           # an empty file (mktemp's) may be replaced
    assert train_cli(folder, *TINY, "--save", "empty.h5").returncode == 0


def test_one_line_from_one_rank_under_mpirun(folder):
    before = (folder / "d.h5").read_bytes()
    proc = train_cli(folder, *TINY, "--dataset", "d.h5", "--save", "d.h5", np_=2)
    assert_one_line_error(proc, "--dataset d.h5", "--save d.h5", "same file")
    assert (folder / "d.h5").read_bytes() == before


def test_distinct_compares_inodes_and_resolved_paths(tmp_path):
    (tmp_path / "a").write_text("x")
    os.symlink(tmp_path / "a", tmp_path / "link")
    (tmp_path / "sub").mkdir()
    files = [("--in", "--in a", "input", "input", tmp_path / "a"),
             ("--out", "--out link", "output", "output", tmp_path / "link")]
    with pytest.raises(UsageError, match="--in a and --out link are the same file: writing the "
                                         "output would destroy the input; give --out another path"):
        check_distinct(files)
    check_distinct(files, may_share=[("--out", "--in")])
    # not there yet: the same resolved path is the same file
    with pytest.raises(UsageError, match="would overwrite each other"):
        check_distinct([("--x", "--x new", "x", "output", tmp_path / "new"),
                        ("--y", "--y sub/../new", "y", "output", tmp_path / "sub" / ".." / "new")])
    check_distinct([("--x", "--x", "x", "output", tmp_path / "new"),
                    ("--y", "--y", "y", "output", tmp_path / "other"),
                    ("--z", "--z", "z", "output", None)])


# -- an output is a regular file or nothing yet ----------------------------------------------

@pytest.mark.parametrize("flag", ["--save", "--json-file", "--trace"])
def test_a_character_device_output_is_refused_and_stays_a_device(tmp_path, flag):
    device = tmp_path / "nul"
    try:
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))     # what /dev/null is
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc})")
    proc = train_cli(tmp_path, *TINY, flag, "nul")
    assert_one_line_error(proc, "nul", "it is a character device, not a regular file")
    assert stat.S_ISCHR(os.stat(device).st_mode)


@pytest.mark.parametrize("flag", ["--save", "--json-file"])
def test_a_fifo_output_is_refused_at_once_and_stays_a_fifo(tmp_path, flag):
    os.mkfifo(tmp_path / "pipe")
    start = time.monotonic()
    proc = train_cli(tmp_path, *TINY, flag, "pipe", timeout=60)      # before: blocked in open()
    assert_one_line_error(proc, "pipe", "it is a FIFO")
    assert time.monotonic() - start < 60
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


def test_a_save_path_ending_in_a_slash_is_refused_before_training(tmp_path):
    proc = train_cli(tmp_path, "--steps", "50", "--save", "ck/notdir.h5/")
    assert_one_line_error(proc, "ck/notdir.h5/", "ends in '/'")
    assert "epoch" not in proc.stdout and "done" not in proc.stdout
    assert os.listdir(tmp_path) == []


def test_check_output_rules(tmp_path):
    check_output("--x", tmp_path / "new" / "deeper" / "f.json")     # folders are made later
    (tmp_path / "f").write_text("")
    check_output("--x", tmp_path / "f")
    with pytest.raises(UsageError, match=r"--x .*/f/g\.json: .*/f is not a folder"):
        check_output("--x", tmp_path / "f" / "g.json")
    with pytest.raises(UsageError, match="it is a folder; give a file name such as s.json"):
        check_output("--x", tmp_path, "s.json")
    with pytest.raises(UsageError, match="ends in '/'"):
        check_output("--x", f"{tmp_path}/f/")
    os.symlink("/dev/null", tmp_path / "null-link")
    with pytest.raises(UsageError, match="character device"):
        check_output("--x", tmp_path / "null-link")
    with pytest.raises(UsageError, match="--x is empty"):
        check_output("--x", "")


# -- one run at a time per checkpoint ------------------------------------------------------

def test_a_second_run_on_a_locked_checkpoint_refuses_naming_the_holder(tmp_path):
    path = tmp_path / "ck.h5"
    with CheckpointLock(path) as lock:
        assert Path(lock.path) == Path(str(path) + ".lock")
        holder = f"host {socket.gethostname()}, process {os.getpid()}"
        assert Path(lock.path).read_text().strip() == holder
        proc = train_cli(tmp_path, *TINY, "--save", "ck.h5")
        assert_one_line_error(proc, "--save ck.h5 is in use by another run", holder)
        os.symlink("ck.h5", tmp_path / "latest.h5")     # another name of the same checkpoint
        proc = train_cli(tmp_path, *TINY, "--save", "latest.h5", np_=2)
        assert_one_line_error(proc, "--save latest.h5 is in use by another run", holder)
        with pytest.raises(UsageError, match="in use by another run"):
            CheckpointLock(tmp_path / "latest.h5")
    assert not Path(lock.path).exists()
    assert not path.exists()
    proc = train_cli(tmp_path, *TINY, "--save", "ck.h5")        # free again
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["ck.h5", "latest.h5"]    # the lock file is gone


def test_a_running_job_holds_the_lock_and_a_second_one_refuses(tmp_path):
    """The outside probe's case: two jobs with the same --save at once. The first holds the
    lock from start-up; the second exits 2 naming it; the first, stopped by SIGTERM, writes
    its checkpoint and exits 75 as always, and leaves no lock file."""
    first = subprocess.Popen([sys.executable, "-m", "ringnet.train", "--steps", "1000000",
                              "--quiet", "--save", "ck.h5"], cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / "ck.h5.lock"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (lock.exists() and lock.read_text()):
            assert first.poll() is None, first.communicate()
            time.sleep(0.05)
        assert f"process {first.pid}" in lock.read_text()
        time.sleep(1)       # training by now
        proc = train_cli(tmp_path, *TINY, "--save", "ck.h5")
        assert_one_line_error(proc, f"process {first.pid}", "in use by another run")
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
        assert first.returncode == 75, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not lock.exists()
    from ringnet.checkpoint import read_attributes
    assert read_attributes(tmp_path / "ck.h5")["step"] > 0


def test_the_lock_goes_with_a_killed_holder_and_with_a_failed_run(tmp_path):
    path = tmp_path / "ck.h5"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\nfrom ringnet.outputs import CheckpointLock\n"
                               f"lock = CheckpointLock({str(path)!r})\nprint('held', flush=True)\n"
                               "time.sleep(600)\n"], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=f"process {holder.pid}"):
            CheckpointLock(path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert Path(lock_path(path)).exists()          # left by the killed holder: harmless
    with CheckpointLock(path) as lock:             # taken over
        assert f"process {os.getpid()}" in Path(lock.path).read_text()
    # a run that fails after taking the lock (a bad flag found in setup) gives it back
    from mpi4py import MPI
    from ringnet.config import TrainConfig
    from ringnet.train import train
    with pytest.raises(SystemExit):
        train(TrainConfig(steps=2, lr=-1.0, save=str(path), progress=False, quiet=True),
              world=MPI.COMM_SELF)
    assert not Path(lock_path(path)).exists()
    CheckpointLock(path).release()


# -- python -m ringnet.datasets convert --out ----------------------------------------------

def test_convert_out_an_existing_folder_is_one_line_and_leaves_nothing(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image
    for name in ("a", "b"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "imgs" / name / f"{i}.png")
    (tmp_path / "out").mkdir()
    proc = subprocess.run([sys.executable, "-m", "ringnet.datasets", "convert", "imagefolder",
                           "imgs", "--size", "8", "--out", "out"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc, "--out out", "it is a folder")
    assert sorted(os.listdir(tmp_path)) == ["imgs", "out"] and os.listdir(tmp_path / "out") == []


def test_a_failed_rename_leaves_no_temporary(tmp_path):
    import numpy as np
    from ringnet.data import write_dataset
    (tmp_path / "taken").mkdir()
    images = np.zeros((2, 1, 4, 4), np.uint8)
    with pytest.raises(OSError):
        write_dataset(tmp_path / "taken", images, np.zeros(2, np.int64), images,
                      np.zeros(2, np.int64), classes=["a"])
    assert os.listdir(tmp_path) == ["taken"]


def test_a_file_system_without_locks_runs_unlocked_and_says_so(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = CheckpointLock(tmp_path / "ck.h5")
    assert lock.fd is None and "does not lock files" in lock.note
    lock.release()
