"""Train LeNet on an MNIST-format data set written by the test, converted by the CLI.

The idx files hold the real UCI digits scaled to 28x28 (8x8 pixels enlarged 3x and
padded), so the converter, the HDF5 reader and LeNet's 28x28 path are exercised end
to end on real handwriting.
"""
import gzip
import json
import os
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ENV

DIGITS = os.path.join(os.path.dirname(__file__), "..", "..", "datasets", "digits.h5")


def _write_idx(path, array):
    """Write ``array`` in the idx format (big-endian dims, magic 0x0000 08 ndim)."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _to_28(images):
    big = images[:, 0].repeat(3, axis=1).repeat(3, axis=2)          # (N, 24, 24)
    big = np.pad(big, ((0, 0), (2, 2), (2, 2)))                      # (N, 28, 28)
    return (big.astype(np.uint16) * 255 // 16).astype(np.uint8)


def test_lenet_on_converted_mnist_format_reaches_high_accuracy(tmp_path):
    with h5py.File(DIGITS, "r") as f:
        parts = {s: (_to_28(f[s]["images"][()]), f[s]["labels"][()]) for s in ("train", "test")}
    src = tmp_path / "idx"
    src.mkdir()
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = parts[split]
        _write_idx(src / f"{prefix}-images-idx3-ubyte.gz", images)
        _write_idx(src / f"{prefix}-labels-idx1-ubyte.gz", labels)
    out = tmp_path / "mnist.h5"
    proc = subprocess.run([sys.executable, "-m", "ringnet.datasets", "convert", "mnist", str(src),
                           "--out", str(out)], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["train/images"][:, 0], parts["train"][0])
    proc = subprocess.run([sys.executable, "-m", "ringnet.train", "--model", "lenet",
                           "--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "4",
                           "--lr", "0.01", "--json", "--quiet"],
                          capture_output=True, text=True, env=ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["dataset"] == "mnist" and summary["model"] == "lenet"
    assert summary["test_accuracy"] >= 0.93, summary


@pytest.mark.parametrize("in_memory_mb, ends", [("0", True), ("1024", False)])
def test_a_data_file_rewritten_under_a_running_job(tmp_path, in_memory_mb, ends):
    """Read from the file (RINGNET_DATA_IN_MEMORY_MB=0), a rewrite stops the run at the next
    epoch with one line; held in memory, the run goes on and says once what it trains on."""
    import shutil
    import h5py
    data = tmp_path / "d.h5"
    shutil.copy(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "datasets", "digits.h5"), data)
    env = dict(os.environ, OMP_NUM_THREADS="1", RINGNET_BLAS_THREADS="1",
               RINGNET_DATA_IN_MEMORY_MB=in_memory_mb)
    proc = subprocess.Popen([sys.executable, "-m", "ringnet.train", "--dataset", str(data),
                             "--epochs", "60", "--no-progress", "--no-eval", "--batch-size", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        proc.stdout.readline()          # the header: training has started
        with h5py.File(data, "r+", locking=False) as f:     # the run holds a read lock
            f["train/labels"][0] = (f["train/labels"][0] + 1) % 10
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    if ends:
        assert proc.returncode == 2, err[-2000:]
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith(
            f"ringnet: error: data set file {data} was rewritten under the running job"), err
    else:
        assert proc.returncode == 0, err[-2000:]
        assert out.count(f"note: data set file {data} was rewritten on disk") == 1, out
