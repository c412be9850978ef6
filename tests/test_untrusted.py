"""Files and variables a run reads are untrusted: every field of a checkpoint or a data set
file is checked before use, and a bad one is one line naming the file and the field, exit
2, from one rank (never a traceback per rank); no path read from a file is opened unless
the user names it; a RINGNET_BLAS_THREADS the run cannot use is refused like every other
RINGNET_* variable.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import ENV, assert_one_line_error
from ringnet.blas import check_blas_threads
from ringnet.checkpoint import load_checkpoint, load_lookahead_base, read_attributes, stored_step
from ringnet.data import open_dataset
from ringnet.errors import InputError, UsageError

REPO = Path(__file__).resolve().parent.parent
DIGITS = REPO / "datasets" / "digits.h5"
TINY = ["--quiet", "--batch-size", "16"]


def cli(cwd, *args, module="ringnet.train", np_=None, env=None):
    cmd = [sys.executable, "-m", module, *args]
    if np_:
        cmd = ["mpirun", "-np", str(np_), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=cwd,
                          timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real checkpoint of a 2-step ring delay-1 run (every group, lookahead_base too)."""
    folder = tmp_path_factory.mktemp("ck")
    proc = cli(folder, *TINY, "--steps", "2", "--mode", "ring", "--delay", "1",
               "--warmup-steps", "0", "--save", "ck.h5", np_=2)
    assert proc.returncode == 0, proc.stderr
    return folder / "ck.h5"


def _first(f, group):
    return f"{group}/{sorted(f[group])[0]}"


def _set(key, value):
    def change(f):
        f.attrs[key] = value
    return change


def _drop(key):
    def change(f):
        del f.attrs[key]
    return change


def _retype(f):
    name = _first(f, "params")
    data = f[name][()]
    del f[name]
    f[name] = data.astype(np.int32)


def _loop(f):
    name = _first(f, "params")
    del f[name]
    f[name] = h5py.SoftLink(f"/{name}.x")
    f[f"{name}.x"] = h5py.SoftLink(f"/{name}")


def _external(f):
    name = _first(f, "momentum")
    del f[name]
    f[name] = h5py.ExternalLink("/etc/passwd", "/x")


def _reshape(f):
    name = _first(f, "prev_params")
    del f[name]
    f[name] = np.zeros(3, np.float32)


BAD_CHECKPOINTS = {
    # id: (change, what the one line says)
    "step -5": (_set("step", -5), "attribute step must be a whole number >= 0, got -5"),
    "step NaN": (_set("step", np.nan), "attribute step must be a whole number >= 0, got nan"),
    "step 'ten'": (_set("step", "ten"), "attribute step must be a whole number >= 0, got 'ten'"),
    "step missing": (_drop("step"), "attribute step is missing"),
    "version 99": (_set("version", 99), "attribute version must be a version this ringnet reads"),
    "unknown mode": (_set("mode", "spiral"), "attribute mode must be one of single, ring"),
    "unknown model": (_set("model", "resnet"), "attribute model must be one of"),
    "lr 0": (_set("lr", 0.0), "attribute lr must be a finite number > 0"),
    "momentum 1": (_set("momentum", 1.0), "attribute momentum must be a number in [0, 1)"),
    "batch 'big'": (_set("batch_size", "big"), "attribute batch_size must be a whole number"),
    "shuffle 2": (_set("shuffle", 2), "attribute shuffle must be true or false"),
    "integer params": (_retype, "must be an array of float32 or float64, got int32"),
    "soft link loop": (_loop, "is a soft link; a ringnet file holds its data itself"),
    "external link": (_external, "is an external link (to another file)"),
    "shape mismatch": (_reshape, "has shape (3,), params/"),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_every_checkpoint_field_is_checked_before_use(checkpoint, tmp_path, case):
    change, needle = BAD_CHECKPOINTS[case]
    path = tmp_path / "bad.h5"
    shutil.copy(checkpoint, path)
    with h5py.File(path, "r+") as f:
        change(f)
    with pytest.raises(InputError) as info:
        load_checkpoint(path)
    assert str(info.value).startswith(f"checkpoint {path}"), info.value
    assert needle in str(info.value)
    if "step" in case:
        assert stored_step(path) is None        # what ringnet.launch reads: no step known


def test_a_good_checkpoint_loads_whole(checkpoint):
    params, momentum, prev, attrs = load_checkpoint(checkpoint)
    assert attrs["step"] == 2 and attrs["mode"] == "ring" and attrs["delay"] == 1
    assert set(params) == set(momentum) == set(prev) == set(load_lookahead_base(checkpoint))
    assert read_attributes(checkpoint)["model"] == "digits" and stored_step(checkpoint) == 2


@pytest.mark.parametrize("case", ["step 'ten'", "soft link loop"])
def test_a_bad_checkpoint_is_one_line_from_one_rank(checkpoint, tmp_path, case):
    change, needle = BAD_CHECKPOINTS[case]
    shutil.copy(checkpoint, tmp_path / "bad.h5")
    with h5py.File(tmp_path / "bad.h5", "r+") as f:
        change(f)
    proc = cli(tmp_path, *TINY, "--steps", "4", "--mode", "ring", "--resume", "bad.h5", np_=2)
    assert_one_line_error(proc, "checkpoint bad.h5", needle)


def test_a_checkpoints_data_set_path_is_not_opened_unless_named(tmp_path):
    """A checkpoint records --dataset as given; a path there (../../../../etc/passwd, or
    the file it was trained on) is never opened because the checkpoint says so: a resume
    names the data set itself. A name is looked up in the data folders only."""
    shutil.copy(DIGITS, tmp_path / "mine.h5")
    assert cli(tmp_path, *TINY, "--steps", "2", "--dataset", "mine.h5", "--save",
               "ck.h5").returncode == 0
    assert read_attributes(tmp_path / "ck.h5")["dataset"] == "mine.h5"
    proc = cli(tmp_path, *TINY, "--steps", "4", "--resume", "ck.h5")
    assert_one_line_error(proc, "checkpoint ck.h5: attribute dataset is 'mine.h5', a path",
                          "pass --dataset")
    proc = cli(tmp_path, *TINY, "--steps", "4", "--resume", "ck.h5", "--dataset", "mine.h5")
    assert proc.returncode == 0, proc.stderr
    with h5py.File(tmp_path / "ck.h5", "r+") as f:
        f.attrs["dataset"] = "../../../../etc/passwd"
    proc = cli(tmp_path, *TINY, "--steps", "6", "--resume", "ck.h5")
    assert_one_line_error(proc, "attribute dataset is '../../../../etc/passwd', a path")
    # a bare name that is a file in the working folder is not opened either
    shutil.copy(DIGITS, tmp_path / "digits2")
    with h5py.File(tmp_path / "ck.h5", "r+") as f:
        f.attrs["dataset"] = "digits2"
    proc = cli(tmp_path, *TINY, "--steps", "6", "--resume", "ck.h5")
    assert_one_line_error(proc, "unknown data set 'digits2'")


def _data_loop(f):
    del f["train/labels"]
    f["train/labels"] = h5py.SoftLink("/train/x")
    f["train/x"] = h5py.SoftLink("/train/labels")


def _data_external(f):
    del f["test/images"]
    f["test/images"] = h5py.ExternalLink("other.h5", "/test/images")


def _data_virtual(f):
    shape = f["test/images"].shape
    layout = h5py.VirtualLayout(shape=shape, dtype=np.uint8)
    layout[:] = h5py.VirtualSource("other.h5", "/test/images", shape=shape)
    del f["test/images"]
    f.create_virtual_dataset("test/images", layout)


def _data_name(f):
    f.attrs["source"] = np.arange(3)


BAD_DATA = {
    "soft link loop": (_data_loop, "/train/labels is a soft link"),
    "external link": (_data_external, "/test/images is an external link"),
    "virtual data set": (_data_virtual, "/test/images keeps its data in other files"),
    "source not text": (_data_name, "attribute 'source' must be text"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_a_data_set_holds_its_data_itself(tmp_path, case):
    change, needle = BAD_DATA[case]
    shutil.copy(DIGITS, tmp_path / "other.h5")
    shutil.copy(DIGITS, tmp_path / "bad.h5")
    with h5py.File(tmp_path / "bad.h5", "r+") as f:
        change(f)
    with pytest.raises(InputError, match="bad.h5") as info:
        open_dataset(str(tmp_path / "bad.h5"))
    assert needle in str(info.value)


def test_a_data_set_link_loop_is_one_line_in_training_and_in_info(tmp_path):
    shutil.copy(DIGITS, tmp_path / "loop.h5")
    with h5py.File(tmp_path / "loop.h5", "r+") as f:
        _data_loop(f)
    proc = cli(tmp_path, *TINY, "--steps", "2", "--dataset", "loop.h5", np_=2)
    assert_one_line_error(proc, "loop.h5: /train/labels is a soft link")
    proc = cli(tmp_path, "info", "--verify", "loop.h5", module="ringnet.datasets")
    assert_one_line_error(proc, "loop.h5: /train/labels is a soft link")


def test_a_fifo_is_not_opened_as_an_input(tmp_path):
    os.mkfifo(tmp_path / "pipe.h5")
    with pytest.raises(InputError, match="not a readable HDF5 file: it is a FIFO"):
        load_checkpoint(tmp_path / "pipe.h5")
    proc = cli(tmp_path, "info", "pipe.h5", module="ringnet.datasets")
    assert_one_line_error(proc, "pipe.h5 is not a readable HDF5 file: it is a FIFO")


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_an_unusable_blas_thread_count_is_refused(tmp_path, value):
    proc = cli(tmp_path, *TINY, "--steps", "1", env=dict(ENV, RINGNET_BLAS_THREADS=value))
    assert_one_line_error(proc, f"RINGNET_BLAS_THREADS={value!r}", "whole number")


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_benchmark_refuses_an_unusable_blas_thread_count(tmp_path, value):
    """docs/environment.md's promise holds for the benchmarks too (they set their ranks' own
    count, but the variable is the user's)."""
    proc = cli(tmp_path, "layers", "--model", "lenet", module="ringnet.bench",
               env=dict(ENV, RINGNET_BLAS_THREADS=value))
    assert_one_line_error(proc, f"RINGNET_BLAS_THREADS={value!r}", "whole number")


def test_blas_thread_values():
    for good in (None, "", "1", " 3 ", "16"):
        check_blas_threads({} if good is None else {"RINGNET_BLAS_THREADS": good})
    for bad in ("abc", "0", "-2", "1.5", "+2", "2 threads"):
        with pytest.raises(UsageError, match="RINGNET_BLAS_THREADS"):
            check_blas_threads({"RINGNET_BLAS_THREADS": bad})
