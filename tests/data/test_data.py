"""Data sets and sharded loading, checked against sklearn, NumPy references and N=1 runs."""
import re
import subprocess
import sys
import threading
import time
import types

import h5py
import numpy as np
import pytest

from ringnet.backend import gpu_available, to_numpy
from ringnet.data import (ShardedLoader, Split, check_compatible, default_data_dir,
                          iterate_eval, make_synthetic, open_dataset, write_dataset)
from ringnet.data.loader import PAD, _read, augment_batch, augment_params, normalize
from ringnet.errors import InputError

DIGITS = default_data_dir() / "digits.h5"


@pytest.fixture(scope="module")
def digits():
    with open_dataset("digits") as ds:
        yield ds


def small_split(n=50, shape=(3, 5, 4), seed=1):
    rng = np.random.default_rng(seed)
    return Split(rng.integers(0, 256, (n,) + shape, dtype=np.uint8),
                 rng.integers(0, 7, n))


def prefetch_threads():
    """Prefetch threads at work (a loader's thread waits between epochs as "... (idle)")."""
    return [t for t in threading.enumerate()
            if t.name.startswith("ringnet-prefetch") and not t.name.endswith("(idle)")]


# -- digits.h5 --------------------------------------------------------------------

def test_digits_file_contents(digits):
    assert len(digits.train) + len(digits.test) == 1797
    assert (len(digits.train), len(digits.test)) == (1437, 360)
    assert digits.input_shape == (1, 8, 8)
    assert digits.classes == [str(c) for c in range(10)]
    for split in (digits.train, digits.test):
        assert split.images.dtype == np.uint8 and split.labels.dtype == np.int64
        assert split.images.max() <= 16
        assert set(np.unique(split.labels)) == set(range(10))
    with h5py.File(DIGITS, "r") as f:
        assert f.attrs["licence"] == "CC BY 4.0"
        assert "10.24432/C50P49" in f.attrs["source"]
        train_idx, test_idx = f["train/source_index"][()], f["test/source_index"][()]
    assert np.array_equal(np.sort(np.concatenate([train_idx, test_idx])), np.arange(1797))


def test_digits_equal_sklearn(digits):
    sk = pytest.importorskip("sklearn.datasets").load_digits()
    with h5py.File(DIGITS, "r") as f:
        for name, split in (("train", digits.train), ("test", digits.test)):
            idx = f[name]["source_index"][()]
            assert np.array_equal(split.images[:, 0].astype(np.float64), sk.images[idx])
            assert np.array_equal(split.labels, sk.target[idx])


def test_channel_stats_match_numpy(digits):
    pixels = digits.train.images.astype(np.float64)
    np.testing.assert_allclose(digits.mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(digits.std, pixels.std(axis=(0, 2, 3)), rtol=1e-10)


def test_file_backed_equals_in_memory(digits):
    with open_dataset(str(DIGITS), in_memory=False) as lazy:
        assert not lazy.train.in_memory and lazy.name == "digits"
        np.testing.assert_allclose(lazy.std, digits.std, rtol=1e-10)
        a = ShardedLoader(lazy.train, 40, rank=1, size=2, prefetch=1)
        b = ShardedLoader(digits.train, 40, rank=1, size=2, prefetch=0)
        for (xa, ya), (xb, yb) in zip(a.epoch(3), b.epoch(3)):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


@pytest.mark.parametrize("chunks", [None, (1, 3, 5, 4), (7, 3, 5, 4)])
def test_file_reads_equal_numpy_indexing(tmp_path, chunks):
    split = small_split(n=50)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_dataset("x", data=split.images, chunks=chunks)
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "x.h5", "r") as f:
        for idx in (rng.permutation(50)[:13], np.array([49, 3, 3, 20, 21, 0]), np.arange(50),
                    np.array([], dtype=np.int64)):
            assert np.array_equal(_read(f["x"], idx), split.images[idx])



@pytest.mark.parametrize("prefetch", [0, 2])
def test_chunk_corrupted_after_open_names_file_and_rows(tmp_path, prefetch):
    """A file-backed split whose chunk goes bad after the open (validation passed): the
    batch that reads it raises InputError naming the file, the data set and the rows,
    and the batches before it are intact."""
    split = small_split(n=64, shape=(1, 8, 8))
    path = tmp_path / "d.h5"
    write_dataset(path, split.images, split.labels, split.images[:8], split.labels[:8], range(7))
    with h5py.File(path, "r+") as f:     # 8 images a chunk: row 40 is in the sixth
        del f["train/images"]
        f.create_dataset("train/images", data=split.images, chunks=(8, 1, 8, 8), compression="gzip")
    with open_dataset(str(path), in_memory=False) as ds:
        with h5py.File(path, "r") as f:
            info = f["train/images"].id.get_chunk_info_by_coord((40, 0, 0, 0))
        with open(path, "r+b") as raw:
            raw.seek(info.byte_offset + 8)
            raw.write(b"\xff" * (info.size - 16))
        loader = ShardedLoader(ds.train, 16, prefetch=prefetch, shuffle=False)
        got = []
        with pytest.raises(InputError, match=rf"{re.escape(str(path))}: /train/images 40\.\.47 cannot be read, "
                                             "the file is corrupt"):
            for x, _ in loader.epoch(0):
                got.append(x)
        assert len(got) == 2
        assert np.array_equal(np.concatenate(got), normalize(split.images[:32], None, None))
        with pytest.raises(InputError, match=r"/train/images 3 rows from 39 to 41 cannot be read"):
            ds.train.images[[39, 40, 41]]
    assert not prefetch_threads()

# -- batch order ------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_rank_parts_disjoint_and_cover(size):
    split = small_split(n=53)
    loaders = [ShardedLoader(split, 12, rank=r, size=size, seed=5) for r in range(size)]
    single = ShardedLoader(split, 12, seed=5)
    for epoch in (0, 1):
        for step in range(single.steps_per_epoch):
            parts = [ld.local_indices(epoch, step) for ld in loaders]
            assert all(len(p) == 12 // size for p in parts)
            joined = np.concatenate(parts)
            assert len(np.unique(joined)) == 12
            assert np.array_equal(joined, single.batch_indices(epoch, step))


def test_order_seed_epoch_and_no_shuffle():
    split = small_split(n=40)
    first = ShardedLoader(split, 8, seed=3)
    again = ShardedLoader(split, 8, seed=3)
    other_seed = ShardedLoader(split, 8, seed=4)
    order = lambda ld, e: np.concatenate([ld.batch_indices(e, s) for s in range(5)])
    assert np.array_equal(order(first, 0), order(again, 0))
    assert np.array_equal(order(first, 0), np.random.default_rng([3, 0]).permutation(40))
    assert not np.array_equal(order(first, 0), order(first, 1))
    assert not np.array_equal(order(first, 0), order(other_seed, 0))
    assert np.array_equal(np.sort(order(first, 1)), np.arange(40))
    fixed = ShardedLoader(split, 8, seed=3, shuffle=False)
    assert np.array_equal(order(fixed, 0), np.arange(40))
    assert np.array_equal(order(fixed, 7), np.arange(40))


def test_steps_per_epoch_and_last_batch():
    split = small_split(n=50)
    assert ShardedLoader(split, 8).steps_per_epoch == 6
    keep = ShardedLoader(split, 8, drop_last=False, shuffle=False)
    assert keep.steps_per_epoch == 7 == len(list(keep.epoch(0)))
    assert np.array_equal(keep.batch_indices(0, 6), np.arange(48, 50))
    parts = [ShardedLoader(split, 8, rank=r, size=4, drop_last=False, shuffle=False)
             .local_indices(0, 6) for r in range(4)]
    assert np.array_equal(np.concatenate(parts), [48, 49])
    with pytest.raises(IndexError):
        keep.batch_indices(0, 7)


@pytest.mark.parametrize("kwargs, words", [
    (dict(global_batch=10, size=4), "not divisible"),
    (dict(global_batch=0), "positive"),
    (dict(global_batch=64), "larger than"),
    (dict(global_batch=8, rank=2, size=2), "rank 2"),
    (dict(global_batch=8, mean=[1.0, 2.0]), "channels"),
])
def test_bad_loader_arguments(kwargs, words):
    with pytest.raises(InputError, match=words):
        ShardedLoader(small_split(n=50), **kwargs)


# -- batch contents ---------------------------------------------------------------

@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("float64", 1e-14)])
def test_normalisation_against_numpy(dtype, rtol):
    split = small_split(n=30)
    mean, std = np.array([10.0, 120.5, 250.0]), np.array([3.0, 60.0, 0.5])
    loader = ShardedLoader(split, 10, rank=1, size=2, seed=2, dtype=dtype,
                           mean=mean, std=std)
    for step, (x, y) in enumerate(loader.epoch(4)):
        idx = loader.local_indices(4, step)
        ref = (split.images[idx].astype(np.float64) - mean[:, None, None]) / std[:, None, None]
        assert x.dtype == np.dtype(dtype) and x.shape == (5, 3, 5, 4)
        np.testing.assert_allclose(x, ref, rtol=rtol, atol=rtol * 600)
        assert y.dtype == np.int64 and np.array_equal(y, split.labels[idx])


def test_prefetch_equals_no_prefetch():
    split = small_split(n=64)
    runs = []
    for prefetch in (0, 1, 3):
        loader = ShardedLoader(split, 8, rank=0, size=2, seed=9, prefetch=prefetch,
                               mean=[1, 2, 3], std=[4, 5, 6])
        runs.append([(x.copy(), y.copy()) for e in (0, 1) for x, y in loader.epoch(e)])
    assert len(runs[0]) == 16
    for other in runs[1:]:
        for (xa, ya), (xb, yb) in zip(runs[0], other):
            assert np.array_equal(xa, xb) and np.array_equal(ya, yb)


def test_start_step_resumes_the_epoch():
    split = small_split(n=64)
    loader = ShardedLoader(split, 8, seed=1)
    full = [y for _, y in loader.epoch(2)]
    tail = [y for _, y in loader.epoch(2, start_step=5)]
    assert len(tail) == 3 and all(np.array_equal(a, b) for a, b in zip(full[5:], tail))


class FailingImages:
    """File-like image array (one chunk) whose reads fail when they touch index ``bad``."""

    def __init__(self, images, bad):
        self.images, self.bad, self.shape, self.dtype = images, bad, images.shape, images.dtype
        self.chunks = images.shape

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        if index.start <= self.bad < index.stop:
            raise OSError("disk read failed")
        return self.images[index]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_reader_error_surfaces_in_consumer(prefetch):
    base = small_split(n=40)
    split = Split(FailingImages(base.images, bad=16), base.labels)
    loader = ShardedLoader(split, 8, prefetch=prefetch, shuffle=False)  # 16 is in batch 2
    got = []
    with pytest.raises(OSError, match="disk read failed"):
        for batch in loader.epoch(0):
            got.append(batch)
    assert len(got) == 2
    assert not prefetch_threads()


def test_abandoned_epoch_stops_the_thread():
    loader = ShardedLoader(small_split(n=200), 4, prefetch=2)
    gen = loader.epoch(0)
    next(gen)
    time.sleep(0.1)  # let the thread fill the queue and block on it
    assert prefetch_threads()
    gen.close()
    assert not prefetch_threads()
    gen = loader.epoch(1)
    next(gen)
    del gen  # dropped without close: finalised, same clean-up
    assert not prefetch_threads()


def test_wait_time_accumulates_when_reading_is_slow():
    class SlowImages(FailingImages):
        def __getitem__(self, index):
            time.sleep(0.02)
            return self.images[index]

    base = small_split(n=40)
    loader = ShardedLoader(Split(SlowImages(base.images, bad=-1), base.labels), 8, prefetch=1)
    list(loader.epoch(0))
    assert 5 * 0.02 * 0.8 <= loader.wait_s < 5.0


def test_iterate_eval_parts_cover_split():
    split = small_split(n=23)
    mean, std = [5, 6, 7], [2, 3, 4]
    for size in (1, 2, 3, 4):
        ys, xs = [], []
        for rank in range(size):
            for x, y in iterate_eval(split, 4, rank, size, mean=mean, std=std):
                assert len(y) <= 4
                xs.append(x)
                ys.append(y)
        assert np.array_equal(np.concatenate(ys), split.labels)
        ref = (split.images - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
        np.testing.assert_allclose(np.concatenate(xs), ref, rtol=1e-6)


class FakeCupy:
    """Just enough of CuPy's API, on NumPy, to run the loader's GPU code path on a CPU.

    Copies are synchronous here, so this checks the data flow (pinned slots, copy
    stream, events, threads), not the timing; the GPU test below runs it for real.
    """

    class ndarray(np.ndarray):
        def set(self, arr, stream=None):
            self[...] = arr

    class _Event:
        def synchronize(self):
            pass

    class _Stream:
        def __init__(self, non_blocking=False):
            self.waited = []

        def record(self):
            return FakeCupy._Event()

        def wait_event(self, event):
            self.waited.append(event)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class _Device:
        def __init__(self, device_id=0):
            self.id = device_id

        def use(self):
            pass

    def __init__(self):
        main = self._Stream()
        self.cuda = types.SimpleNamespace(
            Device=self._Device, Stream=self._Stream, get_current_stream=lambda: main,
            alloc_pinned_memory=bytearray)
        self.main = main
        self.subtract, self.divide = np.subtract, np.divide

    def empty(self, shape, dtype):
        return np.empty(shape, dtype).view(self.ndarray)

    def asarray(self, a, dtype=None):
        return np.asarray(a, dtype).view(self.ndarray)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_gpu_code_path_on_fake_device(monkeypatch, prefetch):
    fake = FakeCupy()
    monkeypatch.setattr("ringnet.data.loader.cupy", fake)
    split = small_split(n=90)
    kwargs = dict(rank=1, size=3, seed=4, mean=[9, 8, 7], std=[3, 2, 1], augment=True)
    reference = ShardedLoader(split, 9, **kwargs)
    device = ShardedLoader(split, 9, xp=fake, prefetch=prefetch, **kwargs)
    for epoch in (0, 1):
        got = list(device.epoch(epoch))
        want = list(reference.epoch(epoch))
        assert len(got) == len(want) == 10
        for (x, y), (xr, yr) in zip(got, want):
            assert isinstance(x, fake.ndarray) and x.dtype == np.float32
            assert np.array_equal(x, xr) and np.array_equal(y, yr)
    assert len(fake.main.waited) == 20  # the compute stream waited for every copy
    gen = device.epoch(2)
    next(gen)
    gen.close()
    assert not prefetch_threads()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_batches_equal_host_batches(dtype):
    import cupy
    split = small_split(n=96)
    kwargs = dict(rank=0, size=2, seed=6, dtype=dtype, mean=[9, 8, 7], std=[3, 2, 1])
    reference = list(ShardedLoader(split, 16, **kwargs).epoch(0))
    got = [(to_numpy(x), to_numpy(y)) for x, y in
           ShardedLoader(split, 16, xp=cupy, prefetch=2, **kwargs).epoch(0)]
    assert len(got) == len(reference) == 6
    for (x, y), (xr, yr) in zip(got, reference):
        np.testing.assert_allclose(x, xr, rtol=1e-6)
        assert np.array_equal(y, yr)
    assert not prefetch_threads()


# -- augmentation -----------------------------------------------------------------

def reference_augment(image, dy, dx, flip):
    padded = np.pad(image, ((0, 0), (PAD, PAD), (PAD, PAD)))
    crop = padded[:, dy:dy + image.shape[1], dx:dx + image.shape[2]]
    return crop[:, :, ::-1] if flip else crop


def test_augmentation_matches_per_sample_reference():
    split = small_split(n=64, shape=(3, 6, 7))
    idx = np.arange(64)
    dy, dx, flip = augment_params(11, 3, idx)
    assert set(dy) <= set(range(2 * PAD + 1)) and len(set(dx)) > 4
    assert 16 < flip.sum() < 48
    out = augment_batch(split.images, dy, dx, flip)
    for i in idx:
        assert np.array_equal(out[i], reference_augment(split.images[i], dy[i], dx[i], flip[i]))
    dy2, dx2, flip2 = augment_params(11, 4, idx)
    assert not (np.array_equal(dy, dy2) and np.array_equal(dx, dx2))


def test_augmentation_independent_of_world_size():
    split = small_split(n=48, shape=(3, 8, 8))
    one = ShardedLoader(split, 12, seed=2, augment=True)
    reference = [x for x, _ in one.epoch(1)]
    plain = [x for x, _ in ShardedLoader(split, 12, seed=2).epoch(1)]
    assert not np.array_equal(reference[0], plain[0])
    for size in (2, 3, 4):
        parts = [[x for x, _ in ShardedLoader(split, 12, rank=r, size=size, seed=2,
                                              augment=True).epoch(1)] for r in range(size)]
        for step in range(one.steps_per_epoch):
            joined = np.concatenate([parts[r][step] for r in range(size)])
            assert np.array_equal(joined, reference[step])


# -- open_dataset and check_compatible ----------------------------------------------

def test_missing_mnist_names_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGNET_DATA", str(tmp_path))
    monkeypatch.setattr("ringnet.data.catalog.default_data_dir", lambda: tmp_path / "none")
    with pytest.raises(InputError, match="python -m ringnet.datasets download mnist"):
        open_dataset("mnist")
    with pytest.raises(InputError, match="download cifar10 --dir"):
        open_dataset("cifar10", data_dir=tmp_path / "d")
    with pytest.raises(InputError, match="unknown data set"):
        open_dataset("imagenet")
    with pytest.raises(InputError, match="does not exist"):
        open_dataset(str(tmp_path / "missing.h5"))


def test_named_lookup_in_ringnet_data(tmp_path, monkeypatch):
    split = small_split(n=12, shape=(1, 28, 28))
    write_dataset(tmp_path / "mnist.h5", split.images, split.labels % 7, split.images[:4],
                  split.labels[:4] % 7, classes=range(10), name="mnist")
    monkeypatch.setenv("RINGNET_DATA", str(tmp_path))
    with open_dataset("mnist") as ds:
        assert ds.name == "mnist" and ds.input_shape == (1, 28, 28) and len(ds.test) == 4
        assert np.array_equal(ds.train.images, split.images)


def test_corrupt_and_wrong_layout_files(tmp_path):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(InputError, match="not a readable HDF5"):
        open_dataset(str(junk))
    wrong = tmp_path / "wrong.h5"
    with h5py.File(wrong, "w") as f:
        f["train/images"] = np.zeros((4, 1, 8, 8), np.uint8)
        f["train/labels"] = np.zeros(4, np.int64)
        f.attrs["classes"] = ["a", "b"]
    with pytest.raises(InputError, match="missing data set /test/images"):
        open_dataset(str(wrong))
    with h5py.File(wrong, "a") as f:
        f["test/images"] = np.zeros((2, 8, 8), np.uint8)
        f["test/labels"] = np.zeros(2, np.int64)
    with pytest.raises(InputError, match=r"/test/images must be uint8 \(N, C, H, W\)"):
        open_dataset(str(wrong))
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(DIGITS.read_bytes()[:DIGITS.stat().st_size // 2])
    with pytest.raises(InputError, match="truncated.h5"):
        open_dataset(str(truncated))


def test_check_compatible_messages(digits):
    check_compatible(digits, (1, 8, 8), 10)
    check_compatible(digits, (1, 8, 8), 12)  # a model with spare outputs still fits
    with pytest.raises(InputError, match="data set digits has images 1x8x8 but model lenet "
                                         "expects 1x28x28"):
        check_compatible(digits, (1, 28, 28), 10, model="lenet")
    with pytest.raises(InputError, match="10 classes but the model has only 5 outputs"):
        check_compatible(digits, (1, 8, 8), 5)


# -- synthetic --------------------------------------------------------------------

def test_synthetic_reproducible_and_learnable():
    a = open_dataset("synthetic", seed=3, input_shape=(3, 6, 5), num_classes=4,
                     synthetic_size=(200, 80))
    b = open_dataset("synthetic", seed=3, input_shape=(3, 6, 5), num_classes=4,
                     synthetic_size=(200, 80))
    c = make_synthetic((3, 6, 5), 4, 200, 80, seed=4)
    assert a.input_shape == (3, 6, 5) and a.num_classes == 4 and a.classes == list("0123")
    assert a.train.images.shape == (200, 3, 6, 5) and a.train.images.dtype == np.uint8
    assert np.array_equal(np.bincount(a.train.labels), [50] * 4)
    assert np.array_equal(a.train.images, b.train.images)
    assert np.array_equal(a.test.labels, b.test.labels)
    assert not np.array_equal(a.train.images, c[0])
    # Nearest class mean, fitted on train, must classify test well: the data is learnable.
    flat = lambda s: s.images.reshape(len(s), -1).astype(np.float64)
    centroids = np.stack([flat(a.train)[a.train.labels == k].mean(0) for k in range(4)])
    dist = ((flat(a.test)[:, None] - centroids[None]) ** 2).sum(-1)
    assert (dist.argmin(1) == a.test.labels).mean() > 0.9


def test_synthetic_needs_model_shape():
    with pytest.raises(InputError, match="input shape"):
        open_dataset("synthetic")


def test_every_epoch_runs_on_the_same_thread_which_ends_when_idle(monkeypatch):
    """One prefetch thread for all of a loader's epochs (a thread per epoch costs ~290 bytes
    of native memory each in an MPI process), idle between them, gone once idle for long."""
    started = []

    class Counted(threading.Thread):
        def start(self):
            started.append(self)
            super().start()
    monkeypatch.setattr(threading, "Thread", Counted)
    import ringnet.workers
    monkeypatch.setattr(ringnet.workers.Worker, "IDLE_S", 0.3)
    loader = ShardedLoader(small_split(n=40), 8, prefetch=2, rank=0)
    reference = ShardedLoader(small_split(n=40), 8, prefetch=0, rank=0)
    for epoch in range(30):
        got, want = list(loader.epoch(epoch)), list(reference.epoch(epoch))
        assert all(np.array_equal(x, xr) and np.array_equal(y, yr)
                   for (x, y), (xr, yr) in zip(got, want)) and len(got) == len(want) == 5
        assert not prefetch_threads()
    assert len(started) == 1
    (worker,) = started
    assert worker.name == "ringnet-prefetch-r0 (idle)" and worker.is_alive()
    worker.join(5)
    assert not worker.is_alive()                    # ended after IDLE_S without a job
    assert len(list(loader.epoch(0))) == 5          # the next epoch starts a new one
    assert len(started) == 2 and started[1] is not worker


EXIT_SCRIPT = """
import sys
import numpy as np
from ringnet.data import ShardedLoader, Split
rng = np.random.default_rng(0)
split = Split(rng.integers(0, 256, (200, 3, 5, 4), dtype=np.uint8), rng.integers(0, 7, 200))
batches = ShardedLoader(split, 4, prefetch=2).epoch(0)
next(batches)
cycle = {"epoch": batches}
cycle["self"] = cycle   # the epoch still open, freed only by the exit's last collection
del batches
sys.exit(3)
"""


def test_an_epoch_left_open_at_exit_does_not_hold_the_exit():
    """An error ends the run with an epoch's prefetch running: the interpreter's exit closes
    the generator after its daemon thread is gone, and must not wait for that thread."""
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], timeout=60, capture_output=True,
                          text=True)
    assert proc.returncode == 3, proc.stderr
