"""Ranks that resume different checkpoints (per-rank paths, node-local disks) are refused at
start-up in one line that names the ranks and what each resumed, exit 2, no hang.

Each MPMD launch (``mpirun -np 1 A : -np 1 B``) gives the two ranks different arguments.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringnet.checkpoint import content_fingerprint, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1")
TRAIN = [sys.executable, "-m", "ringnet.train", "--model", "digits", "--no-progress", "--no-eval",
         "--quiet"]

pytestmark = pytest.mark.skipif(not shutil.which("mpirun"), reason="needs mpirun")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """a.h5 at step 4, b.h5 at step 6, and c.h5: a.h5 with one weight changed (the same
    settings and step, other weights)."""
    folder = tmp_path_factory.mktemp("resume_ranks")
    for name, steps in (("a", "4"), ("b", "6")):
        proc = subprocess.run([*TRAIN, "--steps", steps, "--save", str(folder / f"{name}.h5")],
                              env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copyfile(folder / "a.h5", folder / "c.h5")
    with h5py.File(folder / "c.h5", "r+") as f:
        name = sorted(f["params"])[0]
        weights = f["params"][name][()]
        weights.flat[0] += 0.5
        f["params"][name][...] = weights
    return folder


def mpmd(first, second, timeout=120):
    """Run rank 0 with arguments ``first`` and rank 1 with ``second``; return (proc, seconds)."""
    cmd = ["mpirun", "-np", "1", *TRAIN, "--steps", "10", *first,
           ":", "-np", "1", *TRAIN, "--steps", "10", *second]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def refused(proc, seconds, *needles):
    """Exit 2 within seconds, with one line that says each of ``needles``: no hang, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringnet: error: ranks resumed different checkpoints: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert seconds < 25, seconds        # the deadline of a stall (30 s floor) was not waited for
    return lines[0]


def test_ranks_that_resume_checkpoints_at_different_steps_are_refused(checkpoints):
    a, b = checkpoints / "a.h5", checkpoints / "b.h5"
    proc, seconds = mpmd(["--resume", str(a)], ["--resume", str(b)])
    refused(proc, seconds, f"rank 0 {a} (step 4", f"rank 1 {b} (step 6")


def test_ranks_that_resume_different_weights_at_one_step_are_refused(checkpoints):
    a, c = checkpoints / "a.h5", checkpoints / "c.h5"
    proc, seconds = mpmd(["--resume", str(a)], ["--resume", str(c)])
    ours = content_fingerprint(*load_checkpoint(a)[:3])
    theirs = content_fingerprint(*load_checkpoint(c)[:3])
    refused(proc, seconds, f"rank 0 {a} (step 4, content {ours})",
            f"rank 1 {c} (step 4, content {theirs})")


def test_resume_on_one_rank_only_is_refused(checkpoints):
    a = checkpoints / "a.h5"
    proc, seconds = mpmd(["--resume", str(a)], [])
    refused(proc, seconds, f"rank 0 {a} (step 4)", "rank 1 nothing (no --resume")
    proc, seconds = mpmd([], ["--resume", str(a)])
    refused(proc, seconds, "rank 0 nothing (no --resume", f"rank 1 {a} (step 4)")


def test_save_on_one_rank_only_is_refused(tmp_path):
    proc, _ = mpmd(["--save", str(tmp_path / "x.h5")], [])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "--save is given on rank 0 but not given on rank(s) 1" in lines[0], \
        proc.stderr


def test_copies_of_one_checkpoint_at_different_paths_resume(checkpoints, tmp_path):
    """Node-local disks: each rank reads its own copy; the content is one, so the run goes on."""
    a = checkpoints / "a.h5"
    copy = tmp_path / "local.h5"
    shutil.copyfile(a, copy)
    proc, _ = mpmd(["--resume", str(a)], ["--resume", str(copy)])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_content_fingerprint_follows_every_array_bit():
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    same = {k: v.copy() for k, v in params.items()}
    assert content_fingerprint(params, None, None) == content_fingerprint(same, None, None)
    flipped = {k: v.copy() for k, v in params.items()}
    flipped["w"].view(np.uint32)[1, 2] ^= 1          # the lowest bit of one weight
    assert content_fingerprint(params, None, None) != content_fingerprint(flipped, None, None)
    reshaped = dict(params, w=params["w"].reshape(3, 2))
    assert content_fingerprint(params, None, None) != content_fingerprint(reshaped, None, None)
    # momentum is part of the state resumed
    assert content_fingerprint(params, same, None) != content_fingerprint(params, None, None)
